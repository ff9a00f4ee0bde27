"""The MNTP stage's step with and without the fused head (``fused_head``; with Liger's kernel where it imports).

GPU (default): the Qwen2.5-7B (Dream-7B) shape with its 152k vocabulary, random bf16 weights, LoRA r 16 on the seven
projections, every layer checkpointed, 8 blocks of 512 tokens, MNTP masking 20%, AdamW on the adapter, through
``LMStageTrainer.training_step``; tokens/s and peak memory per configuration, each in a fresh process.
``--dry-run``: the same code on the CPU with a tiny shape in float32 (what the test runs).

    python bench/train_lm_head.py --out bench/results/train_lm_head.md
    python bench/train_lm_head.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "fixtures" / "llm2vec_parity" / "llama"
#: name -> (fused_head, use_liger_kernel)
CONFIGS = {"MNTP, full logits": (False, False), "MNTP, fused head": (True, False),
           "MNTP, fused head, Liger": (True, True)}  # fmt: skip
#: (shape, dtype, blocks, block length, timed steps)
GPU = ("qwen2.5-7b", "bfloat16", 8, 512, 3)
DRY = ("tiny", "float32", 4, 64, 2)


def worker(name: str, dry_run: bool) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments

    from diffusion_embedder.backbones import load_tokenizer, set_bidirectional
    from diffusion_embedder.objectives import OBJECTIVES, ObjectiveOptions
    from diffusion_embedder.random_models import SHAPES_7B, TINY_SHAPE
    from diffusion_embedder.training.arguments import LoraArguments
    from diffusion_embedder.training.checkpointing import checkpoint_first
    from diffusion_embedder.training.liger import apply_liger
    from diffusion_embedder.training.lm import AdaptedLM, LMStageTrainer, stack_blocks
    from diffusion_embedder.training.lm_head import head_loss
    from diffusion_embedder.training.lora import add_lora

    fused, liger = CONFIGS[name]
    shape, dtype_name, blocks, length, steps = DRY if dry_run else GPU
    device, dtype = ("cpu" if dry_run else "cuda"), getattr(torch, dtype_name)
    model_type, dims = TINY_SHAPE if dry_run else SHAPES_7B[shape]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **dims), dtype=dtype)
    set_bidirectional(model, True)
    model.model = add_lora(model.model, LoraArguments(lora_r=16))
    model.get_output_embeddings().weight.requires_grad_(False)
    checkpoint_first(model, dims["num_hidden_layers"], {})
    args = TrainingArguments(output_dir="/tmp/bench_lm_head", report_to="none", use_cpu=dry_run, bf16=not dry_run)
    if liger:
        apply_liger(model.model, argparse.Namespace(use_liger_kernel=True, liger_kernel_config=None))
    adapted = AdaptedLM(model, load_tokenizer(str(TOKENIZER)), "random", {}, False, "mntp")
    options = ObjectiveOptions(mask_token_id=3, vocab_size=dims["vocab_size"])
    ids = torch.randint(10, dims["vocab_size"] - 10, (blocks, length), generator=torch.Generator().manual_seed(0))
    trainer = LMStageTrainer(model=adapted, args=args, train_dataset=[], data_collator=stack_blocks,
                             objective=OBJECTIVES["mntp"], options=options,
                             fused_head=head_loss(liger) if fused else None)  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # set per step by the Trainer's loop, which this skips
    optimizer = trainer.create_optimizer()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> None:
        with trainer.accelerator.autocast():
            trainer.training_step(trainer.model, {"input_ids": ids.to(device)})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return dict(config=name, tokens=ids.numel(), s_per_step=seconds, tokens_per_s=ids.numel() / seconds,
                peak_gib=peak, device=torch.cuda.get_device_name() if device == "cuda" else "cpu")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.dry_run)))
        return
    from transformers.utils import is_liger_kernel_available

    lines = ["| configuration | tokens/step | s/step | tokens/s | peak GiB |", "|---|---:|---:|---:|---:|"]
    failed = False
    for name, (_, liger) in CONFIGS.items():
        if liger and not is_liger_kernel_available():
            lines.append(f"| {name} | not run: liger-kernel does not import here | | | |")
            continue
        command = [sys.executable, __file__, "--worker", name] + ["--dry-run"] * args.dry_run
        out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            failed = True
            lines.append(f"| {name} | failed: {(out.stderr.strip().splitlines() or ['?'])[-1][:200]} | | | |")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(r, flush=True)
        lines.append(f"| {name} | {r['tokens']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['peak_gib']:.2f} |")
    shape = DRY if args.dry_run else GPU
    report = "\n".join([f"Command: `python bench/train_lm_head.py{' --dry-run' * args.dry_run}`; shape {shape[0]}, "
                        f"{shape[1]}, {shape[2]} blocks of {shape[3]} tokens, MNTP 20%, LoRA r 16, every layer "
                        "checkpointed.", "", *lines, ""])  # fmt: skip
    print(report)
    if args.out:
        args.out.write_text(report)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
