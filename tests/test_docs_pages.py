"""The written pages, as GitHub shows them and as users read them: every relative link resolves in the repository,
the pages built from the code are committed as stubs that say so, user pages and measured results speak of dates,
versions and commits (not of how the project's work was organised), and the facts stated in several places agree
with the code (the checkpoints table with the shipped configs, the version in the citations)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What users read: the README, the site's pages (the hooks and the API stubs' ``:::`` lines aside) and results.
USER_PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "bench" / "results").glob("*.md")])
LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s]+?)(?:#[^)\s]*)?\)")
#: Words of the project's organisation, not of the product: an issue number of ours (an upstream repository's
#: issues are named as such), who lent or lacked a machine, sessions, helpers, tasks handed out. mteb's "task"
#: (an evaluation task), pytest's session fixtures and helper functions are the product's words and stay.
FORBIDDEN = {
    "an issue number": re.compile(r"(?<!repository's )\b[Ii]ssues? #?\d+|\b(?:[Ss]ince|[Bb]efore|[Aa]fter|[Ss]ee) "
                                  r"#\d+"),
    "a lent machine": re.compile(r"\b(lent|lend|lending)\b", re.I),
    "a session": re.compile(r"\bsessions?\b(?! fixtures?)", re.I),  # pytest's session fixtures are the suite's
    "a helper": re.compile(r"\bhelpers?\b(?! (function|module|script))", re.I),
    "a task handed out": re.compile(r"\b(this|the|our|each) task (was|had|has|got) (not |no )?(lent|drawn|given|a GPU|"
                                   r"GPU|a device|device|a machine|machine)", re.I),
}


def _relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", USER_PAGES, ids=_relative)
def test_every_relative_link_resolves_in_the_repository(page):
    """What GitHub shows: a link to another page or file of the repository, relative to the page."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)  # code is not linked
    broken = [target for target in LINK.findall(text) if not (page.parent / target).exists()]
    assert broken == []


def test_links_to_measured_results_and_pages_use_repository_paths():
    """``results/x.md`` exists only in the built site; the pages link ``../bench/results/x.md``, which the site's
    hook maps (and the strict build checks)."""
    for page in (ROOT / "docs").glob("*.md"):
        assert not re.search(r"\]\(results/", page.read_text(encoding="utf-8")), page.name


@pytest.mark.parametrize("page", USER_PAGES, ids=_relative)
def test_user_pages_speak_of_the_project_only(page):
    text = page.read_text(encoding="utf-8")
    found = {what: pattern.findall(text) for what, pattern in FORBIDDEN.items()}
    assert {what: hits for what, hits in found.items() if hits} == {}


def test_the_forbidden_words_are_caught_and_mtebs_task_is_not():
    said = {
        "measured before issue 25": "an issue number",
        "Issue 19's pipeline": "an issue number",
        "since #18 every row": "an issue number",
        "No GPU was lent to this session": "a lent machine",
        "other helpers' jobs": "a helper",
        "the task was not lent a device machine": "a lent machine",
        "this task had no GPU": "a task handed out",
    }
    for sentence, what in said.items():
        assert FORBIDDEN[what].search(sentence), sentence
    fine = ["the LLaDA repository's issues #89 and #90", "every mteb task of the benchmark", "the task is scored again",
            "a helper function", "Session fixtures run once per worker", "LLaDA-8B", "BEIR-format task folder",
            "`task.json`", "Tevatron #206", "each task was scored once"]
    for sentence in fine:
        assert not [w for w, p in FORBIDDEN.items() if p.search(sentence)], sentence


@pytest.mark.parametrize("stub", ["reference/config.md", "reference/cli.md"])
def test_the_generated_pages_are_committed_as_stubs_the_build_replaces(stub):
    """On GitHub a link to the page finds a stub saying where the page is; the build writes the real one there (the
    hook's ``GENERATED``, read without importing mkdocs)."""
    text = (ROOT / "docs" / stub).read_text(encoding="utf-8")
    assert "built by `make docs`" in text and len(text.splitlines()) < 10
    hook = (ROOT / "docs" / "hooks" / "site.py").read_text(encoding="utf-8")
    assert re.search(rf'"{re.escape(stub)}": \w+_page\.\w+_reference', hook)


def test_the_checkpoints_table_names_what_the_shipped_configs_load():
    """Every checkpoint the paper's configs start from is in the table, with the configs that use it."""
    page = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    table = page.split("## The paper's checkpoints", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([\w./-]+)` \|.*$", table, re.M)}
    used: dict[str, set[str]] = {}
    for path in [*(ROOT / "train_configs/supervised").glob("*.json"), *(ROOT / "train_configs/simcse").glob("*.json")]:
        config = json.loads(path.read_text())
        for key in ("model_name_or_path", "peft_model_name_or_path"):
            name = config.get(key) or ""
            if name.startswith(("siyue/", "McGill-NLP/")):
                used.setdefault(name, set()).add(f"{path.parent.name}/{path.stem}")
    assert set(rows) == set(used)
    for name, configs in used.items():
        for config in configs:
            short = config.removeprefix("supervised/")
            assert f"`{short}`" in rows[name], (name, config)


def test_the_citations_agree_and_carry_the_version():
    from diffusion_embedder import __version__

    def bibtex(page: str) -> list[str]:
        return re.findall(r"^```bibtex\n(.*?)^```", (ROOT / page).read_text(encoding="utf-8"), re.S | re.M)

    assert bibtex("README.md") == bibtex("docs/index.md") and len(bibtex("README.md")) == 2
    paper, toolkit = bibtex("README.md")
    assert "2505.15045" in paper and f"version = {{{__version__}}}" in toolkit
    assert f"## {__version__} " in (ROOT / "docs" / "changelog.md").read_text(encoding="utf-8")
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'version = "{__version__}"' in pyproject
