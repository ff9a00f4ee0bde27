"""Which mteb tasks each benchmark means, task-name resolution, query instructions, local dataset copies.

Benchmarks name mteb 2.x tasks explicitly (not ``mteb.get_benchmark``) so that the set we report is
fixed by this file, whatever later mteb versions add to their benchmark objects.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import logging
import os
import re
from importlib import resources
from pathlib import Path

from diffusion_embedder.files import parse_json_object, read_json_object

logger = logging.getLogger(__name__)

FOLLOWIR = ("Core17InstructionRetrieval", "Robust04InstructionRetrieval", "News21InstructionRetrieval")
LONGEMBED = (
    "LEMBNarrativeQARetrieval",
    "LEMBQMSumRetrieval",
    "LEMBWikimQARetrieval",
    "LEMBSummScreenFDRetrieval",
    "LEMBNeedleRetrieval",
    "LEMBPasskeyRetrieval",
)
#: BRIGHT v1.1: one task per domain, the standard (short-document) split, with excluded ids applied.
BRIGHT = (
    "BrightBiologyRetrieval",
    "BrightEarthScienceRetrieval",
    "BrightEconomicsRetrieval",
    "BrightPsychologyRetrieval",
    "BrightRoboticsRetrieval",
    "BrightStackoverflowRetrieval",
    "BrightSustainableLivingRetrieval",
    "BrightPonyRetrieval",
    "BrightLeetcodeRetrieval",
    "BrightAopsRetrieval",
    "BrightTheoremQATheoremsRetrieval",
    "BrightTheoremQAQuestionsRetrieval",
)
BENCHMARKS: dict[str, tuple[str, ...]] = {"followir": FOLLOWIR, "longembed": LONGEMBED, "bright": BRIGHT}
BENCHMARKS["all"] = FOLLOWIR + LONGEMBED + BRIGHT

#: Task names of the upstream mteb fork (1.14.12 + 12 Bright files) mapped to the mteb 2.x tasks.
ALIASES: dict[str, str] = {
    "BrightAops": "BrightAopsRetrieval",
    "BrightBiology": "BrightBiologyRetrieval",
    "BrightEarthScience": "BrightEarthScienceRetrieval",
    "BrightEconomics": "BrightEconomicsRetrieval",
    "BrightLeetcode": "BrightLeetcodeRetrieval",
    "BrightPony": "BrightPonyRetrieval",
    "BrightPsychology": "BrightPsychologyRetrieval",
    "BrightRobotics": "BrightRoboticsRetrieval",
    "BrightStackOverflow": "BrightStackoverflowRetrieval",
    "BrightSustainableLiving": "BrightSustainableLivingRetrieval",
    "BrightTheoremqaTheorems": "BrightTheoremQATheoremsRetrieval",
    "BrightTheoremqaQuestions": "BrightTheoremQAQuestionsRetrieval",
}

DEFAULT_QUERY_INSTRUCTION = "Retrieve text based on user query:"
#: How FollowIR's per-query instruction joins the query (upstream and mteb: query first).
DEFAULT_QUERY_TEMPLATE = "{query} {instruction}"
LENGTH_SPLIT = re.compile(r"^test_(\d+)$")
#: The most tokens a LongEmbed length split (``test_32768``...) is given.
DEFAULT_MAX_LENGTH_CAP = 32768


def benchmark_of(task_name: str) -> str:
    """The benchmark a task belongs to ("local" for anything else)."""
    for name in ("followir", "longembed", "bright"):
        if task_name in BENCHMARKS[name]:
            return name
    return "local"


def _all_task_names() -> list[str]:
    import mteb

    return [t.metadata.name for t in mteb.get_tasks(exclude_superseded=False)]


def resolve_task_names(task_names: list[str] | None = None, benchmark: str | None = None) -> list[str]:
    """mteb task names for ``--task_name`` / ``--benchmark``; an unknown name is an error listing close matches."""
    names: list[str] = []
    if benchmark is not None:
        if benchmark not in BENCHMARKS:
            raise ValueError(f"Unknown benchmark {benchmark!r}; choose one of {sorted(BENCHMARKS)}.")
        names.extend(BENCHMARKS[benchmark])
    if task_names:
        known = _all_task_names()
        known_set = set(known)
        for name in task_names:
            name = ALIASES.get(name, name)
            if name not in known_set:
                close = difflib.get_close_matches(name, known + list(ALIASES), n=5, cutoff=0.6)
                hint = f" Did you mean: {', '.join(close)}?" if close else ""
                raise ValueError(f"Unknown mteb task {name!r}.{hint}")
            names.append(name)
    if not names:
        raise ValueError("Nothing to evaluate: give --task_name, --benchmark or --local_task.")
    return list(dict.fromkeys(names))


def load_instructions(path: str | None = None) -> dict[str, str]:
    """The task -> query instruction map: the shipped file, or ``path`` (a JSON object of strings)."""
    if path is None:
        text = resources.files("diffusion_embedder.evaluation").joinpath("task_to_instructions.json").read_text()
        source = "task_to_instructions.json (shipped)"
        data = parse_json_object(text, source)
    else:
        data = read_json_object(path)
        source = path
    for key, value in data.items():
        if not isinstance(value, str):
            raise ValueError(f"{source}: the instruction of {key!r} must be a string, got {type(value).__name__}.")
    return data


def query_instruction(task_name: str, instructions: dict[str, str], task_prompt: object = None) -> str:
    """The instruction for a task's queries: the map, else the task's own query prompt, else mteb's default.

    A prompt taken from mteb gets its trailing period or colon normalised to ":" as upstream did
    ("Retrieve text based on user query." -> "Retrieve text based on user query:").
    """
    for key in (task_name, *[alias for alias, target in ALIASES.items() if target == task_name]):
        if key in instructions:
            return instructions[key]
    prompt = task_prompt.get("query") if isinstance(task_prompt, dict) else task_prompt
    if not prompt:
        return DEFAULT_QUERY_INSTRUCTION
    return prompt.strip().rstrip(".:").rstrip() + ":"


def split_max_length(hf_split: str, cap: int) -> int | None:
    """The token budget of a LongEmbed length split (``test_4096`` -> 4096), at most ``cap``; None otherwise."""
    match = LENGTH_SPLIT.match(hf_split or "")
    return min(int(match.group(1)), cap) if match else None


def local_dataset_dir(data_dir: str, hf_path: str) -> str | None:
    """Where a downloaded copy of a hub dataset sits under ``data_dir``: ``org/name`` or just ``name``."""
    for candidate in (os.path.join(data_dir, hf_path), os.path.join(data_dir, hf_path.split("/")[-1])):
        if os.path.isdir(candidate):
            return candidate
    return None


def get_mteb_task(name: str, data_dir: str | None = None):
    """An mteb task instance; with ``data_dir`` its dataset is read from a local copy of the hub repo.

    The local copy is a clone of the dataset repository (its README ``configs:`` tell ``datasets``
    the layout), e.g. ``DATA_DIR/mteb/Core17InstructionRetrieval`` or ``DATA_DIR/LongEmbed``.
    """
    import mteb

    task = mteb.get_task(name)
    if data_dir is None:
        return task
    cls = type(task)
    hf_path = cls.metadata.dataset["path"]
    local = local_dataset_dir(data_dir, hf_path)
    if local is None:
        raise FileNotFoundError(
            f"{name}: no local copy of {hf_path!r} under --data_dir {data_dir!r}; expected "
            f"{os.path.join(data_dir, hf_path)} or {os.path.join(data_dir, hf_path.split('/')[-1])} "
            "(a clone of the hub dataset repository)."
        )
    fingerprint = copy_fingerprint(local)
    revision = f"{cls.metadata.dataset.get('revision')}+local-{fingerprint}"
    dataset = {**cls.metadata.dataset, "path": local, "revision": revision}
    metadata = cls.metadata.model_copy(update={"dataset": dataset})

    def in_copy_cache(method):
        """``method`` with ``datasets`` reading this copy's cache: ``load_data``, and ``evaluate``, where FollowIR's
        ``task_specific_scores`` reads ``qrel_diff`` with its own ``load_dataset``."""

        def wrapped(self, *args, **kwargs):
            with datasets_cache(fingerprint):
                return method(self, *args, **kwargs)

        return wrapped

    local_cls = type(cls.__name__, (cls,), {"metadata": metadata, "load_data": in_copy_cache(cls.load_data),
                                            "evaluate": in_copy_cache(cls.evaluate)})
    logger.info("%s: reading %s (local copy %s)", name, local, fingerprint)
    return local_cls()


def copy_fingerprint(folder: str) -> str:
    """Hash of every file's path, size and modification time under a local dataset copy (cheap on GBs).

    It names the copy in the results (``dataset_revision`` = hub revision + this) and in the ``datasets``
    cache: ``datasets`` keys a local folder's Arrow cache by the folder's name and relative file names, so
    an edited or different copy of the same repository would otherwise be served from an older copy's cache.
    """
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != ".git")
        for name in sorted(files):
            path = os.path.join(root, name)
            stat = os.stat(path)
            digest.update(f"{os.path.relpath(path, folder)}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def datasets_cache(fingerprint: str):
    """``datasets``' cache folder moved, for this block, to one subfolder per local copy."""
    import datasets

    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = Path(saved) / "diffusion_embedder_local_copies" / fingerprint
    try:
        yield
    finally:
        datasets.config.HF_DATASETS_CACHE = saved
