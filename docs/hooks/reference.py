"""What the site's hooks check and add besides the generated pages (``config_page.py``, ``cli_page.py``): the
API pages' parameters, each listed in its docstring's ``Args:`` (the strict build fails otherwise), and the index
and titles of the measured results.
"""

from __future__ import annotations

import re
from importlib import import_module
from typing import Any


def _cell(text: Any) -> str:
    """Text safe inside a markdown table cell (pipes escaped, one line)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def api_identifiers(markdown: str) -> list[tuple[str, list[str] | None]]:
    """The objects a page documents with mkdocstrings (``::: dotted.path`` lines), each with the members its
    options list (``members: [a, b]``), or None for mkdocstrings' default (every public member)."""
    found: list[tuple[str, list[str] | None]] = []
    for line in markdown.splitlines():
        if line.startswith("::: "):
            found.append((line.split()[1], None))
        elif found and line.strip().startswith("members:"):
            listed = line.split(":", 1)[1].strip().strip("[]")
            found[-1] = (found[-1][0], [m.strip() for m in listed.split(",") if m.strip()])
    return found


#: The docstring style of the API pages, and the options mkdocs.yml gives mkdocstrings' parser.
DOCSTRING_STYLE = "google"
DOCSTRING_OPTIONS = {"returns_multiple_items": False}


def _public_callables(obj: Any, members: list[str] | None = None) -> list[tuple[str, Any]]:
    """What mkdocstrings renders of ``obj``: itself if a function; a class's constructor and its own public
    methods, or the ``members`` its page lists (inherited ones too); a module's public functions and classes
    defined in it (each with their methods)."""
    import inspect

    if inspect.isroutine(obj):
        return [(obj.__qualname__, obj)]
    if inspect.isclass(obj):
        out = [(f"{obj.__qualname__}.__init__", obj.__init__)] if "__init__" in vars(obj) else []
        names = members if members is not None else [n for n in vars(obj) if not n.startswith("_")]
        for name in names:
            member = inspect.getattr_static(obj, name, None)
            member = member.__func__ if isinstance(member, classmethod | staticmethod) else member
            if inspect.isfunction(member):
                out.append((f"{obj.__qualname__}.{name}", member))
        return out
    out = []
    for name, member in vars(obj).items():
        if name.startswith("_") or getattr(member, "__module__", None) != obj.__name__:
            continue
        if inspect.isfunction(member) or inspect.isclass(member):
            out += _public_callables(member)
    return out


def documented_parameters(docstring: str) -> set[str]:
    """The parameters a docstring's ``Args:`` section lists (parsed as mkdocstrings parses it)."""
    import griffe

    options = {"warnings": False, **DOCSTRING_OPTIONS}
    sections = griffe.Docstring(docstring, parser=DOCSTRING_STYLE, parser_options=options).parse()
    return {p.name.lstrip("*") for s in sections if s.kind.value == "parameters" for p in s.value}


def undocumented_parameters(identifier: str, members: list[str] | None = None) -> list[str]:
    """``qualname: parameter`` for every parameter of a documented callable that its docstring's ``Args:`` section
    does not list (so its page would show no row for it); a class's constructor may be documented in the class
    docstring."""
    import inspect

    module_name, _, attr = identifier.rpartition(".")
    try:
        obj = import_module(identifier)
    except ImportError:
        obj = getattr(import_module(module_name), attr)
    if not callable(obj) and not inspect.ismodule(obj):
        return []  # a registry or constant: nothing to call
    missing = []
    for qualname, fn in _public_callables(obj, members):
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        documented = documented_parameters(inspect.getdoc(fn) or "")
        if qualname.endswith(".__init__"):
            owner = getattr(import_module(fn.__module__), qualname.split(".")[0], None)
            documented |= documented_parameters(inspect.getdoc(owner) or "")
        for name, p in params.items():
            if name in ("self", "cls") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if name not in documented:
                missing.append(f"{fn.__module__}.{qualname}: {name}")
    return missing


#: Where a page asks for the index of measured results (``results_index``), replaced at build time.
RESULTS_MARKER = "<!-- generated: results index -->"


def page_title(path: Any) -> str:
    """A markdown file's title: its first ``# `` heading, else its name."""
    from pathlib import Path

    text = Path(path).read_text(encoding="utf-8")
    title = next((ln[2:].strip() for ln in text.splitlines() if ln.startswith("# ")), Path(path).stem)
    return title.replace("`", "")


def results_index(folder: Any, link_prefix: str = "results/") -> str:
    """A table of the measured results in ``folder`` (``bench/results/*.md``): each file's title, the setting it
    was measured in (its first ``Command (...)``, else its first sentence with a date) and every date it names."""
    from pathlib import Path

    lines = ["| results | measured on | dates |", "|---|---|---|"]
    for path in sorted(Path(folder).glob("*.md")):
        text = path.read_text(encoding="utf-8")
        title = page_title(path)
        body = [ln for ln in text.splitlines() if not ln.startswith("#")]
        flat = " ".join(" ".join(body).replace("**", "").split())
        command = re.search(r"Command \(([^)]*)\)", flat)
        if command:
            where = command.group(1)
        else:
            dated = re.search(r"[^.]*\b20\d\d-\d\d-\d\d\b[^.]*\.", flat)
            where = dated.group(0).strip() if dated else ""
        dates = ", ".join(sorted(set(re.findall(r"\b20\d\d-\d\d-\d\d\b", text))))
        lines.append(f"| [{_cell(title)}]({link_prefix}{path.name}) | {_cell(where)} | {dates} |")
    return "\n".join(lines)
