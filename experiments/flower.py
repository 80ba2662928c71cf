"""Deploying an experiment over Flower: every party of the run in its own process, sidejax's packed streams on
the wire (:mod:`sidejax.flower`).

One line runs it locally, a Flower SuperLink and one SuperNode per client on 127.0.0.1 plus ``flwr run`` of
the example app (``examples/flower/``), and writes the usual results folder::

    python -m experiments.flower deploy results/flower_fedpm_klms --algorithm fedpm_klms \\
        --set data.num_clients=3 run.rounds=3

or from a preset (``--preset NAME``). ``--runtime simulation`` runs the same apps in Flower's simulation
runtime (Ray), in this process. Every process started is stopped on exit, on an error, on Ctrl-C and on
``kill`` (SIGTERM).

What the results folder holds: ``config.json`` (the run's configuration), ``metrics.jsonl`` (one line per
round: participants, their coded bits, their envelopes' bytes, Flower's serialised message sizes, who was
missing or corrupt, included, seconds; test accuracy at ``run.eval_every``), ``bytes.md`` (the table of
payload against Flower's bytes), ``server_state.npz`` (the final server state, for checks) and
``summary.json``. Logs of the SuperLink and SuperNodes are in ``logs/``.

Each process builds the run from the same run configuration (:func:`federation`), so they agree on the
algorithm, the keys and the configuration fingerprint; a SuperNode holds only its own client's examples
(:func:`sidejax.flower.own_partition` of the partition every party computes from the labels, as in
simulation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_APP = REPO / "examples" / "flower"
RUNTIMES = ("deployment", "simulation")

__all__ = ["federation", "run_config_for", "main", "deploy"]

_FEDERATIONS: dict[str, Any] = {}


def _config_from(run_config: dict):
    from experiments.config import default_config, load_preset

    overrides = json.loads(run_config.get("overrides", "{}") or "{}")
    preset, algorithm = run_config.get("preset", ""), run_config.get("algorithm", "")
    if bool(preset) == bool(algorithm):
        raise ValueError("the run configuration needs exactly one of preset or algorithm")
    base = load_preset(preset) if preset else default_config(algorithm)
    return base.override(overrides, source="the Flower run configuration") if overrides else base


def federation(run_config: dict, node_config: dict | None = None):
    """The :class:`sidejax.flower.apps.Federation` of a run configuration (``preset`` or ``algorithm``,
    ``overrides`` as JSON of dotted keys, ``min_replies``, ``round_timeout``): what every process builds.
    Cached per process (its kernels compile once)."""
    key = json.dumps(
        {k: run_config.get(k) for k in ("preset", "algorithm", "overrides", "min_replies", "round_timeout")},
        sort_keys=True,
    )
    if key in _FEDERATIONS:
        return _FEDERATIONS[key]
    from experiments.driver import prepare
    from sidejax.flower import own_partition
    from sidejax.flower.apps import Federation
    from sidejax.keys import run_keys
    from sidejax.models import init_params

    config = _config_from(run_config)
    if config.run.processes != 1 or config.run.devices != 1 or config.run.init_from:
        raise ValueError("a Flower run takes run.processes = 1, run.devices = 1 and no run.init_from")
    prepared = prepare(config)
    init_key, base_key = run_keys(config.run.seed)
    params = init_params(init_key, prepared.spec)
    fed = prepared.fed
    fed_obj = Federation(
        algorithm=prepared.algorithm,
        init_key=init_key,
        base_key=base_key,
        params=params,
        num_clients=int(np.asarray(fed.num_examples).shape[0]),
        num_rounds=int(config.run.rounds),
        config=config.to_dict(),
        partition=lambda c: own_partition(fed, c),
        min_replies=int(run_config.get("min_replies", 1)),
        round_timeout=float(run_config.get("round_timeout", 600.0)),
    )
    _FEDERATIONS[key] = (fed_obj, prepared, config)
    return _FEDERATIONS[key]


def _build(run_config, node_config):
    return federation(run_config, node_config)[0]


def _results():
    """The ServerApp's hooks ``(on_start, on_round)`` that write the results folder: ``on_start(fed, rc)``
    opens ``rc["out"]``, ``on_round`` appends to it."""
    state = {}

    def on_start(fed, rc):
        from sidejax.fl import build_algorithm_evaluator

        out = state["out"] = Path(rc["out"])
        out.mkdir(parents=True, exist_ok=True)
        if (out / "metrics.jsonl").exists():
            raise FileExistsError(f"{out} already holds a run (metrics.jsonl); choose another folder")
        _, prepared, config = federation(rc)
        (out / "config.json").write_text(
            json.dumps({**config.to_dict(), "flower": rc}, indent=2, default=repr)
        )
        state.update(fed=fed, prepared=prepared, config=config, rows=[], t0=time.perf_counter())
        if fed.algorithm.evaluation.personal is None:
            state["evaluate"] = build_algorithm_evaluator(
                fed.algorithm.evaluation, prepared.spec.module.apply, batch_size=config.run.eval_batch_size
            )

    def on_round(report, party, extra):
        import hashlib

        import jax

        from sidejax.coding.wire import message_to_bytes
        from sidejax.fl import RoundState
        from sidejax.flower import OVERHEAD_BYTES, tree_to_bytes

        out, info, config = state["out"], report.info, state["config"]
        t = report.round_index
        hashes = []
        for j in range(len(report.uplink_bytes)):
            msg = jax.tree.map(lambda a, j=j: a[j], report.messages)
            sent = int(np.asarray(msg.num_bits)) >= 0
            hashes.append(hashlib.sha256(message_to_bytes(msg)).hexdigest() if sent else None)
        row = {
            "round": t + 1,
            "participants": [int(c) for c in np.asarray(info.client_ids)],
            "uplink_bits": [int(b) for b in np.asarray(info.uplink_bits)],
            "downlink_bits": [int(b) for b in np.asarray(info.downlink_bits)],
            "uplink_stream_bytes": list(report.uplink_stream_bytes),
            "uplink_envelope_bytes": list(report.uplink_bytes),
            "downlink_envelope_bytes": list(report.downlink_bytes),
            "envelope_overhead_bytes": OVERHEAD_BYTES,
            **extra,
            "included": [bool(b) for b in np.asarray(info.included)],
            "uplink_errors": [int(e) for e in np.asarray(info.uplink_errors)],
            "uplink_sha256": hashes,
            "missing": list(report.missing),
            "corrupt": list(report.corrupt),
            "train_loss": float(np.nanmean(np.asarray(info.clients.loss, np.float64))),
        }
        last = t + 1 == state["fed"].num_rounds
        if "evaluate" in state and ((t + 1) % config.run.eval_every == 0 or last):
            rs = RoundState(t + 1, party.server, None, state["fed"].num_clients)
            scores = state["evaluate"](rs, state["prepared"].test)
            row["test_accuracy"] = float(scores.model.accuracy)
        state["rows"].append(row)
        with (out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        if last:
            (out / "server_state.npz").write_bytes(tree_to_bytes(party.server))
            _write_summary(out, state["rows"], time.perf_counter() - state["t0"])

    return on_start, on_round


def _write_summary(out: Path, rows: list[dict], seconds: float) -> None:
    up_bits = sum(
        sum(r["uplink_bits"][i] for i in range(len(r["participants"])) if r["uplink_bits"][i] > 0)
        for r in rows
    )
    summary = {
        "rounds": len(rows),
        "seconds": seconds,
        "rounds_per_second": len(rows) / seconds if seconds > 0 else None,
        "uplink_bits": up_bits,
        "uplink_stream_bytes": sum(sum(r["uplink_stream_bytes"]) for r in rows),
        "uplink_envelope_bytes": sum(sum(r["uplink_envelope_bytes"]) for r in rows),
        "flower_uplink_bytes": sum(sum(r["flower_uplink_bytes"]) for r in rows),
        "downlink_envelope_bytes": sum(sum(r["downlink_envelope_bytes"]) for r in rows),
        "flower_downlink_bytes": sum(sum(r["flower_downlink_bytes"]) for r in rows),
        "final_test_accuracy": rows[-1].get("test_accuracy"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [
        "| round | client | coded bits | stream bytes | envelope bytes | Flower message bytes |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for i, c in enumerate(r["participants"]):
            lines.append(
                f"| {r['round']} | {c} | {r['uplink_bits'][i]} | {r['uplink_stream_bytes'][i]} | "
                f"{r['uplink_envelope_bytes'][i]} | {r['flower_uplink_bytes'][i]} |"
            )
    (out / "bytes.md").write_text("Uplink: each participant's message\n\n" + "\n".join(lines) + "\n")


def server_app_for_results():
    """The example app's ``ServerApp``: :func:`federation`, results written to ``run_config["out"]``."""
    from sidejax.flower.apps import server_app

    on_start, on_round = _results()
    return server_app(_build, on_start=on_start, on_round=on_round)


def fingerprint(run_config: dict) -> bytes:
    """The run's configuration fingerprint from its run configuration alone (the handshake's answer)."""
    from sidejax.flower import config_fingerprint

    return config_fingerprint(_config_from(run_config).to_dict())


def client_app_for_results():
    """The example app's ``ClientApp``."""
    from sidejax.flower.apps import client_app

    return client_app(_build, fingerprint=fingerprint)


def run_config_for(args) -> dict:
    """Flower's run configuration from the command line's choices."""
    bad = [kv for kv in args.set if "=" not in kv]
    if bad:
        raise ValueError(f"--set takes KEY=VALUE pairs (dotted keys, e.g. run.rounds=3), got {bad}")
    overrides = dict(kv.split("=", 1) for kv in args.set)
    parsed = {}
    for k, v in overrides.items():
        try:
            parsed[k] = json.loads(v)
        except json.JSONDecodeError:
            parsed[k] = v
    return {
        "preset": args.preset or "",
        "algorithm": args.algorithm or "",
        "overrides": json.dumps(parsed, sort_keys=True),
        "out": str(Path(args.out).resolve()),
        "min_replies": int(args.min_replies),
        "round_timeout": float(args.round_timeout),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toml_value(v) -> str:
    return json.dumps(v)


MARKER = "SIDEJAX_FLOWER_RUN"


def _marked_pids(token: str) -> list[int]:
    """The processes whose environment carries ``MARKER=token``: those this launcher started and everything
    they started in turn (Flower's SuperLink and SuperNodes spawn detached SuperExec and app processes,
    which leave their parents' process groups), and nothing else."""
    want = f"{MARKER}={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if want in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


def _stop(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@contextlib.contextmanager
def _processes(token: str):
    """Processes started here (each with ``MARKER=token`` in its environment); on exit every process that
    carries the marker is stopped: TERM, up to 10 s, then KILL."""
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        _stop(_marked_pids(token), signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        while _marked_pids(token) and time.monotonic() < deadline:
            time.sleep(0.2)
        _stop(_marked_pids(token), signal.SIGKILL)
        for p in started:
            p.wait()


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening on port {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def deploy(
    run_config: dict,
    num_supernodes: int,
    *,
    timeout: float = 1800.0,
    kill_after_round: tuple[int, int] | None = None,
    node_env: dict[str, str] | None = None,
    token: str | None = None,
) -> Path:
    """Runs the example app in Flower's deployment runtime on 127.0.0.1: one SuperLink (insecure: loopback
    only), ``num_supernodes`` SuperNodes (node configuration ``partition-id=c``), then ``flwr run``; waits
    for the results folder's ``summary.json`` (or a failure, or ``timeout`` seconds) and stops every process
    it started. ``kill_after_round=(r, c)`` kills client ``c``'s SuperNode once round ``r`` is logged (the
    fault test); ``node_env`` is added to the SuperNodes' environment (e.g. the fault tests'
    :data:`sidejax.flower.apps.FLIP_ENV`); ``token`` marks every process of the run (:func:`_marked_pids`).
    Returns the results folder."""
    out = Path(run_config["out"])
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} already holds files; choose an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir()
    home = Path(tempfile.mkdtemp(prefix="sidejax-flwr-home-"))
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local-deployment"\n\n[superlink.local-deployment]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    bindir = Path(sys.executable).parent
    # the run's marker: the caller's, one this launcher inherited (a supervisor marking its children), or new
    token = token or os.environ.get(MARKER) or f"{os.getpid()}-{time.time_ns()}"
    env = {
        **os.environ,
        MARKER: token,
        "FLWR_HOME": str(home),
        "PATH": os.pathsep.join([str(bindir), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }
    # Flower starts a process per message (a ClientApp, a ServerApp): they share one compilation cache, so a
    # kernel is compiled by the first process that runs it and read from disk by the later ones
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(home / "jax-cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    try:
        with _processes(token) as procs:

            def start(cmd, name, extra=None):
                log = open(logs / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
                p = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**env, **(extra or {})},
                    cwd=str(home),
                    start_new_session=True,
                )
                procs.append(p)
                return p

            link = start(
                [
                    str(bindir / "flower-superlink"),
                    "--insecure",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--database",
                    str(home / "state.db"),
                    "--disable-runtime-dependency-installation",
                ],
                "superlink",
            )
            _wait_port(port, link, 60, "flower-superlink")
            nodes = []
            for c in range(num_supernodes):
                nodes.append(
                    start(
                        [
                            str(bindir / "flower-supernode"),
                            "--insecure",
                            "--superlink",
                            f"127.0.0.1:{port}",
                            "--port",
                            str(_free_port()),
                            "--node-config",
                            f"partition-id={c} num-partitions={num_supernodes}",
                        ],
                        f"supernode_{c}",
                        node_env,
                    )
                )
            rc = home / "run_config.toml"
            rc.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in run_config.items()))
            run = start(
                [
                    str(bindir / "flwr"),
                    "run",
                    str(EXAMPLE_APP),
                    "local-deployment",
                    "--run-config",
                    str(rc),
                    "--stream",
                ],
                "flwr_run",
            )
            deadline = time.monotonic() + timeout
            summary = out / "summary.json"
            while not summary.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the Flower run did not finish in {timeout:.0f} s; logs in {logs}")
                if link.poll() is not None:
                    raise RuntimeError(f"the SuperLink exited (code {link.returncode}); logs in {logs}")
                if run.poll() not in (None, 0):
                    raise RuntimeError(f"flwr run exited with code {run.returncode}; logs in {logs}")
                if kill_after_round is not None:
                    r, c = kill_after_round
                    metrics = out / "metrics.jsonl"
                    if (
                        metrics.exists()
                        and len(metrics.read_text().splitlines()) >= r
                        and nodes[c].poll() is None
                    ):
                        os.killpg(nodes[c].pid, signal.SIGKILL)
                failed = _server_failure(logs / "flwr_run.log")
                if failed:
                    raise RuntimeError(f"the ServerApp failed: {failed}; logs in {logs}")
                time.sleep(0.5)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return out


def _server_failure(log: Path) -> str | None:
    if not log.exists():
        return None
    text = log.read_text(errors="replace")
    for marker in ("RoundFailedError", "EnvelopeError", "RuntimeError:", "ValueError:", "Traceback"):
        i = text.find(marker)
        if i >= 0:
            return text[i : i + 400].strip()
    return None


def simulate(run_config: dict, num_supernodes: int) -> Path:
    """The same apps in Flower's simulation runtime (Ray backend), in this process."""
    from flwr.simulation import run_simulation

    out = Path(run_config["out"])
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} already holds files; choose an empty or new folder")
    server, client = _apps_with_config(run_config)
    run_simulation(server, client, num_supernodes, backend_config={"client_resources": {"num_cpus": 1}})
    if not (out / "summary.json").exists():
        raise RuntimeError(f"the simulation ended without a summary in {out}: see Flower's log above")
    return out


def _apps_with_config(run_config: dict):
    """The apps with ``run_config`` built in (the simulation runtime passes none of its own)."""
    from sidejax.flower.apps import client_app, server_app

    def build(rc, node_config):
        return _build({**run_config, **{k: v for k, v in rc.items() if k in run_config}}, node_config)

    on_start, on_round = _results()
    server = server_app(build, on_start=lambda fed, rc: on_start(fed, run_config), on_round=on_round)
    return server, client_app(build, fingerprint=lambda rc: fingerprint(run_config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.flower", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("deploy", help="run an experiment over Flower on this machine")
    d.add_argument("out", help="results folder (new or empty)")
    g = d.add_mutually_exclusive_group(required=True)
    g.add_argument("--preset", help="an experiments/presets name")
    g.add_argument("--algorithm", help="an algorithm shortcut (fedavg, fedpm_klms, ...) from its defaults")
    d.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="dotted overrides")
    d.add_argument("--runtime", choices=RUNTIMES, default="deployment")
    d.add_argument("--supernodes", type=int, default=None, help="default: data.num_clients")
    d.add_argument("--min-replies", type=int, default=1)
    d.add_argument("--round-timeout", type=float, default=600.0)
    d.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    try:
        rc = run_config_for(args)
        config = _config_from(rc)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = args.supernodes or config.data.num_clients
    if n != config.data.num_clients:
        print(
            f"error: --supernodes {n} but data.num_clients = {config.data.num_clients}: one SuperNode per "
            "client",
            file=sys.stderr,
        )
        return 2

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    # `kill` (SIGTERM) stops the run as Ctrl-C does: the processes it started are stopped before it exits
    signal.signal(signal.SIGTERM, interrupted)
    try:
        if args.runtime == "deployment":
            out = deploy(rc, n, timeout=args.timeout)
        else:
            out = simulate(rc, n)
    except KeyboardInterrupt:
        print("interrupted: every process started was stopped", file=sys.stderr)
        return 130
    except (FileExistsError, RuntimeError, TimeoutError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"results in {out}: {json.loads((out / 'summary.json').read_text())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
