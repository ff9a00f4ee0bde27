"""MkDocs hooks: add the generated reference pages and the measured results, and refuse an undocumented
public parameter (a warning, so ``mkdocs build --strict`` fails)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel
from mkdocs.structure.nav import Section
from mkdocs.structure.pages import Page

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference  # noqa: E402  (the hook is loaded by path; its sibling module is found through sys.path)

log = logging.getLogger("mkdocs.hooks.diffusion_embedder")
ROOT = Path(__file__).resolve().parents[2]


def on_files(files, config):
    """The config and CLI references, generated from the code; ``bench/results/*.md`` as ``results/*.md``."""
    files.append(File.generated(config, "reference/config.md", content=reference.config_reference()))
    files.append(File.generated(config, "reference/cli.md", content=reference.cli_reference()))
    for path in sorted((ROOT / "bench" / "results").glob("*.md")):
        files.append(File.generated(config, f"results/{path.name}", content=path.read_text(encoding="utf-8"),
                                    inclusion=InclusionLevel.NOT_IN_NAV))  # on_nav adds them
    return files


def on_nav(nav, config, files):
    """Every measured result (``bench/results/*.md``) in the navigation, so a new one needs no edit here."""
    pages = [Page(path.stem.replace("_", " "), files.get_file_from_path(f"results/{path.name}"), config)
             for path in sorted((ROOT / "bench" / "results").glob("*.md"))]
    nav.items.append(Section("Measured results", pages))
    return nav


def on_page_markdown(markdown, page, config, files):
    """The results index where a page asks for it; and every parameter of each object an API page documents
    must be named in its docstring."""
    if reference.RESULTS_MARKER in markdown:
        markdown = markdown.replace(reference.RESULTS_MARKER, reference.results_index(ROOT / "bench" / "results"))
    for identifier, members in reference.api_identifiers(markdown):
        for problem in reference.undocumented_parameters(identifier, members):
            log.warning("%s: parameter not documented in its docstring (%s)", page.file.src_uri, problem)
    return markdown
