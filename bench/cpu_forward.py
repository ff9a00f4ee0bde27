"""CPU ``encode``: what the key-padding mask and two forwards at once each buy, against the path before them.

    python bench/cpu_forward.py --out bench/results/cpu_forward.md

Three settings, each run in its own process, alternating, ``--repeats`` times:

- before: transformers' (B, 1, L, L) mask, one forward at a time (``DIFFUSION_EMBEDDER_CPU_FORWARDS=1``; the key
  mask switched off in this benchmark's process only);
- key mask: the (B, 1, 1, L) key-padding mask, one forward at a time;
- the default: the key mask and two forwards at once.

Two models: the fixture encoder (hidden 64, 2 layers, the mining benchmark's) on synthetic passages of 20-80
words, and a random Qwen2 shape (hidden 256, 4 layers, ``bench/encode.py``'s CPU preset) on real ReasonAug texts
cut at 512 tokens. Batch size 32, mean pooling, float32. Each row reports the best and median wall time, and the
largest difference of its vectors from the "before" run's (0 means bit for bit the same).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"before": ("1", False), "key mask": ("1", True), "key mask, two forwards at once (default)": (None, True)}


def child(model: str, key_mask: bool, num_texts: int, out: str) -> None:
    import torch

    from diffusion_embedder import packing

    if not key_mask:
        packing.KEY_MASK_BUILDERS.clear()
    if model == "fixture":
        import random

        from mine import FIXTURE, words

        from diffusion_embedder import Encoder

        rng, vocab = random.Random(1), words()
        weights = [1 / (i + 1) for i in range(len(vocab))]
        texts = [" ".join(rng.choices(vocab, weights, k=rng.randint(20, 80))) for _ in range(num_texts)]
        encoder = Encoder.from_pretrained(str(FIXTURE), skip_instruction=False, pooling_mode="mean")
    else:
        from encode import DEFAULT_DATA, build_encoder, load_corpus

        texts = load_corpus(DEFAULT_DATA, num_texts)
        encoder = build_encoder("tiny", "cpu", "float32", "sdpa", 512)
    encoder.encode(texts[:64], batch_size=32, show_progress_bar=False)  # warm-up
    start = time.perf_counter()
    vectors = encoder.encode(texts, batch_size=32, show_progress_bar=False, convert_to_numpy=True)
    wall = time.perf_counter() - start
    np.save(out, vectors)
    print(json.dumps({"wall": wall, "threads": torch.get_num_threads()}))


def sdpa_rows() -> list[str]:
    """SDPA alone at the fixture encoder's shape (32 rows of 200-230 tokens, 4 heads of 16): the expanded
    (B, 1, L, L) mask against the key-padding mask, best of 20 calls each, alternating."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(32, 4, 230, 16, generator=generator) for _ in range(3))
    lengths = torch.randint(200, 231, (32,), generator=generator)
    keys = torch.arange(230)[None, :] < lengths[:, None]
    masks = {"(B, 1, L, L), as transformers builds it": (keys[:, None, None, :] & keys[:, None, :, None]),
             "(B, 1, 1, L), the key-padding mask": keys[:, None, None, :]}
    best = dict.fromkeys(masks, float("inf"))
    for _ in range(20):
        for name, mask in masks.items():
            start = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            best[name] = min(best[name], time.perf_counter() - start)
    first = next(iter(best.values()))
    return [f"### SDPA alone (32 x 4 heads x 230 tokens x 16, float32, {torch.get_num_threads()} threads)",
            "", "| mask | best call (ms) | speed-up |", "|---|---:|---:|",
            *(f"| {name} | {t * 1e3:.2f} | {first / t:.2f}x |" for name, t in best.items()), ""]


def run(model: str, setting: str, num_texts: int, out: str) -> dict:
    forwards, key_mask = SETTINGS[setting]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "bench")]), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("DIFFUSION_EMBEDDER_CPU_FORWARDS", None)
    if forwards is not None:
        env["DIFFUSION_EMBEDDER_CPU_FORWARDS"] = forwards
    result = subprocess.run([sys.executable, __file__, "--child", model, str(int(key_mask)), str(num_texts), out],
                            capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fixture-texts", type=int, default=4000)
    parser.add_argument("--qwen-texts", type=int, default=512)
    parser.add_argument("--out", help="write the markdown here (default: print it)")
    args = parser.parse_args()
    if args.child:
        model, key_mask, num_texts, out = args.child
        child(model, key_mask == "1", int(num_texts), out)
        return
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = ["# CPU forwards: the key-padding mask and two forwards at once", "",
             f"Command: `python bench/cpu_forward.py {' '.join(sys.argv[1:])}`", "",
             f"Date {datetime.date.today()}, commit {commit}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
             f"load average at start {', '.join(f'{x:.1f}' for x in os.getloadavg())}.", ""]
    folder = Path(tempfile.mkdtemp(prefix="bench_cpu_forward_"))
    models = {"fixture": ("the fixture encoder (hidden 64, 2 layers), synthetic passages", args.fixture_texts),
              "qwen2": ("random Qwen2 shape (hidden 256, 4 layers), ReasonAug texts cut at 512", args.qwen_texts)}
    for model, (title, num_texts) in models.items():
        walls: dict[str, list[float]] = {name: [] for name in SETTINGS}
        threads = 0
        for _ in range(args.repeats):
            for name in SETTINGS:
                result = run(model, name, num_texts, str(folder / f"{model}-{list(SETTINGS).index(name)}.npy"))
                walls[name].append(result["wall"])
                threads = result["threads"]
                print(model, name, f"{result['wall']:.2f} s", flush=True)
        before = np.load(folder / f"{model}-0.npy")
        lines += [f"### {title}: {num_texts} texts, {threads} intra-op threads", "",
                  "| setting | best wall (s) | median wall (s) | speed-up (best, vs before) | "
                  "largest difference from before |", "|---|---:|---:|---:|---:|"]
        for index, (name, runs) in enumerate(walls.items()):
            vectors = np.load(folder / f"{model}-{index}.npy")
            lines.append(f"| {name} | {min(runs):.2f} | {statistics.median(runs):.2f} | "
                         f"{min(walls['before']) / min(runs):.2f}x | {np.abs(vectors - before).max():.1e} |")
        lines.append("")
    lines += sdpa_rows()
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
