"""The python blocks of docs/quickstart.md and docs/notebook.md run as written, so the docs cannot drift from the
code. The notebook names real hub models; each is replaced by a tiny fixture of the same family (and a fresh
LoRA adapter for an adapter name), nothing else of the text is changed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def python_blocks(page: str) -> list[str]:
    """Every fenced ```python block of a page (a path from the repository root), in order."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def lora_adapter(base: Path, folder: Path) -> str:
    """A LoRA adapter (random, non-zero B) over ``base``, saved as peft saves it."""
    import torch
    from peft import LoraConfig, get_peft_model

    from diffusion_embedder import load_backbone

    torch.manual_seed(0)
    model = get_peft_model(load_backbone(str(base)), LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                                  init_lora_weights=False))
    model.save_pretrained(str(folder))
    return str(folder)


def run_blocks(blocks: list[str], names: dict[str, str]) -> dict:
    namespace: dict = {}
    for block in blocks:
        for name, stand_in in names.items():
            block = block.replace(f'"{name}"', repr(stand_in))
        exec(compile(block, "<docs>", "exec"), namespace)  # noqa: S102  (the documentation's own code)
    return namespace


@pytest.mark.parametrize(("page", "shape"), [("docs/quickstart.md", (1, 2)), ("README.md", (1, 1))])
def test_quickstart_and_readme_blocks_run_as_written(monkeypatch, page, shape):
    monkeypatch.chdir(ROOT)  # they run from a checkout
    blocks = python_blocks(page)
    assert blocks, f"{page} has no python block"
    namespace = run_blocks(blocks, {})
    assert tuple(namespace["scores"].shape) == shape


def test_notebook_blocks_run_with_tiny_stand_ins(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names = {  # longest first: one name is the prefix of another
        "McGill-NLP/LLM2Vec-Mistral-7B-Instruct-v2-mntp-supervised": lora_adapter(
            FIXTURES / "llm2vec_parity" / "mistral", tmp_path / "mistral-adapter"),
        "McGill-NLP/LLM2Vec-Mistral-7B-Instruct-v2-mntp": str(FIXTURES / "llm2vec_parity" / "mistral"),
        "Dream-org/Dream-v0-Instruct-7B": str(FIXTURES / "dream_reference"),
        "path/to/your/trained/adapter": lora_adapter(FIXTURES / "dream_reference", tmp_path / "dream-adapter"),
        "GSAI-ML/LLaDA-8B-Instruct": str(FIXTURES / "llada_reference"),
    }
    blocks = python_blocks("docs/notebook.md")
    text = "\n".join(blocks)
    unused = [name for name in names if f'"{name}"' not in text]
    assert not unused, f"stand-ins for names the notebook page no longer uses: {unused}"
    namespace = run_blocks(blocks, names)
    assert namespace["scores"].shape == (1, 1)
    assert namespace["v"].shape[0] == 1
