"""Training step benchmarks.

CPU mode (default): step time and peak memory against global batch size, direct vs GradCache (tiny
model). Each configuration runs in a fresh subprocess: peak memory is the process's max RSS
(``resource.getrusage``), reported whole and as the increase over the RSS after setup (model loaded,
batch tokenized), which is what the step itself costs. One step = forward + backward of one global
batch (queries, positives, one hard negative each) with HardNegativeNLLLoss, LoRA r=4.

    python bench/train.py --out bench/results/train.md

GPU mode (``--gpu``): one LoRA contrastive optimizer step on the Qwen2.5-7B (Dream-7B) shape with random
bf16 weights, through ``EncoderTrainer.training_step`` (GradCache included) and AdamW on the adapter:
32 triples (queries of 16-64 tokens, positives and negatives of 128-400), LoRA r 16 on all seven
projections, HardNegativeNLLLoss, bf16 autocast as the Trainer's. Each configuration (padded or packed,
activation checkpointing on or off, GradCache 4 chunks or direct, 32 or 512 triples) runs in a fresh
process; it prints tokens/s, MFU against the bf16 matmul peak measured in the same process, and peak
memory. ``--dry-run`` runs the same code on the CPU with a tiny shape in float32 (what the test runs).

    python bench/train.py --gpu --out bench/results/train_gpu.md
    python bench/train.py --gpu --profile "packed, GradCache"   # where one step's time goes
    python bench/train.py --gpu --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "fixtures" / "llm2vec_parity" / "llama"
FILLER = " It was described in the old notes together with its colour, size, age and where it was last seen."


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(batch: int, chunk: int | None, steps: int, max_length: int) -> dict:
    import torch

    from diffusion_embedder.data import ContrastiveCollator, TrainSample
    from diffusion_embedder.losses import HardNegativeNLLLoss
    from diffusion_embedder.training.arguments import validate
    from diffusion_embedder.training.supervised import prepare_encoder
    from diffusion_embedder.training.trainer import EncoderTrainer

    torch.manual_seed(0)
    cfg = validate(
        {
            "model_name_or_path": str(MODEL),
            "dataset_name": "Custom",
            "output_dir": "/tmp/bench_train",
            "report_to": "none",
            "bidirectional": True,
            "max_seq_length": max_length,
            "lora_r": 4,
            "use_cpu": True,
            "per_device_train_batch_size": batch,
        }
    )
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    samples = [
        TrainSample(
            query=("Retrieve the passage;", f"Which object number {i} is it?" + FILLER),
            positive=("", f"Object number {i} is the one." + FILLER * 2),
            negatives=[("", f"Object number {i + 1} is another one." + FILLER * 2)],
            group="g",
        )
        for i in range(batch)
    ]
    trainer = EncoderTrainer(
        model=encoder,
        args=cfg.training,
        train_dataset=samples,
        data_collator=ContrastiveCollator(encoder),
        loss_fn=HardNegativeNLLLoss(),
        grad_cache_chunk_size=chunk,
    )
    inputs = trainer.data_collator(samples)
    tokens = int(inputs["positive"]["input_ids"].shape[1])
    baseline = rss_mib()
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        trainer.training_step(trainer.model, inputs)
        encoder.zero_grad()
        times.append(time.perf_counter() - start)
    return {"step_s": sum(times[1:]) / steps, "peak_mib": rss_mib(), "baseline_mib": baseline, "doc_tokens": tokens}


# ---------------------------------------------------------------------------------------------- GPU mode
@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """The GPU step's sizes, or the dry run's (tiny shape, float32, on the CPU)."""

    shape: str  # a SHAPES_7B name, or "tiny"
    dtype: str
    query_tokens: tuple[int, int]
    passage_tokens: tuple[int, int]
    triples: int  # the step's global batch
    large: int  # the GradCache memory-flatness batch
    chunk: int  # GradCache texts per chunk (4 chunks per column at ``triples``)
    pack_length: int
    max_length: int
    steps: int  # timed steps (one at ``large``)
    matmul: int  # square size of the peak-measuring matmul


GPU_PLAN = GpuPlan("qwen2.5-7b", "bfloat16", (16, 64), (128, 400), 32, 512, 8, 2048, 512, 3, 8192)
DRY_PLAN = GpuPlan("tiny", "float32", (8, 16), (16, 48), 8, 32, 2, 128, 64, 2, 512)
@dataclasses.dataclass(frozen=True)
class StepConfig:
    packed: bool
    checkpointing: bool | str  # activation checkpointing: every layer, none, or "auto" (the memory policy)
    grad_cache: bool  # GradCache with ``plan.chunk`` texts per chunk, else the direct path
    large: bool = False  # ``plan.large`` triples instead of ``plan.triples``
    lora_dropout: float = 0.05  # LLM2Vec's; 0 lets peft skip the dropout copy of each adapted layer's input
    liger: bool = False  # use_liger_kernel (RMSNorm, rotary, SwiGLU)
    compile: bool = False  # compile_layers (regional torch.compile; aot_eager in the CPU dry run)
    varlen: bool = False  # attn_implementation "varlen" (torch's flash varlen kernel; the reference path on a CPU)


GPU_CONFIGS = {
    "padded, ckpt, direct": StepConfig(False, True, False),  # a hand-written step measured 4.1k tokens/s (H200)
    "packed, ckpt, direct": StepConfig(True, True, False),  # issue: 5.2k tokens/s
    "padded, direct": StepConfig(False, False, False),
    "packed, direct": StepConfig(True, False, False),
    "padded, GradCache": StepConfig(False, False, True),
    "packed, GradCache": StepConfig(True, False, True),
    "packed, ckpt, GradCache": StepConfig(True, True, True),
    "packed, GradCache, LoRA dropout 0": StepConfig(True, False, True, lora_dropout=0.0),
    "packed, GradCache, large": StepConfig(True, False, True, large=True),
}
QUICK = ["padded, ckpt, direct", "packed, ckpt, direct", "packed, GradCache", "packed, GradCache, large"]
#: The fast paths (``--speed``): the checkpointing policy, Liger Kernel and regional compilation, alone and
#: together, beside "packed, ckpt, direct".
SPEED_CONFIGS = {  # packed rows on varlen: what the supervised stage trains on with CUDA (pack_length "auto")
    "packed, varlen, ckpt, direct": StepConfig(True, True, False, varlen=True),
    "packed, varlen, GradCache": StepConfig(True, False, True, varlen=True),
    "packed, varlen, ckpt auto, direct": StepConfig(True, "auto", False, varlen=True),
    "packed, varlen, ckpt auto, Liger, direct": StepConfig(True, "auto", False, liger=True, varlen=True),
    "packed, varlen, ckpt auto, compile, direct": StepConfig(True, "auto", False, compile=True, varlen=True),
    "packed, varlen, ckpt auto, Liger, compile, direct": StepConfig(True, "auto", False, liger=True, compile=True,
                                                                    varlen=True),
}
GPU_CONFIGS.update(SPEED_CONFIGS)
SPEED = ["packed, ckpt, direct", *SPEED_CONFIGS]


def matmul_peak(device: str, n: int, dtype) -> float:
    """Measured dense matmul throughput (FLOP/s) at ``dtype``: the MFU denominator, same process and device."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start, iters = time.perf_counter(), 10
    for _ in range(iters):
        a @ b
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - start)


def step_flops(lengths: list[int], params: int, hidden: int, layers: int) -> float:
    """Useful FLOPs of one step over frozen base weights: forward (2 x params per token) and backward to the
    inputs (as much again), attention within each text (forward 4 n^2 h per layer, backward twice that).
    Recomputation (activation checkpointing) and GradCache's first forward are overhead, not counted."""
    return sum(4 * params * n + 12 * n * n * hidden * layers for n in lengths)


def host_syncs(step) -> dict[str, int] | None:
    """Where one more ``step()`` makes the host wait for the GPU: synchronising calls by Python call site
    (None if the sync warnings do not reach Python here)."""
    import collections
    import warnings

    import torch

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            torch.zeros(1, device="cuda").item()  # a known synchronisation: proves the warnings arrive
            probe = len(caught)
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if not probe:
        return None
    sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught[probe:]
                                if "synchroniz" in str(w.message))  # fmt: skip
    return dict(sites.most_common())


def cpu_host_syncs(step) -> dict[str, int]:
    """On the CPU: where one more ``step()`` would make the host wait for an accelerator (``host_syncs``)."""
    from diffusion_embedder.host_syncs import HostSyncs

    with HostSyncs() as syncs:
        step()
    return dict(syncs.sites.most_common())


def profile_table(step, device: str) -> str:
    """The 25 most expensive kernels (or CPU ops) of one more ``step()``: where the rest of the time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=25)


def gpu_worker(config: str, dry_run: bool, profile: bool = False) -> dict:
    import torch

    from diffusion_embedder import compilation
    from diffusion_embedder.data import ContrastiveCollator, TrainSample
    from diffusion_embedder.losses import HardNegativeNLLLoss
    from diffusion_embedder.random_models import SHAPES_7B, TINY_SHAPE, random_encoder
    from diffusion_embedder.training.arguments import validate
    from diffusion_embedder.training.checkpointing import enable_checkpointing
    from diffusion_embedder.training.liger import apply_liger
    from diffusion_embedder.training.lora import add_lora
    from diffusion_embedder.training.trainer import EncoderTrainer, text_columns

    plan = DRY_PLAN if dry_run else GPU_PLAN
    step_config = GPU_CONFIGS[config]
    packed, grad_cache, large = step_config.packed, step_config.grad_cache, step_config.large
    triples = plan.large if large else plan.triples
    device, dtype = ("cpu" if dry_run else "cuda"), getattr(torch, plan.dtype)
    peak = matmul_peak(device, plan.matmul, dtype)
    model_type, dims = TINY_SHAPE if dry_run else SHAPES_7B[plan.shape]
    encoder = random_encoder(model_type, dims, MODEL, device=device, dtype=dtype, max_length=plan.max_length,
                             attn="varlen" if step_config.varlen else "sdpa")
    cfg = validate({"model_name_or_path": str(MODEL), "dataset_name": "Custom", "output_dir": "/tmp/bench_train_gpu",
                    "report_to": "none", "lora_r": 16, "use_cpu": dry_run, "bf16": not dry_run,
                    "activation_checkpointing": step_config.checkpointing, "lora_dropout": step_config.lora_dropout,
                    "use_liger_kernel": step_config.liger,
                    "per_device_train_batch_size": triples})  # fmt: skip
    encoder.model = add_lora(encoder.model, cfg.custom)  # r 16 on all seven projections
    graph_tokens = (plan.chunk if grad_cache else 3 * triples) * plan.max_length  # what "auto" plans for
    checkpointed = enable_checkpointing(encoder.model, cfg.training, graph_tokens)
    apply_liger(encoder.model, cfg.training)
    if step_config.compile:
        compilation.BACKEND = "aot_eager" if dry_run else compilation.BACKEND  # inductor takes minutes on a CPU
        compilation.compile_layers(encoder.model)

    g = torch.Generator().manual_seed(0)
    tokenizer = encoder.tokenizer

    def text(bounds: tuple[int, int]) -> str:
        n = int(torch.randint(bounds[0], bounds[1] + 1, (1,), generator=g))
        return tokenizer.decode(torch.randint(10, len(tokenizer) - 10, (n,), generator=g).tolist())

    samples = [TrainSample(query=("Retrieve the passage that answers the question", text(plan.query_tokens)),
                           positive=("", text(plan.passage_tokens)), negatives=[("", text(plan.passage_tokens))])
               for _ in range(triples)]  # fmt: skip
    collator = ContrastiveCollator(encoder, num_negatives=1, pack_length=plan.pack_length if packed else None,
                                   chunk_size=plan.chunk if grad_cache else None)  # as build_trainer: packed by chunk
    trainer = EncoderTrainer(model=encoder, args=cfg.training, train_dataset=samples, data_collator=collator,
                             loss_fn=HardNegativeNLLLoss(), grad_cache_chunk_size=plan.chunk if grad_cache else None)
    optimizer = trainer.create_optimizer()  # AdamW on the adapter (the only trainable tensors)
    inputs = collator(samples)
    columns = text_columns(inputs)[0]
    lengths = [n for c in columns for n in c["attention_mask"].sum(-1).tolist()]
    processed = sum(int(c["input_ids"].numel()) for c in columns)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> None:
        with trainer.accelerator.autocast():  # bf16 autocast, as the Trainer's prepared model runs
            trainer.training_step(trainer.model, inputs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()  # warm-up
    sync()
    steps = 1 if large else plan.steps
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    memory = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else rss_mib() / 1024
    syncs = host_syncs(step) if device == "cuda" else cpu_host_syncs(step)
    table = profile_table(step, device) if profile else None
    params = sum(p.numel() for n, p in encoder.model.named_parameters() if p.dim() > 1 and "lora_" not in n)
    params -= dims["vocab_size"] * dims["hidden_size"]  # the embedding is a lookup
    flops = step_flops(lengths, params, dims["hidden_size"], dims["num_hidden_layers"])
    return dict(config=config, triples=triples, real_tokens=sum(lengths), padding_efficiency=sum(lengths) / processed,
                s_per_step=seconds, tokens_per_s=sum(lengths) / seconds, mfu=flops / seconds / peak,
                peak_tflops=peak / 1e12, peak_gib=memory, sync_sites=syncs,
                host_syncs=None if syncs is None else sum(syncs.values()), profile=table, checkpointed=checkpointed,
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu")  # fmt: skip


def gpu_report(rows: list[dict], plan: GpuPlan, command: str) -> str:
    lines = ["| configuration | triples | real tokens | padding eff. | s/step | tokens/s | MFU | peak GiB | syncs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if "not_run" in r:
            lines.append(f"| {r['config']} | | | | not run: {r['not_run']} | | | | |")
            continue
        if "error" in r:
            said = r["error"] if r["error"].startswith("not run") else f"failed: {r['error']}"
            lines.append(f"| {r['config']} | | | | {said} | | | | |")
            continue
        lines.append(f"| {r['config']} | {r['triples']} | {r['real_tokens']} | {r['padding_efficiency']:.3f} | "
                     f"{r['s_per_step']:.3f} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | {r['peak_gib']:.1f} | "
                     f"{'n/a' if r['host_syncs'] is None else r['host_syncs']} |")
    done = {r["config"]: r for r in rows if "error" not in r and "not_run" not in r}
    notes = []
    for cached, direct in (("packed, GradCache", "packed, direct"), ("packed, GradCache", "packed, ckpt, direct")):
        if cached in done and direct in done:
            ratio = done[direct]["tokens_per_s"] / done[cached]["tokens_per_s"]
            notes.append(f"- time per token, {cached} / {direct}: {ratio:.2f} (goal <= 1.10)")
    if "packed, GradCache" in done and "packed, GradCache, large" in done:
        big, small = done["packed, GradCache, large"], done["packed, GradCache"]
        growth = big["peak_gib"] / small["peak_gib"] - 1
        span = f"{big['triples']} vs {small['triples']} triples"
        notes.append(f"- peak memory, GradCache {span}: {growth:+.1%} (goal: within 10%)")
    device = rows[0].get("device", "?") if rows else "?"
    peak = next((r["peak_tflops"] for r in rows if "peak_tflops" in r), float("nan"))
    header = [f"Command: `{command}`; device: {device}; measured {plan.dtype} matmul peak {peak:.3g} TFLOP/s "
              f"({plan.matmul}^3); shape {plan.shape}; LoRA r 16 on all seven projections; {plan.chunk} texts per "
              "GradCache chunk; MFU counts forward + backward to the inputs only; syncs: synchronising calls in one "
              "step (torch.cuda.set_sync_debug_mode on CUDA, diffusion_embedder.host_syncs on a CPU), their call "
              "sites in the JSON rows. An MFU that counts the recomputed forward too (39 GFLOP/token at 7B) is 1.5x "
              "this one; tokens/s compare directly.", ""]  # fmt: skip
    return "\n".join(header + lines + [""] + notes) + "\n"


def run_row(name: str, args: argparse.Namespace, timeout: float | None) -> dict:
    """One configuration in a fresh process, stopped at ``timeout`` seconds (None: no limit)."""
    if GPU_CONFIGS[name].liger and not liger_installed():
        print(f"NOT RUN {name}: {NO_LIGER}", flush=True)
        return dict(config=name, not_run=NO_LIGER)
    command = [sys.executable, __file__, "--gpu-worker", name] + (["--dry-run"] if args.dry_run else [])
    command += ["--profile", name] if args.profile else []
    try:
        out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(config=name, error=f"stopped at the time budget ({timeout:.0f} s)")
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"FAILED {name}:\n{out.stderr[-2000:]}", flush=True)
        return dict(config=name, error=last[:200])
    row = json.loads(out.stdout.strip().splitlines()[-1])
    table = row.pop("profile")
    if table:
        print(table, flush=True)
        if args.out:
            args.out.with_suffix(".profile.txt").write_text(table)
    return row


NO_LIGER = "liger-kernel does not import here (pip install 'diffusion-embedder[liger]'; it needs triton)"


def liger_installed() -> bool:
    from transformers.utils import is_liger_kernel_available

    return is_liger_kernel_available()


def gpu_main(args: argparse.Namespace) -> None:
    """Each row in turn; with ``--budget`` a row may take what is left and later rows are reported as not run.
    Every row is written (``--out``: the table, and its JSON rows beside it) as soon as it is measured."""
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    names = [args.profile] if args.profile else args.rows or (
        QUICK if args.quick else SPEED if args.speed else list(GPU_CONFIGS))
    flags = " --dry-run" * args.dry_run + " --quick" * args.quick + " --speed" * args.speed
    flags += f' --profile "{args.profile}"' if args.profile else ""
    flags += "".join(f' --rows "{name}"' for name in args.rows or ())
    flags += f" --budget {args.budget:g}" if args.budget else ""
    start, rows = time.perf_counter(), []
    for name in names:
        left = args.budget - (time.perf_counter() - start) if args.budget else None
        if left is not None and left < 1:
            rows.append(dict(config=name, error="not run: the time budget was spent"))
        else:
            rows.append(run_row(name, args, left))
        print(rows[-1], flush=True)
        report = gpu_report(rows, plan, f"python bench/train.py --gpu{flags}")
        if args.out:
            args.out.write_text(report)
            args.out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if args.jsonl:
            with args.jsonl.open("a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    print(report)
    if any("error" in r for r in rows):
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--chunk", type=int, default=16, help="GradCache chunk size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gpu", action="store_true", help="GPU mode: the 7B-shaped LoRA step (module docstring)")
    parser.add_argument("--dry-run", action="store_true", help="GPU mode on the CPU with a tiny shape")
    parser.add_argument("--quick", action="store_true", help="GPU mode: only " + "; ".join(QUICK))
    parser.add_argument("--speed", action="store_true", help="GPU mode: only " + "; ".join(SPEED))
    parser.add_argument("--profile", default=None, choices=list(GPU_CONFIGS),
                        help="GPU mode: this configuration only, with the profile of one step (torch.profiler)")
    parser.add_argument("--rows", action="append", choices=list(GPU_CONFIGS), default=None,
                        help="GPU mode: these configurations (repeat the flag), in this order")
    parser.add_argument("--budget", type=float, default=None,
                        help="GPU mode: seconds for all rows; a row may take what is left, later ones are not run")
    parser.add_argument("--jsonl", type=Path, default=None,
                        help="GPU mode: append each row to this file as soon as it is measured")
    parser.add_argument("--gpu-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gpu_worker:
        print(json.dumps(gpu_worker(args.gpu_worker, args.dry_run, profile=bool(args.profile))))
        return
    if args.gpu:
        gpu_main(args)
        return
    if args.worker:
        batch, chunk = json.loads(args.worker)
        print(json.dumps(worker(batch, chunk, args.steps, args.max_length)))
        return

    rows = []
    for batch in args.batches:
        for chunk in (None, args.chunk):
            spec = json.dumps([batch, chunk])
            command = [sys.executable, __file__, "--worker", spec, "--steps", str(args.steps)]
            command += ["--max-length", str(args.max_length)]
            out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"batch": batch, "mode": "direct" if chunk is None else f"GradCache ({chunk})", **result})
            print(rows[-1], flush=True)

    lines = [
        "| global batch | mode | step (s) | peak RSS (MiB) | step's increase over setup RSS (MiB) |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        increase = r["peak_mib"] - r["baseline_mib"]
        lines.append(f"| {r['batch']} | {r['mode']} | {r['step_s']:.3f} | {r['peak_mib']:.0f} | {increase:.1f} |")
    growth = {}
    for mode in {r["mode"] for r in rows}:
        mine = [r for r in rows if r["mode"] == mode]
        growth[mode] = (mine[-1]["peak_mib"] / mine[0]["peak_mib"] - 1) * 100
    span = f"from batch {args.batches[0]} to {args.batches[-1]}"
    summary = [f"- peak RSS growth {span}, {m}: {g:+.1f}%" for m, g in sorted(growth.items())]
    report = "\n".join(
        [
            "# Training step: time and peak memory vs global batch (CPU, tiny model)",
            "",
            "Command (from the repository root):",
            "",
            "```",
            f"python bench/train.py --batches {' '.join(map(str, args.batches))} --chunk {args.chunk} "
            f"--steps {args.steps} --max-length {args.max_length} --out bench/results/train.md",
            "```",
            "",
            f"Machine: {platform.processor() or platform.machine()}, {platform.system()}, Python "
            f"{platform.python_version()}; single process, CPU. Model: the tiny Llama fixture (hidden 64, 2 layers) "
            f"with LoRA r=4; max length {args.max_length}; texts of ~{rows[0]['doc_tokens']} tokens; one hard negative "
            "per query; HardNegativeNLLLoss. Step = forward + backward (no optimizer). Each row is a fresh process.",
            "",
            *lines,
            "",
            *summary,
            "",
            "The 7B-shaped GPU step (LoRA, bf16, 32 triples) is `python bench/train.py --gpu`.",
            "",
        ]
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
