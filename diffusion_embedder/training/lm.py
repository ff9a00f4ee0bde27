"""Language-model stages: MNTP (LLM2Vec), masked-diffusion adaptation and causal LM, on the model with its LM head.

``torchrun --nproc_per_node=N experiments/run_mntp.py CONFIG.json [--key value ...]``
(also ``diffusion-embedder mntp``). ``objective`` picks the masker and the loss
(``diffusion_embedder.objectives``); attention is bidirectional unless the objective is ``clm``.
Text (a hub dataset through ``datasets`` or local files) is grouped into blocks of
``max_seq_length`` tokens. Checkpoints, resume and the NaN stop are ``RunTrainer``'s, as for
supervised training.

The output folder is laid out like LLM2Vec's ``-mntp`` repos: the base's ``config.json``, the LoRA
adapter of the inner model (``adapter_config.json`` + ``adapter_model.safetensors``) and the
tokenizer, so ``Encoder.from_pretrained(OUTPUT)`` merges it and a supervised config can start from
it (``model_name_or_path: OUTPUT``). With ``full_training`` (pretraining a small model from scratch)
every weight trains and the folder holds the full weights instead of an adapter; ``fsdp`` shards such a run
over torchrun's ranks (``fsdp.py``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import TrainingArguments

from diffusion_embedder import backbones, clihelp
from diffusion_embedder.compilation import compile_layers
from diffusion_embedder.data import load_text_blocks, read_texts
from diffusion_embedder.data.text import MIN_BLOCK_LENGTH
from diffusion_embedder.objectives import (
    MASK_TOKEN_TYPES,
    MNTP_COLLATORS,
    OBJECTIVES,
    Objective,
    ObjectiveOptions,
    mask_token_for,
)
from diffusion_embedder.training.arguments import (
    BackboneArguments,
    LoraArguments,
    RunArguments,
    read_config_values,
)
from diffusion_embedder.training.checkpointing import activation_bytes, enable_checkpointing
from diffusion_embedder.training.fsdp import lm_stage_rules
from diffusion_embedder.training.liger import apply_liger
from diffusion_embedder.training.liger import config_problems as liger_problems
from diffusion_embedder.training.lm_head import head_loss
from diffusion_embedder.training.lora import add_lora, log_trainable
from diffusion_embedder.training.runner import (
    fit_built,
    global_batch_size,
    located,
    model_short_name,
    open_run,
    run_cli,
)
from diffusion_embedder.training.schema import StageSchema
from diffusion_embedder.training.trainer import RunTrainer, data_seed

logger = logging.getLogger(__name__)

USAGE = (
    f"{clihelp.config_usage('mntp')}\n"
    "CONFIG.json: LM-stage fields (objective mntp | mdm | clm, data, masking, LoRA) and\n"
    "Hugging Face TrainingArguments (see train_configs/mntp/, train_configs/tiny/mntp.json)."
)


@dataclass
class LMStageArguments(RunArguments, LoraArguments, BackboneArguments):
    """What an LM stage trains, on which text, with which masking; backbone, LoRA and run control shared."""

    objective: str = field(
        default="mntp", metadata={"help": "What the stage trains (its masker and loss).", "choices": tuple(OBJECTIVES)}
    )
    max_seq_length: int = field(default=512, metadata={"help": "Tokens per training block."})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub text dataset (upstream: wikitext)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its config (wikitext-103-raw-v1)."})
    train_file: list[str] | None = field(default=None, metadata={"help": "Local .txt / .jsonl files (.gz ok)."})
    text_column: str = field(default="text", metadata={"help": "Text field of the dataset or JSONL records."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N blocks."})
    mlm_probability: float = field(default=0.2, metadata={"help": "MNTP: share of tokens masked."})
    data_collator_type: str = field(
        default="default", metadata={"help": "MNTP: LLM2Vec's masking collator.", "choices": MNTP_COLLATORS}
    )
    mask_token_type: str = field(
        default="blank", metadata={"help": "Mask token when the tokenizer has none.", "choices": MASK_TOKEN_TYPES}
    )
    mdm_eps: float = field(default=1e-3, metadata={"help": "MDM: mask ratio t ~ U(eps, 1)."})
    mdm_shift: bool = field(default=True, metadata={"help": "MDM: predict i from i-1 (Dream) or from i (LLaDA)."})
    full_training: bool = field(default=False, metadata={"help": "Train every weight, no LoRA (small models)."})
    fused_head: bool = field(
        default=False,
        metadata={"help": "LM head and loss at the positions the loss reads only (Liger's fused linear "
                  "cross-entropy with use_liger_kernel), not logits at every position."},
    )


def data_problems(values: dict[str, Any]) -> list[str]:
    """The LM stage's rules across fields: its text comes from the hub or from local files; the fused head calls
    the model's parts directly, which a sharded (FSDP) model does not allow."""
    problems = []
    if bool(values.get("dataset_name")) == bool(values.get("train_file")):
        problems.append("give either dataset_name (hub) or train_file (local), not both or neither")
    if values.get("fused_head") and values.get("fsdp"):
        problems.append("fused_head: not with fsdp (the head would run outside the sharded root); drop one")
    return problems


LM_STAGE = StageSchema(
    classes=(LMStageArguments, TrainingArguments),
    ranges={
        "max_seq_length": ((MIN_BLOCK_LENGTH, True), None),
        "mlm_probability": ((0, False), (1, True)),
        "mdm_eps": ((0, False), (1, False)),
    },
    rules=(lm_stage_rules, data_problems, liger_problems),
)


def experiment_id(args: LMStageArguments, t: TrainingArguments) -> str:
    model, batch = model_short_name(args.model_name_or_path), global_batch_size(t)
    return f"{model}-{args.objective}_b-{batch}_l-{args.max_seq_length}_s-{t.seed}_lr-{t.learning_rate}"


class AdaptedLM(nn.Module):
    """A model with its LM head in training; ``forward`` gives logits, ``save`` writes the -mntp layout."""

    def __init__(
        self, lm: nn.Module, tokenizer, base: str, base_config: dict[str, Any], full: bool, objective: str
    ):
        super().__init__()
        self.objective = objective
        self.lm = lm
        self.tokenizer = tokenizer
        self.base = base
        self.base_config = base_config
        self.full = full

    @property
    def config(self):
        return self.lm.config

    # What FSDP2's wrapping reads (accelerate): each decoder layer its own unit, the embeddings theirs.
    @property
    def _no_split_modules(self) -> list[str] | None:
        return getattr(self.lm, "_no_split_modules", None)

    def get_input_embeddings(self) -> nn.Module:
        return self.lm.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The last hidden states, before the head (the fused head's input)."""
        return self.lm.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    def save(self, folder: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """The folder; ``state_dict`` (this module's, gathered from the shards under FSDP) replaces the weights'
        own tensors."""
        os.makedirs(folder, exist_ok=True)
        if state_dict is not None:
            if not self.full:
                raise ValueError("a gathered state dict is only written for a full-weight run")
            weights = {name.removeprefix("lm."): tensor for name, tensor in state_dict.items()}
            self.lm.save_pretrained(folder, state_dict=weights, safe_serialization=True)
        elif self.full:
            self.lm.save_pretrained(folder, safe_serialization=True)
        else:
            self.lm.model.save_pretrained(folder)  # the inner model's adapter, as LLM2Vec's save_peft_model
        # The base's own format (Dream stays Dream); an adapter folder names its base as LLM2Vec's -mntp repos do.
        config = dict(self.base_config) if self.full else {**self.base_config, "_name_or_path": self.base}
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        for stale in ("generation_config.json",):
            if os.path.isfile(os.path.join(folder, stale)):
                os.remove(os.path.join(folder, stale))
        self.tokenizer.save_pretrained(folder)
        with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
            f.write(self.model_card())  # replaces peft's empty template

    def model_card(self) -> str:
        weights = "all weights (`model.safetensors`)" if self.full else "a LoRA adapter of the inner model"
        return (
            f"# {self.objective} stage output (diffusion_embedder)\n\n"
            f"Objective `{self.objective}` trained on `{self.base}`; this folder holds {weights}, the base's "
            "`config.json` and the tokenizer (the layout of LLM2Vec's `-mntp` repos). `train_config.json` is the "
            "complete training config.\n\n"
            "```python\nfrom diffusion_embedder import Encoder\n\n"
            "encoder = Encoder.from_pretrained(\"PATH\")  # merges the adapter, if any\n```\n\n"
            "Or continue the recipe from it: `\"model_name_or_path\": \"PATH\"` in a supervised or SimCSE config.\n"
        )


def build_model(args: LMStageArguments, objective: Objective, t: TrainingArguments) -> AdaptedLM:
    """The base with its LM head, attention set for the objective, LoRA on the inner model (or all weights)."""
    base = located(args.model_name_or_path)
    lm = backbones.load_backbone(
        base,
        enable_bidirectional=objective.bidirectional,
        torch_dtype=args.torch_dtype,
        attn_implementation=args.attn_implementation,
        lm_head=True,
    )
    tokenizer = backbones.load_tokenizer(base)
    if not args.full_training:
        lm.model = add_lora(lm.model, args)
        lm.get_output_embeddings().weight.requires_grad_(False)  # the output is the adapter alone
        for config in lm.model.peft_config.values():
            config.base_model_name_or_path = base
    # here: the Trainer would call it on AdaptedLM, which has no such method. "auto" plans for a micro-batch of
    # blocks and the head's logits at every position (half-precision) with float32 copies where the loss reads them.
    read = args.mlm_probability if args.objective == "mntp" else 1.0
    head = lm.config.vocab_size * (activation_bytes(t, lm) + 8 * read)
    enable_checkpointing(lm, t, t.per_device_train_batch_size * args.max_seq_length, int(head))
    apply_liger(lm.model, t)
    if args.compile_layers:
        compile_layers(lm)
    log_trainable(lm)
    return AdaptedLM(lm, tokenizer, base, backbones.read_config_dict(base), args.full_training, args.objective)


def stack_blocks(blocks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The collator: blocks as one tensor. Masking happens in the training step, from the global RNG,
    which a resumed run restores; the data loader's read-ahead would otherwise draw masks early."""
    return {"input_ids": torch.stack(blocks)}


class LMStageTrainer(RunTrainer):
    """``RunTrainer`` whose loss is the stage objective's, on the logits of the masked blocks."""

    def __init__(self, *args, objective: Objective, options: ObjectiveOptions, fused_head=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_head = fused_head  # liger.head_loss's: (hidden rows, head, targets) -> loss; None: full logits
        self.objective = objective
        self.options = options
        self.masker = objective.masker(options)

    def _get_train_sampler(self, train_dataset=None) -> torch.utils.data.Sampler:
        """The blocks were shuffled with the seed when read: a resumed run replays the same order."""
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], return_outputs: bool = False, **kwargs):
        batch = self.masker(inputs["input_ids"], inputs.get("attention_mask"))
        if self.fused_head is not None:
            loss, logits = self.fused_loss(model, batch), None
        else:
            logits = model(batch.input_ids, batch.attention_mask)
            loss = self.objective.loss(logits, batch, self.options)
        self.check_finite(loss)
        return (loss, logits) if return_outputs else loss

    def fused_loss(self, model: nn.Module, batch) -> torch.Tensor:
        """The objective's loss with the head computed at the positions it reads only (``fused_head``)."""
        adapted = self.accelerator.unwrap_model(model)
        hidden = adapted.hidden(batch.input_ids, batch.attention_mask)
        targets = self.objective.targets(batch, self.options)
        if targets is None:
            return hidden.sum() * 0.0  # nothing to predict: no NaN, no update
        return self.fused_head(hidden[targets.positions], adapted.get_output_embeddings(), targets)


def objective_options(args: LMStageArguments, model: AdaptedLM) -> ObjectiveOptions:
    tokenizer = model.tokenizer
    mask_id = getattr(model.config, "mask_token_id", None)
    if args.objective != "mdm" or mask_id is None:  # Dream/LLaDA's mask token is in config.json
        mask_id = mask_token_for(tokenizer, args.mask_token_type)
    specials = set(tokenizer.all_special_ids) if args.objective == "mntp" else set()  # as HF's MLM collator
    return ObjectiveOptions(
        mask_token_id=mask_id,
        vocab_size=model.config.vocab_size,
        mlm_probability=args.mlm_probability,
        mntp_collator=args.data_collator_type,
        mdm_eps=args.mdm_eps,
        mdm_shift=args.mdm_shift,
        special_ids=tuple(sorted(specials)),
    )


def train(values: dict[str, Any], source: str = "config") -> str:
    """Run one LM stage from its config values; returns the run folder (its root holds the final output)."""
    values, (args, t) = LM_STAGE.resolve(values, source)  # recorded under the names the fields have
    # the text first: a bad data file stops the run before its folder is touched
    texts = read_texts(args.dataset_name, args.dataset_config_name, args.train_file or (), args.text_column)
    run = open_run(t, args.experiment_id or experiment_id(args, t), values, args, LM_STAGE.classes)
    fused_head = head_loss(t.use_liger_kernel) if args.fused_head else None  # before build_model clears the flag

    def build() -> LMStageTrainer:
        objective = OBJECTIVES[args.objective]
        model = build_model(args, objective, t)
        dataset = load_text_blocks(
            model.tokenizer, texts, args.max_seq_length, seed=data_seed(t), max_blocks=args.max_train_samples
        )
        return LMStageTrainer(
            model=model,
            args=t,
            train_dataset=dataset,
            data_collator=stack_blocks,
            objective=objective,
            options=objective_options(args, model),
            fused_head=fused_head,
            run_config=dict(values),
        )

    return fit_built(build, run, args.stop_after_n_steps)


def main(argv: list[str] | None = None) -> int:
    """MNTP / masked-diffusion / causal-LM adaptation from a JSON config."""
    return run_cli(argv, USAGE, LM_STAGE, start)


def start(argv: list[str]) -> None:
    train(read_config_values(argv[0], argv[1:], LM_STAGE.classes), source=f"config {argv[0]}")
