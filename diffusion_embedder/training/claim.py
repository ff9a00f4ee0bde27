"""One run per run folder: a claim file created atomically when a run opens its folder, removed when it ends.

A run claims its folder before it reads a checkpoint there or writes anything: ``run_claim.json`` is created
with ``O_CREAT | O_EXCL`` (atomic on a local file system and on NFSv3 or later, which we assume for a shared
one) and holds the run's identity: host, pid and the start time of that process, a run uuid, the command and
the torchrun job id. Under torchrun rank 0 claims for the whole run; the other ranks learn the outcome from
it through ``torch.distributed`` (``claim_run``), so there is one claim per run, never one per rank.

A run that finds the folder claimed:

* the holder still runs on this host: stops, naming the folder, the holder and what to do;
* the holder is gone on this host (killed, crashed): takes the claim over and says so in the log, so that
  ``--resume_from_checkpoint last`` after a crash needs no manual step (the folder's other checks still apply:
  a fresh start in a folder holding checkpoints stops unless ``overwrite_output_dir``);
* the holder is on another host: whether it still runs cannot be told from here, so the run stops unless
  ``break_run_claim`` says that run is over.

The claim is removed when the run ends, also by an exception, and at interpreter exit as a safety net; a
killed process leaves it behind, for the rules above. A host name is taken to name one process namespace.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import torch.distributed as dist

from diffusion_embedder.training.schema import ConfigError

logger = logging.getLogger(__name__)

CLAIM_FILE = "run_claim.json"
#: Serializes taking over a stale claim, so that two runs cannot both replace it.
TAKEOVER_FILE = CLAIM_FILE + ".takeover"
_TRIES = 10
_PAUSE_S = 0.2


class RunFolderBusyError(ConfigError):
    """The run folder is claimed by another run; the message names the holder and what to do."""


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), to tell a reused pid; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class RunIdentity:
    """Who holds a run folder: written into the claim file, named in every message about it."""

    run_uuid: str
    host: str
    pid: int
    pid_started: int | None
    started: str
    command: str
    torchrun_job: str | None = None
    world_size: int = 1

    @classmethod
    def of_this_process(cls, world_size: int = 1) -> RunIdentity:
        return cls(
            run_uuid=uuid.uuid4().hex,
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_started=_process_start(os.getpid()),
            started=datetime.now(UTC).isoformat(timespec="seconds"),
            command=" ".join([os.path.basename(sys.argv[0]) if sys.argv else "python", *sys.argv[1:]])[:300],
            torchrun_job=os.environ.get("TORCHELASTIC_RUN_ID"),
            world_size=world_size,
        )

    def describe(self) -> str:
        job = f", torchrun job {self.torchrun_job}" if self.torchrun_job else ""
        return (
            f"run {self.run_uuid} (pid {self.pid} on host {self.host}, started {self.started}{job}; "
            f"command: {self.command})"
        )

    def state(self) -> str:
        """``alive``, ``gone`` (its process no longer exists on this host) or ``unknown`` (another host)."""
        if self.host != socket.gethostname():
            return "unknown"
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:  # another user's process: it exists
            pass
        started = _process_start(self.pid)
        if self.pid_started is not None and started is not None and started != self.pid_started:
            return "gone"  # the pid now belongs to another process
        return "alive"


def _read(path: str) -> RunIdentity | None:
    """The claim in ``path``; None when there is none. A claim being written is waited for briefly."""
    for _ in range(_TRIES):
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
            identity = RunIdentity(**values)
            if isinstance(identity.pid, int) and identity.pid > 0:
                return identity
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError):
            pass
        time.sleep(_PAUSE_S)  # created but not yet written (O_EXCL comes first), or damaged
    raise RunFolderBusyError(
        f"{path} is not a readable run claim, so it is not known which run holds {os.path.dirname(path)}. "
        f"If no run is using that folder, delete {path} and start again."
    )


def _create(path: str, identity: RunIdentity) -> bool:
    """Write the claim if no claim exists (atomically); False if one does."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(asdict(identity), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    return True


def _take_over(folder: str, stale: RunIdentity, identity: RunIdentity) -> bool:
    """Replace the claim of ``stale`` by ours, one taker at a time; False if another run got there first."""
    lock = os.path.join(folder, TAKEOVER_FILE)
    try:
        os.close(os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    try:
        path = os.path.join(folder, CLAIM_FILE)
        current = _read(path)
        if current is None or current.run_uuid != stale.run_uuid:
            return False
        os.remove(path)
        return _create(path, identity)
    finally:
        os.remove(lock)


def _busy(folder: str, holder: RunIdentity, state: str) -> RunFolderBusyError:
    if state == "alive":
        return RunFolderBusyError(
            f"Run folder {folder} is in use by {holder.describe()}, which is still running. Wait for it to end "
            "or stop it, or start this run under another output_dir or experiment_id."
        )
    return RunFolderBusyError(
        f"Run folder {folder} is claimed by {holder.describe()}, on another host: whether that run still runs "
        "cannot be told from here. If it has ended, pass --break_run_claim to take the folder over (or delete "
        f"{os.path.join(folder, CLAIM_FILE)}); otherwise start this run under another output_dir or experiment_id."
    )


@dataclass
class FolderClaim:
    """A run's claim on its folder. ``held``: this process holds the file (rank 0); ``release`` removes it."""

    folder: str
    identity: RunIdentity
    held: bool = True
    created: list[str] = field(default_factory=list)  # folders this claim made, deepest first

    def release(self) -> None:
        """Remove the claim (only ours), and the folders it made if the run left them empty."""
        if not self.held:
            return
        self.held = False
        _HELD.pop(id(self), None)
        path = os.path.join(self.folder, CLAIM_FILE)
        try:
            current = _read(path)
        except RunFolderBusyError:
            current = None
        if current is not None and current.run_uuid == self.identity.run_uuid:
            os.remove(path)
        for made in self.created:
            try:
                os.rmdir(made)
            except OSError:
                break  # not empty: the run wrote something there


#: Claims this process holds, released at exit if the run did not release them (an in-process caller's leak).
_HELD: dict[int, FolderClaim] = {}


@atexit.register
def _release_held() -> None:
    for claim in list(_HELD.values()):
        claim.release()


def _missing_folders(folder: str) -> list[str]:
    """The folders ``os.makedirs(folder)`` will create, deepest first."""
    missing, path = [], os.path.abspath(folder)
    while not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def acquire(folder: str, break_claim: bool = False, world_size: int = 1) -> FolderClaim:
    """Claim ``folder`` for this process's run (see the module docstring), or raise ``RunFolderBusyError``."""
    created = _missing_folders(folder)
    os.makedirs(folder, exist_ok=True)
    identity = RunIdentity.of_this_process(world_size)
    path = os.path.join(folder, CLAIM_FILE)
    for _ in range(_TRIES):
        if _create(path, identity):
            claim = FolderClaim(folder, identity, created=created)
            _HELD[id(claim)] = claim
            return claim
        holder = _read(path)
        if holder is None:
            continue  # released meanwhile
        state = holder.state()
        if state == "alive" or (state == "unknown" and not break_claim):
            raise _busy(folder, holder, state)
        if _take_over(folder, holder, identity):
            why = "no longer runs" if state == "gone" else "was declared over with --break_run_claim"
            logger.warning("Run folder %s was claimed by %s, which %s: this run takes it over.", folder,
                           holder.describe(), why)
            claim = FolderClaim(folder, identity, created=created)
            _HELD[id(claim)] = claim
            return claim
        time.sleep(_PAUSE_S)  # another run is taking it over: look again
    raise RunFolderBusyError(
        f"Could not claim run folder {folder}: other runs keep taking it over. If no other run is starting "
        f"there, delete {os.path.join(folder, TAKEOVER_FILE)} (a takeover that was interrupted) and start again."
    )


def claim_run(folder: str, break_claim: bool = False) -> FolderClaim:
    """``acquire`` for a run of any number of processes: under torchrun rank 0 claims and every other rank
    receives its outcome (the claim, or the same error), so the ranks cannot race for the folder."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return acquire(folder, break_claim)
    outcome: list[object] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            claim = acquire(folder, break_claim, dist.get_world_size())
            outcome[0] = claim.identity
        except Exception as err:  # every rank must hear the outcome, or the others wait forever
            error = err
            failed = RuntimeError(f"rank 0 could not claim {folder}: {err}")
            outcome[0] = err if isinstance(err, ConfigError) else failed
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    if dist.get_rank() == 0:
        return claim
    return FolderClaim(folder, outcome[0], held=False)
