"""MkDocs hooks: the version in the header, the generated reference pages in place of their stubs, the measured
results under Results, links written for GitHub mapped to the site, and an undocumented public parameter refused
(a warning, so ``mkdocs build --strict`` fails)."""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel
from mkdocs.structure.nav import Section
from mkdocs.structure.pages import Page

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli_page  # noqa: E402  (the hook is loaded by path; its sibling modules are found through sys.path)
import config_page  # noqa: E402
import reference  # noqa: E402

log = logging.getLogger("mkdocs.hooks.diffusion_embedder")
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
#: Pages written from the code at build time; the repository holds a stub of each (read on GitHub).
GENERATED = {"reference/config.md": config_page.config_reference, "reference/cli.md": cli_page.cli_reference}
#: The navigation section the measured results join.
RESULTS_SECTION = "Results"


def on_config(config):
    """The version in the header: the site's name is the package's name and version."""
    from diffusion_embedder import __version__

    config.site_name = f"{config.site_name} {__version__}"
    return config


def on_files(files, config):
    """The config and CLI references, generated from the code; ``bench/results/*.md`` as ``results/*.md``."""
    for uri, make in GENERATED.items():
        stub = files.get_file_from_path(uri)
        if stub is not None:
            files.remove(stub)
        files.append(File.generated(config, uri, content=make()))
    for path in sorted(RESULTS.glob("*.md")):
        files.append(File.generated(config, f"results/{path.name}", content=path.read_text(encoding="utf-8"),
                                    inclusion=InclusionLevel.NOT_IN_NAV))  # on_nav adds them
    return files


def on_nav(nav, config, files):
    """Every measured result (``bench/results/*.md``, titled by its heading up to a colon) under Results, so a new
    one needs no edit here."""
    pages = [Page(reference.page_title(path).split(": ", 1)[0], files.get_file_from_path(f"results/{path.name}"),
                  config) for path in sorted(RESULTS.glob("*.md"))]
    section = next((item for item in nav.items if isinstance(item, Section) and item.title == RESULTS_SECTION), None)
    if section is None:
        section = Section(RESULTS_SECTION, [])
        nav.items.append(section)
    section.children += pages
    for page in pages:
        page.parent = section
    return nav


def repo_path(page) -> str:
    """Where a page's source is in the repository (a measured result is ``bench/results/NAME``)."""
    uri = page.file.src_uri
    return f"bench/results/{uri.split('/', 1)[1]}" if uri.startswith("results/") else f"docs/{uri}"


def site_link(target: str, page) -> str:
    """A relative link written for GitHub (a path in the repository) as the built site needs it."""
    path, hash_, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path(page)), path))
    if resolved.startswith("docs/"):
        site = resolved[len("docs/"):]
    elif resolved.startswith("bench/results/"):
        site = "results/" + resolved[len("bench/results/"):]
    else:
        return target  # outside the site: the strict build names it
    return posixpath.relpath(site, posixpath.dirname(page.file.src_uri) or ".") + hash_ + anchor


LINK = re.compile(r"(\]\()(?!https?:|mailto:|#)([^)\s]+\.md(?:#[^)\s]*)?)(\))")


def on_page_markdown(markdown, page, config, files):
    """Links mapped to the site; the results index where a page asks for it; and every parameter of each object an
    API page documents must be listed in its docstring's ``Args:``."""
    markdown = LINK.sub(lambda m: m.group(1) + site_link(m.group(2), page) + m.group(3), markdown)
    if reference.RESULTS_MARKER in markdown:
        markdown = markdown.replace(reference.RESULTS_MARKER, reference.results_index(RESULTS))
    for identifier, members in reference.api_identifiers(markdown):
        for problem in reference.undocumented_parameters(identifier, members):
            log.warning("%s: parameter not documented in its docstring's Args (%s)", page.file.src_uri, problem)
    return markdown
