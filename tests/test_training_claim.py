"""One run per run folder, under concurrency: the folder is claimed atomically when a run opens it.

Before, two trainings into one folder both exited 0 and the last writer won: nothing was written or
locked when a run took a folder. Here: two runs started together (one trains, the other is refused,
naming the holder, and writes nothing); a run started while another trains, before its first
checkpoint, is refused; a SIGKILLed run leaves a claim that a resume on the same host takes over;
torchrun claims once per run (rank 0), its other ranks learn the outcome; a claim from another host
needs ``--break_run_claim``; processes racing for a folder or a stale claim: exactly one wins.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from conftest import ROOT, TINY_RUN_ID, torchrun

from diffusion_embedder.training.checkpoints import COMPLETE_MARKER, TRAIN_CONFIG, find_last_checkpoint
from diffusion_embedder.training.claim import CLAIM_FILE, RunFolderBusyError, RunIdentity, acquire

MNTP = ROOT / "train_configs" / "tiny" / "mntp.json"
MNTP_RUN = "tiny-mntp"
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
#: The MNTP stage, held at its first training step until the file ``go`` exists (``started`` says it got
#: there), then ``pause`` seconds per step: a run that is certainly still training when the test acts.
HELD_RUN = """
import os, sys, time
from diffusion_embedder.training import lm

started, go, pause = sys.argv[1], sys.argv[2], float(sys.argv[3])
real = lm.LMStageTrainer.compute_loss

def compute_loss(self, *args, **kwargs):
    if not os.path.exists(started):
        open(started, "w").close()
        deadline = time.time() + 300
        while not os.path.exists(go) and time.time() < deadline:
            time.sleep(0.05)
    time.sleep(pause)
    return real(self, *args, **kwargs)

lm.LMStageTrainer.compute_loss = compute_loss
sys.exit(lm.main(sys.argv[4:]))
"""


def mntp_args(out: Path, *overrides: str) -> list[str]:
    return [str(MNTP), "--output_dir", str(out), "--report_to", "none", *overrides]


def held_run(tmp_path: Path, name: str, out: Path, *overrides: str, pause: float = 0.0) -> subprocess.Popen:
    started, go = tmp_path / f"{name}.started", tmp_path / "go"
    command = [sys.executable, "-c", HELD_RUN, str(started), str(go), str(pause), *mntp_args(out, *overrides)]
    return subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def plain_run(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "experiments" / "run_mntp.py"), *mntp_args(out, *overrides)]
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def wait_for(condition, what: str, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_two_runs_started_together_one_trains_the_other_is_refused(tmp_path):
    out = tmp_path / "out"
    runs = {lr: held_run(tmp_path, lr, out, "--learning_rate", lr) for lr in ("0.002", "0.001")}
    try:
        wait_for(lambda: any(p.poll() is not None for p in runs.values()), "one of the two runs to stop", 150)
        (loser_lr, loser), = [(lr, p) for lr, p in runs.items() if p.poll() is not None]
        (winner_lr, winner), = [(lr, p) for lr, p in runs.items() if p is not loser]
        refused = loser.stdout.read()
        assert loser.returncode == 2, refused[-3000:]
        assert "is in use by run" in refused and f"pid {winner.pid} on host {socket.gethostname()}" in refused
        assert "still running" in refused and "Loaded" not in refused  # stopped before its model loaded
        (tmp_path / "go").touch()
        assert winner.wait(timeout=300) == 0, winner.stdout.read()[-3000:]
    finally:
        for process in runs.values():
            process.kill()
    run = out / MNTP_RUN
    assert not (run / CLAIM_FILE).exists()  # released when the run ended
    for record in [run / TRAIN_CONFIG, *run.glob(f"checkpoint-*/{TRAIN_CONFIG}")]:
        assert json.loads(record.read_text())["learning_rate"] == float(winner_lr), record
    assert loser_lr != winner_lr


def test_a_run_started_while_another_trains_is_refused_and_a_killed_run_resumes(tmp_path):
    out, run = tmp_path / "out", tmp_path / "out" / MNTP_RUN
    config = ["--max_steps", "1000", "--save_steps", "2", "--learning_rate", "0.002"]
    first = held_run(tmp_path, "first", out, *config, pause=0.2)
    try:
        wait_for(lambda: (tmp_path / "first.started").exists(), "the first run's first step")
        before = listing(run)
        assert not [name for name in before if name.startswith("checkpoint-")]  # training, no checkpoint yet
        second = plain_run(out, "--max_steps", "1000", "--save_steps", "2", "--learning_rate", "0.001")
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"Run folder {run} is in use by run" in second.stderr and f"pid {first.pid} " in second.stderr
        assert listing(run) == before  # the refused run wrote nothing

        (tmp_path / "go").touch()
        wait_for(lambda: (run / "checkpoint-2" / COMPLETE_MARKER).exists(), "the first complete checkpoint")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        first.kill()
    assert json.loads((run / CLAIM_FILE).read_text())["pid"] == first.pid  # a killed run leaves its claim
    last = find_last_checkpoint(run)
    stop = int(last.rsplit("-", 1)[1]) + 2
    resumed = plain_run(out, *config, "--resume_from_checkpoint", "last", "--stop_after_n_steps", str(stop))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stderr
    assert f"pid {first.pid} on host" in log and "which no longer runs: this run takes it over" in log
    assert f"resuming from {last}" in log
    assert (run / f"checkpoint-{stop}" / COMPLETE_MARKER).exists() and not (run / CLAIM_FILE).exists()


HOLDER = """
import sys, time
from diffusion_embedder.training.claim import acquire
acquire(sys.argv[1])
print("claimed", flush=True)
time.sleep(300)
"""


def test_torchrun_claims_once_and_its_ranks_learn_the_outcome(tmp_path):
    """Rank 0 claims for the run: a folder held by a live run stops every rank (no hang); once that holder
    is killed, a 2-process run takes the claim over once and trains (a second claim by rank 1 would find
    rank 0's claim alive and stop)."""
    run = tmp_path / TINY_RUN_ID
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "claimed"
        refused = torchrun(tmp_path, "--max_steps", "2", "--save_steps", "2", check=False)
        output = refused.stdout + refused.stderr
        assert refused.returncode != 0 and "is in use by run" in output and f"pid {holder.pid} " in output
        assert "Loaded" not in output and not list(run.glob("checkpoint-*"))
    finally:
        holder.kill()
        holder.wait()
    trained = torchrun(tmp_path, "--max_steps", "2", "--save_steps", "2")
    output = trained.stdout + trained.stderr
    assert output.count("this run takes it over") == 1
    assert (run / "checkpoint-2" / COMPLETE_MARKER).exists() and not (run / CLAIM_FILE).exists()


# ---------------------------------------------------------------- the claim itself, in one process


def write_claim(folder: Path, identity: RunIdentity) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CLAIM_FILE).write_text(json.dumps(asdict(identity)))


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_claim_is_exclusive_until_released(tmp_path):
    folder = tmp_path / "a" / "run"
    claim = acquire(str(folder))
    with pytest.raises(RunFolderBusyError, match=f"is in use by run {claim.identity.run_uuid} \\(pid {os.getpid()} "):
        acquire(str(folder))
    claim.release()
    assert not (folder / CLAIM_FILE).exists() and not (tmp_path / "a").exists()  # the folders it made, empty
    again = acquire(str(folder))
    assert json.loads((folder / CLAIM_FILE).read_text())["run_uuid"] == again.identity.run_uuid
    again.release()


@pytest.mark.parametrize("how", ["process gone", "pid reused"])
def test_a_claim_whose_holder_is_gone_on_this_host_is_taken_over_and_said(tmp_path, caplog, how):
    mine = RunIdentity.of_this_process()
    stale = replace(mine, run_uuid="old", pid=dead_pid()) if how == "process gone" else replace(
        mine, run_uuid="old", pid_started=(mine.pid_started or 0) + 1
    )
    write_claim(tmp_path, stale)
    claim = acquire(str(tmp_path))
    assert "run old (pid" in caplog.text and "which no longer runs: this run takes it over" in caplog.text
    claim.release()


def test_a_claim_from_another_host_needs_break_run_claim(tmp_path, caplog):
    write_claim(tmp_path, replace(RunIdentity.of_this_process(), run_uuid="far", host="elsewhere"))
    with pytest.raises(RunFolderBusyError, match="on host elsewhere.*cannot be told from here.*--break_run_claim"):
        acquire(str(tmp_path))
    claim = acquire(str(tmp_path), break_claim=True)
    assert "was declared over with --break_run_claim" in caplog.text
    claim.release()


def _race(folder: str, start, done, results) -> None:
    start.wait()
    try:
        acquire(folder)
        results.put("claimed")
    except RunFolderBusyError as err:
        results.put("busy" if "still running" in str(err) else str(err))
    done.wait()  # the winner stays alive until every other process has looked


@pytest.mark.parametrize("stale", [False, True], ids=["fresh folder", "stale claim"])
def test_processes_racing_for_a_folder_or_a_stale_claim_one_wins(tmp_path, stale):
    if stale:
        write_claim(tmp_path, replace(RunIdentity.of_this_process(), run_uuid="old", pid=dead_pid()))
    context = multiprocessing.get_context("fork")
    start, done, results = context.Barrier(4), context.Barrier(4), context.Queue()
    processes = [context.Process(target=_race, args=(str(tmp_path), start, done, results)) for _ in range(4)]
    for process in processes:
        process.start()
    outcomes = sorted(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    assert outcomes == ["busy", "busy", "busy", "claimed"]
