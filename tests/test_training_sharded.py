"""FSDP2 and several machines, on CPU (gloo): the full-weight LM stage sharded for real, equal to DDP and to one
process, resumed exactly from sharded checkpoints, run on two torchrun "nodes"; every sharding we cannot honour
refused, naming the field and the value.

Before: ``fsdp``/``fsdp_config`` passed validation, and the Trainer given them on CPU trained with DDP instead
(accelerate drops the FSDP plugin under gloo). Each launch costs seconds on two shared cores, so one chain of runs
proves several things: the causal-LM stage (every weight trained; it draws no masks, so nothing random depends on
the rank), sharded on two nodes with activation checkpointing and SHARDED_STATE_DICT checkpoints, stopped after
step 2 and resumed on one node, is compared with a DDP run of the same processes, seed and global batch, and with
one process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from isolation import reserved_port
from safetensors.torch import load_file
from torch import nn

from diffusion_embedder import Encoder
from diffusion_embedder.training import lm
from diffusion_embedder.training.arguments import SUPERVISED
from diffusion_embedder.training.checkpoints import COMPLETE_MARKER, CheckpointError, validate_checkpoint
from diffusion_embedder.training.claim import CLAIM_FILE
from diffusion_embedder.training.fsdp import ShardingError, check_sharded, enable
from diffusion_embedder.training.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MNTP = ROOT / "train_configs" / "tiny" / "mntp.json"
CUSTOM = ROOT / "train_configs" / "tiny" / "custom.json"
RUN = "tiny-mntp"
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
#: 4 steps of 8 blocks (2 ranks x 4, or one process x 8), every weight trained, a checkpoint every 2 steps.
COMMON = [
    "--objective", "clm", "--full_training", "true", "--max_steps", "4", "--save_steps", "2", "--report_to", "none",
    "--activation_checkpointing", "false",
]  # fmt: skip
SHARDED = ["--fsdp", "true", "--fsdp_config", json.dumps(
    {"version": 2, "activation_checkpointing": True, "state_dict_type": "SHARDED_STATE_DICT"})]
#: The LM stage with two probes: which rank claimed the run folder, and after step 1 what each rank holds
#: (its shard of the parameters and of the optimizer state) and the claim it sees.
PROBE = """
import json, os, sys
import torch
from transformers import TrainerCallback
from diffusion_embedder.training import claim, lm
from diffusion_embedder.training.fsdp import local

out, rank = sys.argv[1], os.environ["RANK"]
acquire = claim.acquire

def acquire_once(*args, **kwargs):
    open(os.path.join(out, f"claimed_by_rank{rank}"), "w").close()
    return acquire(*args, **kwargs)

class Probe(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step != 1:
            return
        params = list(model.parameters())
        moments = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        with open(os.path.join(args.output_dir, claim.CLAIM_FILE)) as f:
            held = json.load(f)
        record = {
            "pid": os.getpid(),
            "params": [sum(local(p).numel() for p in params), sum(p.numel() for p in params)],
            "optimizer": [sum(local(t).numel() for t in moments), sum(t.numel() for t in moments)],
            "claim": held,
        }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)

init = lm.LMStageTrainer.__init__

def probed_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.add_callback(Probe())

claim.acquire, lm.LMStageTrainer.__init__ = acquire_once, probed_init
sys.exit(lm.main(sys.argv[2:]))
"""


def lm_args(output_dir: Path, *overrides: str) -> list[str]:
    return [str(MNTP), "--output_dir", str(output_dir), *COMMON, *overrides]


def probe_script(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "probe.py"
    script.write_text(PROBE)
    return script


def start(*args: str, launch: tuple[str, ...] = ("--standalone", "--nproc_per_node=2")) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", *launch, *args]
    return subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def two_nodes(*args: str) -> str:
    """Two torchrun "nodes" on this machine, started together, one process each, c10d rendezvous on a port held
    for them until they finish; their output."""
    with reserved_port() as port:
        return finish(*[
            start(*args, launch=("--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                                 "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}"))  # fmt: skip
            for node in (0, 1)
        ])


def finish(*launches: subprocess.Popen) -> str:
    outputs = [launch.communicate(timeout=300)[0] for launch in launches]
    assert all(launch.returncode == 0 for launch in launches), "\n".join(o[-4000:] for o in outputs)
    return "\n".join(outputs)


def losses(run: Path, step: int = 4) -> list[float]:
    state = json.loads((run / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def assert_close_weights(a: Path, b: Path, atol: float = 1e-5) -> None:
    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert left.keys() == right.keys() and left
    for name, value in right.items():
        torch.testing.assert_close(left[name], value, atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SimpleNamespace:
    """The causal-LM stage, every weight trained, 4 steps of 8 blocks: DDP (one node, 2 processes); sharded on two
    nodes, stopped after step 2 (probed after step 1) and resumed on one node with 2 processes; one process."""
    out = tmp_path_factory.mktemp("sharded")
    ddp = start(str(ROOT / "experiments" / "run_mntp.py"), *lm_args(out / "ddp"))
    probe = probe_script(out / "probe")
    sharded = [str(probe), str(out / "probe"), *lm_args(out / "fsdp", *SHARDED)]
    stopped = two_nodes(*sharded, "--stop_after_n_steps", "2")
    resumed = finish(start(*sharded, "--resume_from_checkpoint", "last"))
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.chdir(ROOT)  # the tiny config names repository-relative paths
    assert lm.main(lm_args(out / "one", "--per_device_train_batch_size", "8")) == 0
    monkeypatch.undo()
    finish(ddp)
    return SimpleNamespace(
        ddp=out / "ddp" / RUN, fsdp=out / "fsdp" / RUN, one=out / "one" / RUN, probe=out / "probe",
        stopped=stopped, resumed=resumed,
    )


def test_fsdp_holds_half_of_the_parameters_and_optimizer_state_on_each_rank(runs):
    ranks = [json.loads((runs.probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    for what in ("params", "optimizer"):
        total = ranks[0][what][1]
        assert total > 0 and all(rank[what][1] == total for rank in ranks)
        assert sum(rank[what][0] for rank in ranks) == total  # every element on exactly one rank
        assert all(0.4 * total <= rank[what][0] <= 0.6 * total for rank in ranks), ranks
    assert ranks[0]["optimizer"][1] == 2 * ranks[0]["params"][1]  # AdamW's two moments, sharded alike
    for log in (runs.stopped, runs.resumed):
        assert "FSDP2: 21 parameters sharded over 2 ranks" in log and "(2 checkpointed layers)" in log


def test_fsdp_trains_like_ddp_and_one_process_and_resumes_exactly(runs):
    """Loss of every step and the weights after steps 2 and 4 (stopped on two nodes after 2, resumed on one) equal
    the DDP run's and the one-process run's (the causal LM draws no masks: nothing random depends on the rank)."""
    assert "Stopping at optimizer step 2" in runs.stopped and "Resuming" in runs.resumed
    assert len(losses(runs.ddp)) == 4
    for reference in (runs.ddp, runs.one):
        assert losses(runs.fsdp) == pytest.approx(losses(reference), abs=1e-5)
        assert_close_weights(runs.fsdp / "checkpoint-2", reference / "checkpoint-2")
        assert_close_weights(runs.fsdp, reference)
    half = load_file(runs.fsdp / "checkpoint-2" / "model.safetensors")
    final = load_file(runs.fsdp / "model.safetensors")
    assert any(not torch.equal(half[k], final[k]) for k in final)  # steps 3-4 changed the weights


def test_two_nodes_claim_the_run_folder_once(runs):
    """Rank 0 claims the run folder for both nodes (they share this file system), once, and releases it."""
    assert sorted(p.name for p in runs.probe.glob("claimed_by_*")) == ["claimed_by_rank0"]
    ranks = [json.loads((runs.probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["claim"] == ranks[1]["claim"]  # one claim, seen from both nodes
    assert ranks[0]["claim"]["pid"] == ranks[0]["pid"] and ranks[0]["claim"]["world_size"] == 2
    assert not (runs.fsdp / CLAIM_FILE).exists()


def test_sharded_run_folder_loads_as_a_normal_lm_folder(runs):
    """The final save gathers the shards: full weights in safetensors, loaded by transformers and the Encoder."""
    from transformers import AutoModelForCausalLM

    assert not (runs.fsdp / "pytorch_model_fsdp_0").exists()
    weights = load_file(runs.fsdp / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(runs.fsdp)
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, weights["model.layers.1.mlp.down_proj.weight"])
    encoder = Encoder.from_pretrained(str(runs.fsdp), device="cpu")
    assert torch.isfinite(encoder.encode(["The red apple."], show_progress_bar=False)).all()


def test_the_validator_knows_both_sharded_layouts(runs, tmp_path):
    """SHARDED_STATE_DICT (torch.distributed.checkpoint folders, as written above) and FULL_STATE_DICT (gathered
    files; written here from the same state, as accelerate names them)."""
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(runs.fsdp / "checkpoint-2", checkpoint)
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    assert marker == {"global_step": 2, "world_size": 2, "layout": "fsdp2/SHARDED_STATE_DICT"}
    validate_checkpoint(checkpoint, 2)
    shutil.move(checkpoint / "optimizer_0", tmp_path / "optimizer_0")
    with pytest.raises(CheckpointError, match=r"optimizer_0 is missing"):
        validate_checkpoint(checkpoint, 2)
    shutil.move(tmp_path / "optimizer_0", checkpoint / "optimizer_0")
    shard = checkpoint / "pytorch_model_fsdp_0" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"pytorch_model_fsdp_0 is unreadable .*__1_0.distcp is truncated"):
        validate_checkpoint(checkpoint, 2)
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        shutil.rmtree(checkpoint / folder)
    torch.save(load_file(checkpoint / "model.safetensors"), checkpoint / "pytorch_model_fsdp.bin")
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps({**marker, "layout": "fsdp2/FULL_STATE_DICT"}))
    with pytest.raises(CheckpointError, match=r"optimizer.bin is missing"):
        validate_checkpoint(checkpoint, 2)
    torch.save({"state": {}, "param_groups": []}, checkpoint / "optimizer.bin")
    validate_checkpoint(checkpoint, 2)


# ---------------------------------------------------------------------------------------------- refusals
def lm_values(**overrides) -> dict:
    return {**json.loads(MNTP.read_text()), "activation_checkpointing": False, "full_training": True, **overrides}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"full_training": False}, "fsdp: True needs full_training: true"),
        ({"fsdp": "hybrid_shard"}, "fsdp: 'hybrid_shard' is not supported (an FSDP1 setting"),
        ({"fsdp": "full_shard offload"}, "fsdp: 'offload' is not supported (CPU offload is not supported"),
        ({"fsdp_config": {"cpu_offload": True}}, "fsdp_config.cpu_offload: True is not supported (CPU offload"),
        ({"fsdp_config": {"fsdp_version": 1}}, "fsdp_config.version: 1 is not supported; FSDP2 (version 2)"),
        ({"fsdp_config": {"activation_checkpoint": True}}, "did you mean 'activation_checkpointing'?"),
        ({"fsdp_config": {"state_dict_type": "LOCAL_STATE_DICT"}}, "fsdp_config.state_dict_type: 'LOCAL_STATE"),
        ({"fsdp_config": {"use_orig_params": True}}, "fsdp_config.use_orig_params: True is not supported"),
        ({"activation_checkpointing": True}, "activation_checkpointing: under fsdp, set fsdp_config.activation"),
        ({"fsdp": None, "fsdp_config": {"version": 2}}, "fsdp_config is given but fsdp is not set"),
    ],
)
def test_a_sharding_that_cannot_be_honoured_is_refused_with_the_config(overrides, expected, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as err:
        lm.LM_STAGE.validate(lm_values(**{"fsdp": True, **overrides}))
    assert expected in str(err.value)


def test_fsdp_needs_several_processes_and_a_full_weight_lm_stage(monkeypatch):
    with pytest.raises(ConfigError, match="this is one process: launch with torchrun"):
        lm.LM_STAGE.validate(lm_values(fsdp=True))
    supervised = {**json.loads(CUSTOM.read_text()), "fsdp": "full_shard", "grad_cache_chunk_size": 2}
    with pytest.raises(ConfigError) as err:
        SUPERVISED.validate(supervised)
    assert "fsdp: 'full_shard' is not supported by this stage (it trains a LoRA" in str(err.value)
    assert "grad_cache_chunk_size with fsdp: GradCache under FSDP is refused" in str(err.value)
    assert "sentence-transformers #3173" in str(err.value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    overrides = [*COMMON, "--fsdp", "true", "--fsdp_config", '{"fsdp_version": 2}']
    values = lm.read_config_values(MNTP, overrides, lm.LM_STAGE.classes)
    assert values["fsdp"] is True and lm.LM_STAGE.problems(values) == []  # (the torchrun runs above train it)


def test_a_model_the_trainer_did_not_shard_stops_the_run():
    """The run-time check: plain (DDP-style) parameters after wrapping, or accelerate without FSDP on a device."""
    plugin = SimpleNamespace(activation_checkpointing=False, auto_wrap_policy=None)
    with pytest.raises(ShardingError, match=r"fsdp: asked for, but .* 2 of 2 parameters are not sharded"):
        check_sharded(nn.Linear(2, 2), None, plugin, world_size=2)
    from accelerate.utils import DistributedType

    state = SimpleNamespace(fsdp_plugin=None, distributed_type=DistributedType.MULTI_GPU)
    trainer = SimpleNamespace(args=SimpleNamespace(fsdp=True, fsdp_plugin_args={"fsdp_version": 2}),
                              accelerator=SimpleNamespace(state=state))  # fmt: skip
    with pytest.raises(ShardingError, match="accelerate set up MULTI_GPU without FSDP"):
        enable(trainer)
