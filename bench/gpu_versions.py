"""The first part of ``bench/gpu_run.sh``: what the GPU machine has, and whether torch's varlen kernel takes our
call there, in a few seconds.

Prints (the script writes it to ``OUT/versions.txt``): Python and library versions, the optional packages
present, each CUDA device and its compute capability, the measured bf16 matmul peak, whether
``torch.nn.attention.varlen.varlen_attn`` is found and which keywords its signature takes, what
``diffusion_embedder.varlen`` reads from it, and one call of our attention (``varlen.attend``) per backbone
family's head layout in bf16 against the reference path in float32 (norm-relative error in bf16 eps, and whether
the kernel or the reference path ran). Exit status 2 when something the run needs is missing (no CUDA device
outside the dry run, a library missing or too old); the script then stops.

    python bench/gpu_versions.py            # on the GPU machine
    python bench/gpu_versions.py --dry-run  # on a CPU: tiny matmul, the reference path only
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

#: Query heads, key/value heads and head dimension of the released checkpoints (their config.json).
LAYOUTS = {"Qwen2.5-7B / Dream-7B": (28, 4, 128), "Llama-3-8B / Mistral-7B": (32, 8, 128),
           "LLaDA-8B": (32, 32, 128), "Gemma-2B": (8, 1, 256)}  # fmt: skip
OPTIONAL = ("datasets", "mteb", "bm25s", "flash_attn", "liger_kernel")
REQUIRED = ("peft", "accelerate", "pytest")


def matmul_peak(device: str, dtype, n: int) -> float:
    """Dense matmul TFLOP/s at ``dtype`` (10 products of n x n after 3 warm-ups)."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return 2 * n**3 * 10 / (time.perf_counter() - start) / 1e12


def kernel_checks(device: str) -> list[str]:
    """Our call of the kernel per head layout, against the reference path in float32 on the same bf16 inputs."""
    import torch

    from diffusion_embedder import varlen

    lines = []
    lengths = [5, 64, 1, 200]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    eps = torch.finfo(torch.bfloat16).eps
    for name, (n_heads, n_kv, head_dim) in LAYOUTS.items():
        generator = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(sum(lengths), h, head_dim, device=device, generator=generator, dtype=torch.bfloat16)
                   for h in (n_heads, n_kv, n_kv))  # fmt: skip
        problem = varlen.kernel_problem(q.device, q.dtype, head_dim)
        for causal in (False, True):
            try:
                out = varlen.attend(q, k, v, cu, cu, max(lengths), max(lengths), causal, head_dim**-0.5).float()
                ref = varlen._reference(q.float(), k.float(), v.float(), cu, cu, causal, head_dim**-0.5)
                error = ((out - ref).norm() / ref.norm()).item() / eps
                ran = "kernel" if problem is None else f"reference path ({problem})"
                lines.append(f"varlen call {name} ({n_heads}:{n_kv} heads, dim {head_dim}), "
                             f"{'causal' if causal else 'bidirectional'}: {ran}, error {error:.2f} bf16 eps")
            except Exception as error:  # noqa: BLE001 - recorded: the point of this part is to say what fails
                lines.append(f"varlen call {name}, {'causal' if causal else 'bidirectional'}: FAILED "
                             f"{type(error).__name__}: {str(error)[:300]}")
    return lines


def report(lines: list[str], dry_run: bool) -> int:
    """Appends what the machine has to ``lines`` (the caller prints each as it comes); the exit status."""
    import torch
    import transformers
    from packaging.version import Version

    problems = [f"{m} is not installed" for m in REQUIRED if importlib.util.find_spec(m) is None]
    lines.append(f"python {platform.python_version()}, torch {torch.__version__}, transformers "
                 f"{transformers.__version__}, "
                 + ", ".join(f"{m} {metadata.version(m)}" for m in REQUIRED if importlib.util.find_spec(m)))
    present = [m for m in OPTIONAL if importlib.util.find_spec(m) is not None]
    lines.append(f"optional packages present: {', '.join(present) or 'none'}")
    if Version(transformers.__version__) < Version("5.2"):
        problems.append(f"transformers {transformers.__version__} < 5.2 (config.is_causal)")
    device = "cpu" if dry_run else "cuda"
    if not dry_run and not torch.cuda.is_available():
        problems.append("no CUDA device is visible")
    if problems:
        lines.append("Cannot run the GPU checks: " + "; ".join(problems))
        return 2
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        lines.append(f"cuda:{i} {torch.cuda.get_device_name(i)}, compute capability {major}.{minor}")
    dtype = torch.float32 if dry_run else torch.bfloat16
    lines.append(f"measured {str(dtype).removeprefix('torch.')} matmul peak: "
                 f"{matmul_peak(device, dtype, 256 if dry_run else 8192):.1f} TFLOP/s")
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        lines.append(f"torch.nn.attention.varlen.varlen_attn: not found ({error})")
    else:
        lines.append(f"torch.nn.attention.varlen.varlen_attn: found; signature {inspect.signature(varlen_attn)}")
    from diffusion_embedder import varlen

    found = varlen.kernel()
    lines.append("diffusion_embedder.varlen reads: " + ("no kernel" if found is None else
                 f"scale={found.scale}, window_size={found.window}, enable_gqa={found.gqa}"))  # fmt: skip
    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    lines.append(f"kernel for bf16, head dim 128 on {device}: "
                 f"{varlen.kernel_problem(where, torch.bfloat16, 128) or 'runs'}")
    checked = kernel_checks(device)
    lines.extend(checked)
    return 1 if any("FAILED" in line for line in checked) else 0


class Lines(list):
    """A list of lines that prints each as it is appended, and appends it to a file (a run cut off keeps them)."""

    def __init__(self, out: Path | None):
        super().__init__()
        self.out = out

    def append(self, line: str) -> None:
        super().append(line)
        print(line, flush=True)
        if self.out:
            with self.out.open("a") as f:
                f.write(line + "\n")

    def extend(self, lines) -> None:
        for line in lines:
            self.append(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="on a CPU: tiny matmul, the reference path")
    parser.add_argument("--out", type=Path, default=None, help="also append every line to this file, as it comes")
    args = parser.parse_args()
    return report(Lines(args.out), args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
