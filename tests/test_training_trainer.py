"""EncoderTrainer in one process: GradCache equals the direct path, NaN stops cleanly, adapters, checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import randomize_lora_b
from numerics import GRAD_EPS, MERGE_EPS, ORDER_EPS, assert_all_close_normwise, assert_close_normwise
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from diffusion_embedder import Encoder
from diffusion_embedder.data import ContrastiveCollator, Custom, TrainSample
from diffusion_embedder.losses import HardNegativeNLLLoss, RepllamaLoss
from diffusion_embedder.training.arguments import validate
from diffusion_embedder.training.checkpoints import COMPLETE_MARKER, TRAINABLE_WEIGHTS, find_last_checkpoint
from diffusion_embedder.training.supervised import prepare_encoder
from diffusion_embedder.training.trainer import EncoderTrainer, NonFiniteLossError

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "tests" / "fixtures" / "llm2vec_parity" / "llama"
PAIRS = ROOT / "train_configs" / "tiny" / "data" / "pairs.jsonl"


def make_config(tmp_path, **overrides):
    values = {
        "model_name_or_path": str(LLAMA),
        "dataset_name": "Custom",
        "output_dir": str(tmp_path),
        "report_to": "none",
        "bidirectional": True,
        "max_seq_length": 64,
        "skip_instruction": False,
        "lora_r": 4,
        "use_cpu": True,
        "per_device_train_batch_size": 4,
        "disable_tqdm": True,
        **overrides,
    }
    return validate(values)


def make_trainer(tmp_path, loss_fn=None, **overrides) -> EncoderTrainer:
    cfg = make_config(tmp_path, **overrides)
    torch.manual_seed(0)
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    return EncoderTrainer(
        model=encoder,
        args=cfg.training,
        train_dataset=Custom(PAIRS),
        data_collator=ContrastiveCollator(encoder, num_negatives=1),
        loss_fn=loss_fn or HardNegativeNLLLoss(),
        grad_cache_chunk_size=cfg.custom.grad_cache_chunk_size,
    )


def step_grads(trainer: EncoderTrainer, inputs, chunk: int | None, seed: int = 0):
    model = trainer.model
    model.zero_grad()
    trainer.grad_cache_chunk_size = chunk
    torch.manual_seed(seed)
    loss = trainer.training_step(model, inputs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return loss, grads


def assert_same(a, b):
    """Loss and every trainable gradient tensor, each norm-relative (numerics.GRAD_EPS)."""
    assert_close_normwise(a[0], b[0], eps_multiple=GRAD_EPS, msg="loss")
    assert a[1].keys() == b[1].keys() and len(a[1]) > 0
    assert_all_close_normwise(a[1], b[1], eps_multiple=GRAD_EPS, msg="grad")


def test_grad_cache_equals_direct_path(tmp_path):
    trainer = make_trainer(tmp_path, lora_dropout=0.0)
    randomize_lora_b(trainer.model, 0.05)
    samples = [trainer.train_dataset[i] for i in range(6)]
    inputs = trainer.data_collator(samples)
    direct = step_grads(trainer, inputs, None)
    for chunk in (1, 2, 4):
        assert_same(step_grads(trainer, inputs, chunk), direct)


def test_negatives_reach_the_loss_as_b_k_d_in_sample_order(tmp_path):
    """One shape from collator to loss: the k-th negative of query i is row (i, k) of a (B, K, d) tensor."""
    seen = {}

    def recording_loss(q, p, negatives):
        seen["negatives"] = negatives
        return HardNegativeNLLLoss()(q, p, negatives)

    trainer = make_trainer(tmp_path, loss_fn=recording_loss, lora_dropout=0.0)
    trainer.data_collator = ContrastiveCollator(trainer.model, num_negatives=2)
    batch = [
        TrainSample(
            ("i;", f"query {i}"), ("", f"positive {i}"), [("", f"negative {i} {k} " * (k + 1)) for k in range(2)]
        )
        for i in range(3)
    ]
    trainer.model.eval()
    with torch.no_grad():
        trainer.compute_loss(trainer.model, trainer.data_collator(batch))
        negatives = seen["negatives"]
        assert negatives.shape == (3, 2, trainer.model.embedding_dim)
        for i, sample in enumerate(batch):
            alone = trainer.model(trainer.model.tokenize([list(n) for n in sample.negatives]))
            assert_close_normwise(negatives[i], alone, eps_multiple=ORDER_EPS, rows=True)


def test_grad_cache_replays_dropout(tmp_path):
    """With LoRA dropout, each chunk's second forward reuses the first forward's masks."""
    trainer = make_trainer(tmp_path, lora_dropout=0.3, loss_fn=RepllamaLoss(scale_by_dim=True))
    randomize_lora_b(trainer.model, 0.2)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    direct = step_grads(trainer, inputs, None, seed=3)
    other_masks = step_grads(trainer, inputs, None, seed=4)
    assert (direct[0] - other_masks[0]).abs() > 1e-4  # dropout matters here
    assert_same(step_grads(trainer, inputs, 4, seed=3), direct)


def test_training_follows_homogeneous_order(tmp_path):
    trainer = make_trainer(tmp_path)
    loader = trainer.get_train_dataloader()
    dataset = trainer.train_dataset
    sampler_order = list(trainer._get_train_sampler())
    for step, batch in enumerate(loader):
        texts = batch["query"]["input_ids"].shape[0]
        assert texts == 4
        groups = {dataset.groups[i] for i in sampler_order[step * 4 : step * 4 + 4]}
        assert len(groups) == 1
    assert step + 1 == len(dataset) // 4


class BadLossAtCall:
    """The loss, multiplied by ``bad`` (NaN, inf or -inf) at the ``call``-th call."""

    def __init__(self, call: int, bad: float = float("nan")):
        self.call, self.calls, self.bad, self.loss = call, 0, bad, HardNegativeNLLLoss()

    def __call__(self, *args):
        self.calls += 1
        loss = self.loss(*args)
        return loss * self.bad if self.calls == self.call else loss


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("chunk", [None, 2])
def test_non_finite_loss_stops_before_the_step_and_keeps_last_good_checkpoint(tmp_path, chunk, bad):
    """NaN, inf and -inf alike: the run stops at step 5 before the optimizer touches the weights (they are still
    checkpoint-4's, bit for bit), and the message names checkpoint-2, the last one whose next loss was finite."""
    trainer = make_trainer(
        tmp_path, loss_fn=BadLossAtCall(5, float(bad)), max_steps=8, save_steps=2, learning_rate=1e-3,
        grad_cache_chunk_size=chunk,
    )
    trainer.grad_cache_chunk_size = chunk
    # checkpoint-4 is written but never called good: the loss computed with its weights (step 5) is not finite.
    with pytest.raises(NonFiniteLossError, match=f"Loss is {bad} at optimizer step 5.*checkpoint is .*checkpoint-2;"):
        trainer.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    assert find_last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    saved = load_file(tmp_path / "checkpoint-4" / TRAINABLE_WEIGHTS)
    trainable = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert saved.keys() == trainable.keys()
    assert all(torch.equal(trainable[n], saved[n]) for n in saved)  # step 5 never reached the weights


def complete_checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in run.glob("checkpoint-*") if (p / COMPLETE_MARKER).is_file())


@pytest.mark.parametrize("limit", [1, 2])
def test_save_total_limit_keeps_exactly_that_many_complete_checkpoints_the_newest(tmp_path, limit):
    """8 steps, a checkpoint every 2: the newest ``limit`` remain, each complete, and nothing else."""
    make_trainer(tmp_path, max_steps=8, save_steps=2, save_total_limit=limit).train()
    newest = ["checkpoint-6", "checkpoint-8"][-limit:]
    assert sorted(os.listdir(tmp_path)) == newest
    assert complete_checkpoints(tmp_path) == newest


def test_save_total_limit_never_rotates_out_the_last_good_checkpoint(tmp_path):
    """With a limit of 1, checkpoint-4 (written, never called good: step 5's loss is NaN) does not replace
    checkpoint-2: rotation waits for the marker, so the checkpoint the stop message names is still there."""
    trainer = make_trainer(tmp_path, loss_fn=BadLossAtCall(5), max_steps=8, save_steps=2, save_total_limit=1)
    with pytest.raises(NonFiniteLossError, match="checkpoint is .*checkpoint-2;"):
        trainer.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    assert complete_checkpoints(tmp_path) == ["checkpoint-2"]


def test_find_last_checkpoint_skips_half_written(tmp_path):
    for step, complete in ((5, True), (10, True), (15, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / COMPLETE_MARKER).write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert find_last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")
    assert find_last_checkpoint(tmp_path / "nothing") is None


def _save_adapter(folder: Path, seed: int) -> dict:
    base = Encoder.from_pretrained(str(LLAMA), device="cpu").model
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    randomize_lora_b(peft_model, 0.1)
    peft_model.save_pretrained(folder)
    return {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("folder", ["toy-mntp", "my_simcse_study/toy-mntp"])
def test_mntp_adapter_is_merged_then_fresh_lora(tmp_path, folder):
    """Also where a folder above the adapter has "simcse" in its name: the rule reads the adapter's own name."""
    mntp = tmp_path / folder
    _save_adapter(mntp, seed=1)
    cfg = make_config(tmp_path, peft_model_name_or_path=str(mntp))
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    assert encoder.config.merged_adapters == (str(mntp),)
    trainable = {n: p for n, p in encoder.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(float(p.detach().abs().max()) == 0 for n, p in trainable.items() if "lora_B" in n)  # fresh LoRA
    assert {m for n in trainable for m in cfg.custom.lora_target_modules if f".{m}." in n} == set(
        cfg.custom.lora_target_modules
    )
    reference = Encoder.from_pretrained(
        str(LLAMA), peft_model_name_or_path=str(mntp), merge_peft=True, device="cpu", skip_instruction=False
    )
    base = Encoder.from_pretrained(str(LLAMA), device="cpu", skip_instruction=False)
    text = [["Find it;", "a quiet violin"]]
    ours = encoder.encode(text, show_progress_bar=False)
    assert_close_normwise(ours, reference.encode(text, show_progress_bar=False), eps_multiple=MERGE_EPS, rows=True)
    assert (ours - base.encode(text, show_progress_bar=False)).abs().max() > 1e-3  # the merge changed the model


def test_adapter_name_is_its_own_or_its_run_s_for_a_checkpoint():
    from diffusion_embedder.training.supervised import adapter_name

    assert adapter_name("/runs/my_simcse_study/toy-mntp") == "toy-mntp"
    assert adapter_name("/runs/x/toy-mntp-unsup-simcse/checkpoint-500/") == "toy-mntp-unsup-simcse/checkpoint-500"
    assert adapter_name("org/name-simcse") == "name-simcse"


@pytest.mark.parametrize("folder", ["toy-mntp-unsup-simcse", "toy-mntp-unsup-simcse/checkpoint-500"])
def test_simcse_adapter_is_continued(tmp_path, folder):
    """Also a checkpoint of a SimCSE run: its run's folder names it."""
    simcse = tmp_path / folder
    saved = _save_adapter(simcse, seed=2)
    cfg = make_config(tmp_path, peft_model_name_or_path=str(simcse))
    encoder = prepare_encoder(cfg.model, cfg.custom, cfg.training)
    trainable = {n.removeprefix("model."): p for n, p in encoder.named_parameters() if p.requires_grad}
    assert set(trainable) == set(saved)  # the SimCSE adapter itself, no new LoRA
    for name, value in saved.items():
        torch.testing.assert_close(trainable[name].detach(), value)


@pytest.mark.parametrize("name", ["msmarco_repllama", "reasonaug_gradcache"])
def test_tiny_configs_train_end_to_end(tmp_path, monkeypatch, name):
    """RepllamaLoss on the MSMARCO format (15 negatives) and GradCache on ReasonAug, through run.train."""
    from diffusion_embedder.training.arguments import load_config
    from diffusion_embedder.training.supervised import train

    monkeypatch.chdir(ROOT)  # the configs name repository-relative paths
    config = ROOT / "train_configs" / "tiny" / f"{name}.json"
    run_dir = Path(train(load_config(config, ["--output_dir", str(tmp_path), "--report_to", "none"])))
    state = (run_dir / "checkpoint-3" / "trainer_state.json").read_text()
    assert '"global_step": 3' in state
    encoder = Encoder.from_pretrained(str(run_dir), device="cpu")
    assert torch.isfinite(encoder.encode(["a text"], show_progress_bar=False)).all()


def test_msmarco_with_fewer_negatives_than_its_instruction_negatives_is_a_config_error(tmp_path, monkeypatch):
    """MSMARCO's samples always hold its 3 instruction negatives: num_negatives 0-2 was a ValueError traceback from
    inside the reader; now a config error naming the field and the fewest it takes, before anything is read."""
    from diffusion_embedder.training.arguments import load_config
    from diffusion_embedder.training.schema import ConfigError
    from diffusion_embedder.training.supervised import build_dataset

    monkeypatch.chdir(ROOT)
    config = ROOT / "train_configs" / "tiny" / "msmarco_repllama.json"
    for negatives in (0, 2):
        cfg = load_config(config, ["--output_dir", str(tmp_path), "--num_negatives", str(negatives)])
        with pytest.raises(ConfigError, match=f"num_negatives={negatives}: MSMARCO's samples always hold 3 hard"):
            build_dataset(cfg)
    dataset, negatives = build_dataset(load_config(config, ["--output_dir", str(tmp_path), "--num_negatives", "3"]))
    assert negatives == 3 and all(len(sample.negatives) == 3 for sample in dataset.samples)
