"""The python blocks of docs/quickstart.md and docs/notebook.md run as written, so the docs cannot drift from the
code. The notebook names real hub models; each is replaced by a tiny fixture of the same family (and a fresh
LoRA adapter for an adapter name), nothing else of the text is changed."""

from __future__ import annotations

import json
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


def run_blocks(blocks: list[str], names: dict[str, str], namespace: dict | None = None) -> dict:
    """Run ``blocks`` in one namespace (a fresh one, or ``namespace`` to go on from earlier blocks), each quoted
    name of ``names`` replaced by its stand-in."""
    namespace = {} if namespace is None else namespace
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


def fenced(page: str, language: str) -> list[str]:
    """Every fenced block of ``language`` on a page, continuation lines (``\\``) joined."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return [block.replace("\\\n", " ") for block in re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)]


def commands(page: str) -> list[list[str]]:
    """The command lines of a page's bash blocks, split as the shell splits them; torchrun's launch form
    (``torchrun ... --no-python diffusion-embedder ...``) as the command it runs."""
    import shlex

    out = []
    for block in fenced(page, "bash"):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] == "torchrun":
                assert "--no-python" in argv, line  # the installed command, not a script of a checkout
                argv = argv[argv.index("--no-python") + 1:]
            if argv:
                assert argv[0] == "diffusion-embedder", line
                out.append(argv[1:])
    return out


def test_recipe_search_my_corpus_runs_as_written(tmp_path, monkeypatch):
    """The in-memory search and the search of what ``diffusion-embedder encode`` stored find the same documents."""
    from diffusion_embedder.cli import main

    monkeypatch.chdir(ROOT)
    (encode,) = [argv for argv in commands("docs/recipes.md") if argv[0] == "encode"]
    stored = tmp_path / "corpus-embeddings"
    assert main([str(stored) if a == "runs/corpus-embeddings" else a for a in encode]) == 0
    first, second = python_blocks("docs/recipes.md")
    namespace = run_blocks([first], {})
    in_memory = [namespace["corpus"][int(i)]["_id"] for i in namespace["best"].indices]
    run_blocks([second], {"runs/corpus-embeddings": str(stored)}, namespace)
    assert [namespace["ids"][int(i)] for i in namespace["scores"].topk(5).indices] == in_memory
    assert len(set(in_memory)) == 5


def test_recipe_paper_result_commands_are_valid():
    """The GPU runs cannot run here: their configs validate with the overrides given, the evaluations load the
    folders the trainings write, the task names resolve and every flag parses."""
    from diffusion_embedder.evaluation import report, run
    from diffusion_embedder.evaluation.tasks import resolve_task_names
    from diffusion_embedder.training.arguments import SUPERVISED, read_config_values

    argvs = commands("docs/recipes.md")
    trained = []
    for argv in [a for a in argvs if a[0] == "train" and "train_configs/supervised" in a[1]]:
        values, renamed = SUPERVISED.canonical(read_config_values(ROOT / argv[1], argv[2:]))
        assert values.pop("aug_file_path") == "ReasonAug.jsonl"  # downloaded by the reader of the page
        assert renamed + SUPERVISED.problems(values) == [], argv
        trained.append(f"{values['output_dir']}/{values['experiment_id']}")
    assert len(trained) == 2
    evaluated = []
    for argv in [a for a in argvs if a[0] == "eval" and "--top_k" in a]:
        args = run.build_parser().parse_args(argv[1:])
        assert resolve_task_names(args.task_name, args.benchmark) == ["BrightTheoremQAQuestionsRetrieval"]
        assert args.top_k == 200
        evaluated.append(args.base_model_name_or_path)
    assert evaluated == trained
    (reported,) = [a for a in argvs if a[0] == "report" and "results/paper" in a]
    assert report.build_parser().parse_args(reported[1:]).results_dirs == ["results/paper"]


def test_recipe_train_on_my_data_runs_as_written(tmp_path, monkeypatch):
    """The example record reads as the Custom format, the config trains its two steps, and the run folder it names
    is what the evaluation command loads."""
    from diffusion_embedder import Encoder
    from diffusion_embedder.data import load_train_dataset
    from diffusion_embedder.evaluation import run
    from diffusion_embedder.training.supervised import main as train

    monkeypatch.chdir(ROOT)
    (record,) = fenced("docs/recipes.md", "text")
    (tmp_path / "mine.jsonl").write_text(record * 2)
    dataset = load_train_dataset("Custom", tmp_path / "mine.jsonl", num_negatives=1)
    assert len(dataset) == 2
    (config,) = fenced("docs/recipes.md", "json")
    values = json.loads(config)
    values["output_dir"] = str(tmp_path / values["output_dir"])
    (tmp_path / "my_config.json").write_text(json.dumps(values))
    argvs = commands("docs/recipes.md")
    (train_argv,) = [a for a in argvs if a[:2] == ["train", "my_config.json"]]
    assert train([str(tmp_path / "my_config.json"), *train_argv[2:]]) == 0
    (eval_argv,) = [a for a in argvs if a[0] == "eval" and "--local_task" in a]
    args = run.build_parser().parse_args(eval_argv[1:])
    folder = tmp_path / args.base_model_name_or_path
    assert folder == tmp_path / values["output_dir"] / values["experiment_id"] and (ROOT / args.local_task[0]).is_dir()
    encoder = Encoder.from_pretrained(str(folder))
    assert Path(encoder.config.base_model_name_or_path).resolve() == (ROOT / values["model_name_or_path"]).resolve()
    assert encoder.encode(["a text"]).isfinite().all()
