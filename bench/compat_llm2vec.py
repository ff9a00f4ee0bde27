"""Folders saved with ``Encoder.save(path, merge_before_save=True)`` in LLM2Vec 0.2.3: same vectors?

``save OUT``  (our environment): for each tiny encoder (Llama and Mistral fixtures x pooling modes x
              skip_instruction, plus one with a merged LoRA adapter) encode the inputs, save the merged
              folder to OUT/<name>, and write OUT/<name>/expected.json; one more LoRA encoder is saved
              unmerged (an adapter folder, loaded over its base as the model card says).
``check OUT`` (LLM2Vec 0.2.3's environment, transformers 4.44.2): load each folder with
              ``LLM2Vec.from_pretrained``, encode the same inputs, print the largest difference per
              folder; exit status 1 when one exceeds the tolerance or fails to load.
Run both through ``bench/compat_llm2vec.sh``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5
#: Two encode calls: pairs, then plain strings (LLM2Vec reads a string inside a list of pairs as a pair of
#: its first two characters, so the forms are not mixed).
INPUTS = [
    [
        ["Given a math problem, retrieve the relevant theorem", "A triangle has sides 3, 4 and 5. Find its area."],
        ["", "Two pointers sweep the array from both ends."],
        ["Retrieve text based on user query", "What is the capital of France? It is a city on the Seine."],
        ["Find the formula", "x"],
    ],
    ["A plain string is the pair ['', text].", "Short.", "Another plain string, a little longer than that."],
]
POOLING = [("mean", True), ("mean", False), ("weighted_mean", True), ("eos_token", False), ("last_token", False),
           ("bos_token", True)]


def save(out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from diffusion_embedder import Encoder

    fixtures = ROOT / "tests" / "fixtures" / "llm2vec_parity"
    cases = [(f"{fx}-{mode}-skip{int(skip)}", fx, mode, skip, False, True) for fx in ("llama", "mistral")
             for mode, skip in POOLING]
    cases.append(("llama-mean-lora", "llama", "mean", True, True, True))
    cases.append(("llama-mean-lora-adapter", "llama", "mean", True, True, False))
    for name, fixture, mode, skip, lora, merge in cases:
        encoder = Encoder.from_pretrained(str(fixtures / fixture), pooling_mode=mode, skip_instruction=skip,
                                          torch_dtype=torch.float32, device="cpu")
        if lora:  # a trained-looking adapter: merged into the weights by save(merge_before_save=True)
            torch.manual_seed(0)
            encoder.model = get_peft_model(encoder.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
            with torch.no_grad():
                for param_name, param in encoder.model.named_parameters():
                    if "lora_B" in param_name:
                        param.normal_(0, 0.05)
        expected = [encoder.encode(batch, batch_size=2, show_progress_bar=False).tolist() for batch in INPUTS]
        folder = out / name
        encoder.save(str(folder), merge_before_save=merge)
        record = {"inputs": INPUTS, "embeddings": expected}
        if not merge:  # LLM2Vec.from_pretrained(base, peft_model_name_or_path=folder)
            record["base"] = str(fixtures / fixture)
        (folder / "expected.json").write_text(json.dumps(record))
    print(f"saved {len(cases)} folders to {out}")


def check(out: Path) -> int:
    import numpy as np
    import torch
    from llm2vec import LLM2Vec

    worst, failed = 0.0, []
    print("| folder | max abs difference |\n|---|---|")
    for folder in sorted(p for p in out.iterdir() if (p / "expected.json").is_file()):
        expected = json.loads((folder / "expected.json").read_text())
        try:
            base, adapter = (expected["base"], str(folder)) if "base" in expected else (str(folder), None)
            model = LLM2Vec.from_pretrained(base, peft_model_name_or_path=adapter, enable_bidirectional=True,
                                            torch_dtype=torch.float32)
            diff = 0.0
            for batch, vectors in zip(expected["inputs"], expected["embeddings"], strict=True):
                got = model.encode(batch, batch_size=2, show_progress_bar=False).numpy()
                diff = max(diff, float(np.abs(got - np.array(vectors, dtype=np.float32)).max()))
        except Exception as err:  # noqa: BLE001 - report every folder, then fail
            print(f"| {folder.name} | failed to load: {type(err).__name__}: {err} |")
            failed.append(folder.name)
            continue
        worst = max(worst, diff)
        print(f"| {folder.name} | {diff:.2e} |")
        if diff > TOLERANCE:
            failed.append(folder.name)
    import llm2vec
    import tokenizers
    import transformers

    print(f"\nllm2vec {llm2vec.__version__ if hasattr(llm2vec, '__version__') else '0.2.3'}, transformers "
          f"{transformers.__version__}, tokenizers {tokenizers.__version__}; worst {worst:.2e}, tolerance "
          f"{TOLERANCE:.0e}; {time.strftime('%Y-%m-%d')}")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    print("OK: every folder gives the same vectors in LLM2Vec")
    return 0


if __name__ == "__main__":
    command, out_dir = sys.argv[1], Path(sys.argv[2])
    if command == "save":
        save(out_dir)
    else:
        sys.exit(check(out_dir))
