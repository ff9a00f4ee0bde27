"""OpenAI-compatible chat client, Batch-API JSONL files, and a resumable request runner.

Every stage writes its requests and answers in the OpenAI Batch-API format, so a stage can be run either
live through :class:`ChatClient` (``run_requests``) or by uploading the input file to the Batch API and
dropping the downloaded output file in place: the parsers only ever read the output files.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from diffusion_embedder.data import jsonl
from diffusion_embedder.data.jsonl import Field

logger = logging.getLogger(__name__)

CHAT_URL = "/v1/chat/completions"
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
RETRY_SEP = "#retry"


class LLMError(RuntimeError):
    """A request that failed for good (non-retryable status, or retries exhausted)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------------------------- JSONL


def read_jsonl(path: str | Path, fields: Iterable[Field] = ()) -> list[tuple[int, dict]]:
    """``(line_number, record)`` per JSON object, through the package's one JSONL reader
    (``data/jsonl.py``): a broken line, or one lacking a required ``fields`` entry, is a ``DataFormatError``
    (a ValueError) naming file and line."""
    records, _ = jsonl.read_jsonl(path, fields, lambda record, index: (index + 1, record))
    return records


def write_jsonl(path: str | Path, records: Iterable[dict]) -> int:
    """Write records atomically (tmp file + rename) so a crash never leaves a half-written output."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "wb") as raw:
        # mtime=0 and no file name in the gzip header: the same records give the same bytes
        binary = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") if path.suffix == ".gz" else raw
        with io.TextIOWrapper(binary, encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
                n += 1
    os.replace(tmp, path)
    return n


# ------------------------------------------------------------------------------------- Batch-API files


def make_request(custom_id: str, messages: list[dict], model: str, max_tokens: int, **params: Any) -> dict:
    """One Batch-API request line (``custom_id``, ``method``, ``url``, ``body``)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, **params}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": body}


def write_batch_requests(path: str | Path, requests: Iterable[dict]) -> int:
    return write_jsonl(path, requests)


@dataclass
class BatchResult:
    """One line of a Batch-API output file, reduced to what the parsers need."""

    custom_id: str
    content: str | None  # assistant text; None when the request failed
    status_code: int | None = None
    error: Any = None
    finish_reason: str | None = None


def result_from_record(record: dict, where: str = "") -> BatchResult:
    cid = record.get("custom_id")
    if not isinstance(cid, str):
        raise ValueError(f"{where}: missing or non-string 'custom_id' ({cid!r})")
    response = record.get("response") or {}
    status = response.get("status_code")
    content = finish = None
    if record.get("error") is None and status == 200:
        try:
            choice = response["body"]["choices"][0]
            content = choice["message"]["content"]
            finish = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{where}: custom_id {cid!r}: no response.body.choices[0].message.content") from e
    return BatchResult(cid, content, status, record.get("error"), finish)


def read_batch_outputs(path: str | Path) -> dict[str, BatchResult]:
    """Read a Batch-API output file keyed by custom_id (a later line for the same id wins)."""
    return {r["custom_id"]: result_from_record(r, f"{path}:{lineno}") for lineno, r in read_jsonl(path)}


def read_saved_answers(path: str | Path) -> dict[str, BatchResult]:
    """The answers a live run has saved so far: none while the file is not there (nothing sent, or all failed)."""
    return read_batch_outputs(path) if Path(path).exists() else {}


def output_record(custom_id: str, completion: dict) -> dict:
    """Wrap a chat.completion object as a Batch-API output line (same shape as OpenAI's batch files)."""
    return {
        "id": f"batch_req_{custom_id}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": completion.get("id", ""), "body": completion},
        "error": None,
    }


# ----------------------------------------------------------------------------------------- the client


class Transport(Protocol):
    """POST a JSON body; return ``(status, headers, parsed JSON or raw text)``. Injected in tests."""

    async def post(self, url: str, headers: dict[str, str], body: dict) -> tuple[int, dict[str, str], Any]: ...


class UrllibTransport:
    """Stdlib HTTP transport run in a worker thread (keeps the package free of an HTTP dependency)."""

    def __init__(self, timeout: float = 600.0):
        self.timeout = timeout

    def _post(self, url: str, headers: dict[str, str], body: dict) -> tuple[int, dict[str, str], Any]:
        data = json.dumps(body).encode("utf-8")
        req = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                status, hdrs, raw = resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            status, hdrs, raw = e.code, dict(e.headers or {}), e.read()
        text = raw.decode("utf-8", errors="replace")
        try:
            return status, hdrs, json.loads(text)
        except json.JSONDecodeError:
            return status, hdrs, text

    async def post(self, url: str, headers: dict[str, str], body: dict) -> tuple[int, dict[str, str], Any]:
        return await asyncio.to_thread(self._post, url, headers, body)


@dataclass
class ClientConfig:
    """Endpoint settings; ``from_env`` reads OPENAI_BASE_URL, OPENAI_API_KEY and REASONAUG_MODEL."""

    base_url: str = "https://api.openai.com/v1"
    api_key: str | None = None
    model: str = "gpt-4o-mini"
    concurrency: int = 8
    max_retries: int = 6
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    timeout: float = 600.0

    @classmethod
    def from_env(cls, **overrides: Any) -> ClientConfig:
        env = {
            "base_url": os.environ.get("OPENAI_BASE_URL"),
            "api_key": os.environ.get("OPENAI_API_KEY"),
            "model": os.environ.get("REASONAUG_MODEL"),
            "concurrency": os.environ.get("REASONAUG_CONCURRENCY"),
        }
        kwargs = {k: v for k, v in env.items() if v}
        if "concurrency" in kwargs:
            kwargs["concurrency"] = int(kwargs["concurrency"])
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kwargs)


def _retry_after(headers: dict[str, str]) -> float | None:
    for k, v in headers.items():
        if k.lower() == "retry-after":
            try:
                return float(v)
            except ValueError:
                return None
    return None


class ChatClient:
    """Async OpenAI-compatible chat-completions client with a concurrency cap and exponential backoff.

    Retries 429 and 5xx answers and transport errors (``OSError``/``TimeoutError``) up to ``max_retries``
    times, sleeping ``min(backoff_max, backoff_base * 2**attempt)`` (or the server's Retry-After, if
    longer). ``sleep`` is injectable so tests never really wait.
    """

    def __init__(
        self,
        config: ClientConfig,
        transport: Transport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.config = config
        self.transport = transport or UrllibTransport(config.timeout)
        self.sleep = sleep
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _url(self) -> str:
        base = self.config.base_url.rstrip("/")
        return base + "/chat/completions" if base.endswith("/v1") else base + CHAT_URL

    def backoff(self, attempt: int, headers: dict[str, str] | None = None) -> float:
        delay = min(self.config.backoff_max, self.config.backoff_base * 2**attempt)
        hinted = _retry_after(headers or {})
        return max(delay, hinted) if hinted is not None else delay

    async def complete(self, body: dict) -> dict:
        """Send one chat-completions body; ``model`` defaults to the configured model."""
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._loop is not loop:  # each stage run has its own event loop
            self._semaphore, self._loop = asyncio.Semaphore(self.config.concurrency), loop
        body = {**body, "model": body.get("model") or self.config.model}
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        async with self._semaphore:
            for attempt in range(self.config.max_retries + 1):
                last = attempt == self.config.max_retries
                try:
                    status, resp_headers, payload = await self.transport.post(self._url(), headers, body)
                except (OSError, TimeoutError) as e:
                    if last:
                        why = getattr(e, "reason", e)  # urllib's URLError wraps the socket error
                        raise LLMError(
                            f"transport error after {attempt + 1} attempts to reach {self._url()}: {why}"
                        ) from e
                    delay = self.backoff(attempt)
                    logger.warning("transport error (%s); retrying in %.1fs", e, delay)
                    await self.sleep(delay)
                    continue
                if status == 200 and isinstance(payload, dict):
                    return payload
                if status in RETRY_STATUS and not last:
                    delay = self.backoff(attempt, resp_headers)
                    logger.warning("HTTP %d; retrying in %.1fs (attempt %d)", status, delay, attempt + 1)
                    await self.sleep(delay)
                    continue
                raise LLMError(f"HTTP {status} from {self._url()}: {str(payload)[:500]}", status)
        raise AssertionError("unreachable")


# ------------------------------------------------------------------------------ resumable request runs


class Completer(Protocol):
    async def complete(self, body: dict) -> dict: ...


def _repair_tail(path: Path) -> None:
    """Drop a partial last line left by a killed run, so appending cannot glue two records together."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    logger.warning("%s: dropping a truncated last line (%d bytes) from an interrupted run", path, len(data) - cut)
    with open(path, "r+b") as f:
        f.truncate(cut)


@dataclass
class RunReport:
    sent: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)
    last_error: str | None = None  # why the last failed request failed


async def run_requests_async(client: Completer, requests: list[dict], out_path: str | Path) -> RunReport:
    """Send every request not yet answered in ``out_path``; append each answer as it arrives.

    A failed request is logged and left out of the file, so the next run retries it. A line there without an answer
    (a Batch-API output's failed request: an error, a non-200 status) is sent again too; the new line, later in the
    file, is the one read.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _repair_tail(out_path)
    done = {cid for cid, answer in read_saved_answers(out_path).items() if answer.content is not None}
    todo = [r for r in requests if r["custom_id"] not in done]
    report = RunReport(skipped=len(requests) - len(todo))
    if not todo:
        return report
    with open(out_path, "a", encoding="utf-8") as f, tqdm(total=len(todo), desc=out_path.name) as bar:

        async def one(req: dict) -> None:
            try:
                completion = await client.complete(req["body"])
            except LLMError as e:
                logger.error("%s: request %s failed: %s", out_path.name, req["custom_id"], e)
                report.failed.append(req["custom_id"])
                report.last_error = str(e)
                return
            f.write(json.dumps(output_record(req["custom_id"], completion), ensure_ascii=False) + "\n")
            f.flush()
            report.sent += 1
            bar.update(1)

        await asyncio.gather(*(one(r) for r in todo))
    return report


def run_requests(client: Completer, requests: list[dict], out_path: str | Path) -> RunReport:
    return asyncio.run(run_requests_async(client, requests, out_path))


def retry_id(custom_id: str, n: int) -> str:
    return f"{custom_id}{RETRY_SEP}{n}"


def run_with_regeneration(
    client: Completer,
    requests: list[dict],
    out_path: str | Path,
    is_valid: Callable[[str], bool],
    max_regenerations: int = 2,
) -> RunReport:
    """Run ``requests``; re-send the same messages as ``<id>#retry<n>`` while the answer is malformed.

    Which retries are needed depends only on the answers already on disk, so reruns stay resumable.
    """
    total = RunReport()
    pending = list(requests)
    for n in range(max_regenerations + 1):
        rep = run_requests(client, pending, out_path)
        total.sent += rep.sent
        total.skipped += rep.skipped
        total.failed += rep.failed
        total.last_error = rep.last_error or total.last_error
        if n == max_regenerations:
            break
        outputs = read_saved_answers(out_path)
        pending = []
        for req in requests:
            cid = req["custom_id"]
            latest = cid if n == 0 else retry_id(cid, n)
            if latest in outputs and select_answer(outputs, cid, is_valid, n) is None:
                # a distinct seed makes each regeneration a different request, also for greedy endpoints
                body = {**req["body"], "seed": n + 1}
                pending.append({**req, "custom_id": retry_id(cid, n + 1), "body": body})
        if not pending:
            break
    return total


def answer_chain(custom_id: str, max_regenerations: int) -> list[str]:
    return [custom_id] + [retry_id(custom_id, k) for k in range(1, max_regenerations + 1)]


def select_answer(
    outputs: dict[str, BatchResult], custom_id: str, is_valid: Callable[[str], bool], max_regenerations: int = 8
) -> str | None:
    """First well-formed answer among ``custom_id`` and its ``#retry<n>`` regenerations, else None."""
    for cid in answer_chain(custom_id, max_regenerations):
        res = outputs.get(cid)
        if res is not None and res.content is not None and is_valid(res.content):
            return res.content
    return None
