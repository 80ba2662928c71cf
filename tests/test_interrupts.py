"""Ctrl-C (experiments/interrupts.py): a first press in the round loop stops the run at its next safe point
(checkpoint written), a second press (or a first one outside the loop) ends the process with status 130 once
no write is in progress; a round in parts (run.clients_per_step) resumes from its last part with the same
results as a run in one go."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from experiments import interrupts
from experiments.checkpoint import read_checkpoint_meta

ROOT = Path(__file__).resolve().parents[1]

#: a few-second BPC-FL on two moons: 5 clients, tiny trajectories and pseudocoreset learning
TINY = [
    "--preset",
    "bpcfl_moons_bpcfl_sgd",
    "--method.num_updates",
    "6",
    "--method.pairs_per_update",
    "2",
    "--method.num_noise",
    "2",
    "--method.num_trajectories",
    "3",
    "--method.pretrain_steps",
    "20",
    "--method.data_chain_length",
    "10",
    "--method.coreset_chain_length",
    "4",
    "--method.map_steps",
    "10",
    "--no-progress",
]


def test_first_ctrl_c_in_the_round_loop_stops_at_the_next_stop_point():
    said = []
    before = signal.getsignal(signal.SIGINT)  # Python's handler, or SIG_IGN in a background job
    with interrupts.handle_ctrl_c(lambda: said.append("resume")) as ctrl_c:
        assert ctrl_c is not None
        with interrupts.deferring():
            interrupts.stop_point()  # nothing asked yet
            os.kill(os.getpid(), signal.SIGINT)  # read by the watcher thread, not raised here
            assert ctrl_c.stop.wait(30)
            with pytest.raises(interrupts.Interrupted):
                interrupts.stop_point()
        assert ctrl_c.report() == 130 and ctrl_c.report() == 130
    assert said == ["resume"]  # printed once
    # the handler is gone: stop_point does nothing, Ctrl-C is handled as before
    interrupts.stop_point()
    assert signal.getsignal(signal.SIGINT) is before
    assert issubclass(interrupts.Interrupted, KeyboardInterrupt)  # the commands' `except KeyboardInterrupt`


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ctrl_c(proc: subprocess.Popen, ready, presses: int, *, settle: float = 0.0) -> tuple[str, str]:
    """Waits until ``ready()`` (the process still running), then ``settle`` seconds, and sends ``presses``
    SIGINTs 0.3 s apart; returns the process's output. The process is ended on every path."""
    try:
        while not ready():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        time.sleep(settle)
        for i in range(presses):
            time.sleep(0.3 if i else 0.0)
            proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=900)
    finally:
        proc.kill()
        proc.wait()


def test_second_ctrl_c_quits_with_130_once_the_write_in_progress_ends(tmp_path):
    """A process in a long "compiled call" (a sleep in C) inside the round loop: the first Ctrl-C is noted at
    once, the second ends the process with 130 and on_quit's message; a Ctrl-C during a write waits for it."""
    code = f"""
        import time, pathlib
        from experiments import interrupts
        d = pathlib.Path({str(tmp_path)!r})
        with interrupts.handle_ctrl_c(lambda: print("RESUME", (d / "file").read_text())):
            with interrupts.deferring():
                with interrupts.writing():
                    (d / "ready").write_text("")
                    time.sleep(1.0)  # the test's Ctrl-Cs arrive while this write runs
                    (d / "file").write_text("complete")
                time.sleep(600)  # a long call: never ends by itself
        print("NOT REACHED")
    """
    proc = _start(code)
    out, err = _ctrl_c(proc, (tmp_path / "ready").exists, 2)
    assert proc.returncode == 130, (out, err)
    assert "RESUME complete" in out and "NOT REACHED" not in out
    assert "Press Ctrl-C again to quit now" in err and "core dumped" not in err


def test_first_ctrl_c_outside_the_round_loop_quits_at_once(tmp_path):
    code = f"""
        import time, pathlib
        from experiments import interrupts
        with interrupts.handle_ctrl_c(lambda: print("RESUME")):
            pathlib.Path({str(tmp_path / "ready")!r}).write_text("")
            time.sleep(600)
    """
    proc = _start(code)
    out, err = _ctrl_c(proc, (tmp_path / "ready").exists, 1)
    assert proc.returncode == 130 and out.strip() == "RESUME", (out, err)


def _config(**run):
    from experiments.config import load_preset

    flags = dict(zip(TINY[2:-1:2], TINY[3:-1:2], strict=True))
    values = {k.removeprefix("--"): int(v) for k, v in flags.items()}
    return load_preset("bpcfl_moons_bpcfl_sgd").override(
        {**values, **{f"run.{k}": v for k, v in run.items()}}, source="test"
    )


def _final(out: Path):
    """The metrics rows (without wall times), final accuracy, total bits and final model file of a run."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("wall_time_s")
    summary = json.loads((out / "summary.json").read_text())
    return rows, summary["final_accuracy"], summary["total_bits"], (out / "final_params" / "state.ckpt")


@pytest.mark.slow  # three tiny BPC-FL runs (~50 s on 2 CPU cores); fast siblings: tests/fl/test_rounds.py,
# tests/algorithms/test_bpcfl.py (a round in parts equals one go)
def test_a_round_in_parts_interrupted_and_resumed_equals_one_go(tmp_path, monkeypatch):
    """BPC-FL's client phase in parts of 2 of 5 clients, stopped (as by Ctrl-C) after its second part: the
    checkpoint holds the round-0 state and 4 clients' uploads; the resume runs the last client only and gives
    the metrics rows, bits, accuracy and final model (its bytes) of the run in one go."""
    from experiments import driver

    one = tmp_path / "one"
    driver.run_experiment(_config(), one, progress=False, verbose=False)

    stops = []

    def stop_after_second_part():
        stops.append(1)
        if len(stops) == 2:
            raise interrupts.Interrupted

    parts = tmp_path / "parts"
    monkeypatch.setattr(interrupts, "stop_point", stop_after_second_part)
    with pytest.raises(interrupts.Interrupted):
        driver.run_experiment(_config(clients_per_step=2), parts, progress=False, verbose=False)
    meta = read_checkpoint_meta(parts / "checkpoint")
    assert (meta["round_index"], meta["clients_done"], meta["round_clients"]) == (0, 4, 5)
    assert not (parts / "summary.json").exists()
    monkeypatch.undo()
    driver.run_experiment(_config(clients_per_step=2), parts, resume=True, progress=False, verbose=False)
    rows_one, acc_one, bits_one, final_one = _final(one)
    rows_parts, acc_parts, bits_parts, final_parts = _final(parts)
    assert rows_parts == rows_one and acc_parts == acc_one and bits_parts == bits_one
    assert final_parts.read_bytes() == final_one.read_bytes()
    assert "clients_done" not in read_checkpoint_meta(parts / "checkpoint")


def _run_cli(args, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.run", *TINY, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


@pytest.mark.slow
def test_ctrl_c_on_the_command_line_stops_in_a_round_and_the_printed_command_resumes_it(tmp_path):
    """The command line, in parts of 1 client: Ctrl-C once the first part's checkpoint is on disk stops at
    the end of a later part with status 130 and the resume command (no crash); that command finishes the
    run with the results of an uninterrupted one. A double Ctrl-C during the first compilation quits at once
    with 130, from the round-0 checkpoint."""
    whole = tmp_path / "whole"
    done = subprocess.run(
        [sys.executable, "-m", "experiments.run", *TINY, "--output", str(whole)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "run"

    def first_part_checkpointed() -> bool:
        try:
            return read_checkpoint_meta(out / "checkpoint").get("clients_done", 0) >= 1
        except (OSError, ValueError):
            return False

    proc = _run_cli(["--run.clients_per_step", "1", "--output", str(out)])
    _, stderr = _ctrl_c(proc, first_part_checkpointed, 1)
    assert proc.returncode == 130, stderr
    assert "the run stops at the end of the current step" in stderr and "core dumped" not in stderr
    meta = read_checkpoint_meta(out / "checkpoint")
    assert 1 <= meta.get("clients_done", 5) <= 4, meta
    assert f"and {meta['clients_done']} of the 5 clients of round 1. To continue:" in stderr
    command = stderr.strip().splitlines()[-1].split()
    assert command[1:] == ["-m", "experiments.run", "--output", str(out), "--resume", "--run.rounds", "1"]
    resumed = subprocess.run(
        [sys.executable, *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr
    assert _final(out)[:3] == _final(whole)[:3]
    assert _final(out)[3].read_bytes() == _final(whole)[3].read_bytes()

    early = tmp_path / "early"
    proc = _run_cli(["--output", str(early)])
    # a second after the round-0 checkpoint: compiling the round
    _, stderr = _ctrl_c(proc, (early / "checkpoint" / "state.ckpt").exists, 2, settle=1.0)
    assert proc.returncode == 130, stderr
    assert f"the last checkpoint in {early} is at round 0 of 1. To continue:" in stderr
    assert read_checkpoint_meta(early / "checkpoint")["round_index"] == 0
    assert not list((early / "checkpoint").glob(".*tmp*"))
