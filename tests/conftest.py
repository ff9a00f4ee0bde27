"""Shared fixtures: the reference checkpoints and tiny random checkpoints of every supported family; what keeps
tests independent when pytest-xdist runs them in parallel (threads per worker, reserved ports, folders built once
per run, a check that no test leaves global state behind)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from isolation import built_once, unchanged_global_state, worker_threads
from transformers import AutoConfig, AutoModel

from diffusion_embedder import varlen  # noqa: F401  registered before any test: a registration a test leaves shows

#: Offline, with caches of their own, for every test (set before any test module imports datasets or mteb).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MTEB_CACHE", tempfile.mkdtemp(prefix="mteb_cache_"))
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="hf_datasets_"))

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA_FIXTURE = FIXTURES / "llm2vec_parity" / "llama"
MISTRAL_FIXTURE = FIXTURES / "llm2vec_parity" / "mistral"
DREAM_FIXTURE = FIXTURES / "dream_reference"
LLADA_FIXTURE = FIXTURES / "llada_reference"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
QWEN_TOKENIZER_FILES = ("vocab.json", "merges.txt", "special_tokens_map.json")

#: Tiny configs (vocab 1024 = the fixtures' tokenizer) for every family the backbone table supports.
FAMILY_CONFIGS = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16},
}
#: The reference checkpoints stand in for the diffusion families (they carry a mask token).
REFERENCE_FAMILIES = {"Dream": DREAM_FIXTURE, "llada": LLADA_FIXTURE}
FAMILIES = (*FAMILY_CONFIGS, *REFERENCE_FAMILIES)


def copy_tokenizer(model_type: str, folder: Path) -> None:
    """The llama fixture's byte-level BPE; Qwen families get the Dream fixture's Qwen-format files."""
    if model_type.startswith("qwen"):
        for name in QWEN_TOKENIZER_FILES:
            shutil.copy(DREAM_FIXTURE / name, folder / name)
        config = json.loads((DREAM_FIXTURE / "tokenizer_config.json").read_text())
        config.pop("auto_map")
        config["tokenizer_class"] = "Qwen2Tokenizer"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        for name in TOKENIZER_FILES:
            shutil.copy(LLAMA_FIXTURE / name, folder / name)


def make_tiny_checkpoint(model_type: str, folder: Path, seed: int = 0) -> Path:
    """A random checkpoint in the Hugging Face layout with a 1024-token byte-level BPE tokenizer."""
    config = AutoConfig.for_model(
        model_type,
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **FAMILY_CONFIGS[model_type],
    )
    torch.manual_seed(seed)
    AutoModel.from_config(config).save_pretrained(folder)
    copy_tokenizer(model_type, folder)
    return folder


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """``family_checkpoint(name)`` -> folder of a tiny checkpoint of that family (Dream, LLaDA: the references)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family in REFERENCE_FAMILIES:
            return REFERENCE_FAMILIES[family]
        if family not in made:
            made[family] = make_tiny_checkpoint(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get


def default_attention(family: str) -> str:
    """Gemma2's soft-capped attention has no SDPA path in transformers."""
    return "eager" if family == "gemma2" else "sdpa"


ROOT = Path(__file__).resolve().parents[1]
TINY_TRAIN_CONFIG = ROOT / "train_configs" / "tiny" / "custom.json"
TINY_RUN_ID = "tiny_custom"


def torchrun(output_dir: Path, *overrides: str, check: bool = True):
    """``torchrun --nproc_per_node=2`` of the supervised entry point on the tiny config (CPU, gloo)."""
    import os
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "experiments" / "run_supervised.py"),
        str(TINY_TRAIN_CONFIG),
        "--output_dir",
        str(output_dir),
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.fixture(scope="session")
def tiny_full_run(tmp_path_factory) -> Path:
    """The uninterrupted 2-process run of the tiny config (20 steps, 12 per epoch), shared by the tests (and by
    the xdist workers: one run per test run). Read it; copy it to change it."""
    return built_once(tmp_path_factory, "tiny_full_run", torchrun) / TINY_RUN_ID


#: Mixed inputs (pairs with and without an instruction, plain strings, short and long) for equality tests.
MIXED_TEXTS = [
    ["Given a math problem, retrieve the theorem", "A triangle has sides 3, 4 and 5. Find its area."],
    ["", "Two pointers sweep the array from both ends."],
    "Short.",
    ["Retrieve text based on user query", "What is the capital of France? It is a city on the Seine " * 3],
    ["Find the formula", "x"],
    "A second short one, a little longer than the first short one.",
]


def randomize_lora_b(model: torch.nn.Module, std: float) -> None:
    """Non-zero LoRA B matrices (peft starts them at zero), so an adapter changes the output and LoRA A gets
    gradients; drawn from the global RNG, which the caller seeds."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std)


# ------------------------------------------------------------------ running in parallel (pytest-xdist, make test)
def pytest_configure(config) -> None:
    """Under xdist, each worker (and every process it starts: torchrun, the CLIs) runs on its share of the cores."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # a serial run keeps torch's own defaults
    threads = worker_threads()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def _module_leaves_no_global_state(request):
    """A module's fixtures (chdir, environment, ...) are undone when the module is done."""
    with unchanged_global_state(f"module {request.module.__name__}"):
        yield


@pytest.fixture(autouse=True)
def _test_leaves_no_global_state():
    """What one test changes in the process is undone when it ends, so no test depends on the tests run before it
    (xdist runs them in another order, on other workers)."""
    with unchanged_global_state("this test"):
        yield
