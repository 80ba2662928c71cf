"""One run over several processes (``jax.distributed`` on 127.0.0.1, gloo collectives, forced CPU devices).

Every test starts its processes in their own session, bounds their time, and ends every one it started,
also when it fails (:func:`processes`). All are ``slow``: each process compiles its own programs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAMILY = ROOT / "tests" / "fl" / "sharded_family.py"
pytestmark = pytest.mark.slow  # every test starts processes that each compile their programs: minutes

#: a run small enough for the driver tests: digits, 12 clients, 10 per round (neither divides 8 devices)
SMALL_RUN = [
    "--data.dataset", "digits", "--data.model", "mlp_32_16", "--data.num_clients", "12",
    "--data.participation", "0.84", "--no-progress",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra: str) -> dict:
    from helpers import forced_devices_env

    env = forced_devices_env(devices, **extra)
    env.pop("JAX_PLATFORMS", None)
    return env


@contextlib.contextmanager
def processes(commands: list[list[str]], env: dict, logs: Path):
    """Starts one process per command (stdout and stderr to ``logs/p<i>.log``), each in its own session;
    on leaving, kills the process group of every one still running (only those started here)."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for i, cmd in enumerate(commands):
            log = (logs / f"p{i}.log").open("w")
            procs.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            log.close()
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


def _wait(procs, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]


def _log(logs: Path, i: int) -> str:
    text = (logs / f"p{i}.log").read_text(errors="replace")
    return "\n".join(line for line in text.splitlines() if not line.startswith("[Gloo]"))


def _one_process(cmd: list[str]) -> subprocess.CompletedProcess:
    """One process on one device, bounded in time (``subprocess.run`` kills it on timeout)."""
    return subprocess.run(cmd, cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=600)


def _run_cmd(out: Path, *flags: str, port: int | None = None, pid: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "experiments.run", "fedavg", *SMALL_RUN, "--output", str(out), *flags]
    if port is not None:
        cmd += ["--run.processes", "2", "--run.devices", "8", "--run.coordinator", f"127.0.0.1:{port}"]
        cmd += ["--run.process_id", str(pid)]
    return cmd


def test_two_processes_of_four_devices_equal_one_device(tmp_path):
    """FedAvg, FedPM-KLMS and BICompFL-PR for 3 rounds over 2 processes x 4 devices (16 clients, 10 per
    round): each round's participants, uplink and downlink messages bit for bit, the server and client
    states within 8 ULP of the single-device run (which each process also computes, on its first device)."""
    port = _free_port()
    names = ["fedavg", "fedpm_klms", "bicompfl_pr_splitdl"]
    cmds = [
        [sys.executable, str(FAMILY), "--devices", "8", "--rounds", "3", "--processes", "2"]
        + ["--process-id", str(i), "--coordinator", f"127.0.0.1:{port}", *names]
        for i in range(2)
    ]
    with processes(cmds, _env(4), tmp_path) as procs:
        codes = _wait(procs, 1500)
    for i in range(2):
        rows = [json.loads(line) for line in _log(tmp_path, i).splitlines() if line.startswith("{")]
        assert codes[i] == 0 and [r["name"] for r in rows if r["ok"]] == names, _log(tmp_path, i)[-4000:]


def test_the_driver_over_two_processes_writes_once_and_resumes_on_the_same_topology(tmp_path):
    """``experiments.run`` with --run.processes 2: the same rounds, bits and accuracy as one process on one
    device; only process 0 writes (process 1 is given another --output, which must stay absent); a resume
    on 2 processes extends the run, one on 1 process is refused naming the topology."""
    single, out, other = tmp_path / "single", tmp_path / "two", tmp_path / "never"
    one = _one_process(_run_cmd(single, "--run.rounds", "3"))
    assert one.returncode == 0, one.stderr[-3000:]
    port = _free_port()
    cmds = [
        _run_cmd(out, "--run.rounds", "3", port=port, pid=0),
        _run_cmd(other, "--run.rounds", "3", port=port, pid=1),
    ]
    with processes(cmds, _env(4), tmp_path / "logs") as procs:
        codes = _wait(procs, 600)
    assert codes == [0, 0], (_log(tmp_path / "logs", 0)[-3000:], _log(tmp_path / "logs", 1)[-3000:])
    assert not other.exists()
    a = [json.loads(line) for line in (single / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["uplink_bits"] for r in a] == [r["uplink_bits"] for r in b]
    assert [r["downlink_bits"] for r in a] == [r["downlink_bits"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        # 360 test examples: a ULP difference in the weights flips no prediction here (one would be 0.0028)
        assert abs(ra["test_accuracy"] - rb["test_accuracy"]) < 0.002
        assert rb["test_loss"] == pytest.approx(ra["test_loss"], rel=1e-4)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 8

    port = _free_port()
    cmds = [_run_cmd(out, "--resume", "--run.rounds", "4", port=port, pid=i) for i in range(2)]
    with processes(cmds, _env(4), tmp_path / "logs2") as procs:
        codes = _wait(procs, 600)
    assert codes == [0, 0], _log(tmp_path / "logs2", 0)[-3000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4

    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    refused = _one_process(
        [sys.executable, "-m", "experiments.run", "--output", str(out), "--resume", "--run.rounds", "5"]
        + ["--run.processes", "1", "--run.devices", "1", "--no-progress"]
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "checkpointed on 8 device(s) in 2 process(es)" in refused.stderr
    assert "--run.devices 8 --run.processes 2" in refused.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_processes_started_with_different_flags_all_stop_before_writing(tmp_path):
    port = _free_port()
    out = tmp_path / "run"
    cmds = [
        _run_cmd(out, "--run.rounds", "3", port=port, pid=0),
        _run_cmd(out, "--run.rounds", "3", "--run.seed", "1", port=port, pid=1),
    ]
    with processes(cmds, _env(4), tmp_path / "logs") as procs:
        codes = _wait(procs, 300)
    for i in range(2):
        log = _log(tmp_path / "logs", i)
        assert codes[i] == 2 and "started with different configurations: process(es) [1] differ" in log, log
    assert not out.exists()


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_process_that_dies_stops_the_other_with_a_clear_error_and_the_checkpoint_intact(tmp_path, signum):
    """Process 1 is killed (or frozen) once round 2 is checkpointed: process 0 stops (exit status 4)
    instead of waiting for it, naming the last checkpoint and the resume; that checkpoint is intact.

    Killed: process 0 learns of it from its next collective (gloo reports the reset connection) or, when
    that collective waits instead (1 kill in 10 here; what failed in CI), from the watch of signs of life
    (``experiments.distributed.LOST_AFTER_S``, 15 s). Frozen (SIGSTOP: its connections stay open, so
    only the watch can tell): always the watch. Either comes before JAX's heartbeat (30 s), which would
    abort process 0 from C++ (exit status 134) without a word on the checkpoint. One outcome of a kill is
    outside Python: gloo itself aborts process 0 when it receives a half-sent message ("gloo::EnforceNotMet",
    SIGABRT, about 1 kill in 15 here); the test accepts that one alone, and checks the checkpoint all the
    same."""
    port = _free_port()
    out = tmp_path / "run"
    cmds = [_run_cmd(out, "--run.rounds", "500", port=port, pid=i) for i in range(2)]
    env = _env(4)
    for name in ("SIDEJAX_DIST_HEARTBEAT_TIMEOUT_S", "SIDEJAX_DIST_LOST_AFTER_S"):
        env.pop(name, None)  # the defaults: 30 s and 15 s
    with processes(cmds, env, tmp_path / "logs") as procs:
        deadline = time.monotonic() + 600
        while "\n    2 |" not in _log(tmp_path / "logs", 0) and time.monotonic() < deadline:
            assert procs[0].poll() is None, _log(tmp_path / "logs", 0)[-3000:]
            time.sleep(0.5)
        os.killpg(procs[1].pid, signum)
        signalled = time.monotonic()
        code = procs[0].wait(timeout=120)  # a bound against a hang (it stops in seconds), not a speed check
        stopped_after = time.monotonic() - signalled
    log = _log(tmp_path / "logs", 0)
    gloo_abort = "gloo::EnforceNotMet" in log and code == -signal.SIGABRT
    if signum == signal.SIGKILL and gloo_abort:
        # gloo's own abort (a C++ terminate in its transport thread, the killed process's half-sent message):
        # about 1 kill in 15 here, nothing Python can catch; documented (experiments/distributed.py). The
        # checkpoint must still be intact, and the process has stopped, not hung.
        pass
    else:
        assert code == 4, f"exit status {code}, {stopped_after:.1f} s after the signal\n" + log[-3000:]
        assert "another process of this run has most likely stopped" in log and "--resume" in log, log[-3000:]
    if signum == signal.SIGSTOP:
        assert "process(es) [1] gave no sign of life for 15 s" in log, log[-3000:]
    from experiments.checkpoint import read_checkpoint_meta

    assert read_checkpoint_meta(out / "checkpoint")["round_index"] >= 2
