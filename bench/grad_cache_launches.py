"""Why a GradCache step costs what it does where kernel launches, not arithmetic, bound the step: the aten
operations (about one kernel launch each on a GPU) and host synchronisations of one training step, direct and
GradCache, counted on the CPU for the smoke run's batch (8 triples of a query and two passages) with the tiny
model. At the smoke run's 1.5B shape a chunk of 2 texts is a few hundred tokens: each forward's time is its
launches, so the step time follows the operation count.

    python bench/grad_cache_launches.py
"""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "tests" / "fixtures" / "llm2vec_parity" / "llama"
PAIRS = ROOT / "train_configs" / "tiny" / "data" / "pairs.jsonl"


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func] += 1
        return func(*args, **(kwargs or {}))


def trainer(checkpointing: bool, pack_length: int | None, chunk: int | None, folder: str):
    from diffusion_embedder.data import ContrastiveCollator, Custom
    from diffusion_embedder.losses import HardNegativeNLLLoss
    from diffusion_embedder.training.arguments import validate
    from diffusion_embedder.training.supervised import prepare_encoder
    from diffusion_embedder.training.trainer import EncoderTrainer

    cfg = validate({"model_name_or_path": str(LLAMA), "dataset_name": "Custom", "output_dir": folder,
                    "report_to": "none", "bidirectional": True, "max_seq_length": 64, "lora_r": 4,
                    "lora_dropout": 0.1, "use_cpu": True, "per_device_train_batch_size": 8,
                    "activation_checkpointing": checkpointing})  # fmt: skip
    torch.manual_seed(0)
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    collator = ContrastiveCollator(encoder, num_negatives=1, pack_length=pack_length, chunk_size=chunk)
    return EncoderTrainer(model=encoder, args=cfg.training, train_dataset=Custom(PAIRS), data_collator=collator,
                          loss_fn=HardNegativeNLLLoss(), grad_cache_chunk_size=chunk)  # fmt: skip


def main() -> None:
    from diffusion_embedder.host_syncs import HostSyncs

    print("| layout | checkpointing | step | aten ops | ratio to direct | host syncs |")
    print("|---|---|---|---:|---:|---:|")
    for pack_length in (None, 128):
        for checkpointing in (True, False):
            direct = None
            for chunk in (None, 4, 2):
                t = trainer(checkpointing, pack_length, chunk, tempfile.mkdtemp())
                inputs = t._prepare_inputs(t.data_collator([t.train_dataset[i] for i in range(8)]))
                t.training_step(t.model, inputs)
                with Ops() as ops:
                    t.training_step(t.model, inputs)
                with HostSyncs() as syncs:
                    t.training_step(t.model, inputs)
                n = sum(ops.count.values())
                direct = direct or n
                print(f"| {'packed' if pack_length else 'padded'} | {'on' if checkpointing else 'off'} | "
                      f"{'direct' if chunk is None else f'GradCache chunk {chunk}'} | {n} | {n / direct:.2f} | "
                      f"{syncs.count} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
