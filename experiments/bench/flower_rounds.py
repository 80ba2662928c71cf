"""Benchmark: rounds per second of one run over Flower (a SuperLink and one SuperNode per client on
127.0.0.1) against the same work in process: the engine's ``run_rounds`` and the parties over the loopback
transport (:func:`sidejax.flower.loopback_round`: the same kernels as the Flower apps, bytes passed in
memory).

For each algorithm (default FedPM-KLMS and FedAvg, digits, 3 clients, ``--rounds`` rounds), in this order:

- ``engine``: one ``run_rounds`` call per round (a round is one jitted scan step), after a first call that
  compiles; best of ``--repeats``, interleaved with ``loopback``;
- ``loopback``: the parties' rounds, every kernel compiled beforehand by a first round;
- ``deployment``: ``experiments.flower.deploy`` (processes started, the handshake, ``--rounds`` rounds,
  everything stopped), its rounds' own seconds from the results folder (rounds after the first: the first
  compiles; Flower starts a ClientApp process per message, which reads the compiled kernels from the run's
  compilation cache);
- the bytes: per uplink, the coded bits, the stream's bytes (``ceil(bits / 8)``), the envelope's (+44) and
  Flower's serialised message (the envelope plus the participant's diagnostics and Flower's metadata).

Wall and process CPU time (this process's threads; the deployment's processes are not counted in it) and the
load average are recorded. Writes JSON (default ``results/bench/flower_rounds.json``).

Run: ``python -m experiments.bench.flower_rounds [--algorithms fedpm_klms fedavg] [--rounds 4]``.

Measurements: docs/deploying.md#measured.
"""

from __future__ import annotations

import json
import tempfile
from argparse import Namespace
from pathlib import Path

from experiments.bench.common import interleave, load_average, machine_record, parser, timing, write_report

FLAGS = {
    "--algorithms": (
        [str],
        ["fedpm_klms", "fedavg"],
        "algorithms (experiments.run shortcuts or method+coder)",
    ),
    "--rounds": (int, 4, "rounds of each run (>= 2: the first compiles)"),
    "--clients": (int, 3, "clients (one SuperNode each)"),
    "--repeats": (int, 3, "timed repetitions of the in-process cases"),
}


def _in_process(algorithm: str, args) -> dict:
    import jax

    from experiments.flower import federation, run_config_for
    from sidejax.fl import run_rounds
    from sidejax.fl.roles import initial_parties
    from sidejax.flower import ClientParty, ServerParty, loopback_round, own_partition

    rc = run_config_for(
        Namespace(
            preset=None,
            algorithm=algorithm,
            set=[f"data.num_clients={args.clients}", f"run.rounds={args.rounds}"],
            out="unused",
            min_replies=1,
            round_timeout=600.0,
        )
    )
    fed_obj, prepared, _ = federation(rc)
    algo, fed, n = fed_obj.algorithm, prepared.fed, fed_obj.num_clients
    state0 = algo.init(fed_obj.init_key, fed_obj.params, n)
    server, c0 = initial_parties(algo, fed_obj.init_key, fed_obj.params, n, 0)
    fp = fed_obj.fingerprint
    sp = ServerParty(algo, fed_obj.base_key, server, c0, own_partition(fed, 0), n, fingerprint=fp)
    clients = {}
    for c in range(n):
        view, cs = initial_parties(algo, fed_obj.init_key, fed_obj.params, n, c)
        clients[c] = ClientParty(
            algo, fed_obj.base_key, c, n, view, cs, own_partition(fed, c), fingerprint=fp
        )
    state = {"engine": run_rounds(algo, fed_obj.base_key, state0, fed, 1)[0]}
    loopback_round(sp, clients)  # compiles every party's kernels

    def engine():
        state["engine"], info = run_rounds(algo, fed_obj.base_key, state["engine"], fed, 1)
        return info.uplink_bits

    def loopback():
        return loopback_round(sp, clients).info.uplink_bits

    times, _ = interleave({"engine": engine, "loopback": loopback}, min(args.repeats, args.rounds - 1))
    return {name: timing(t) for name, t in times.items()}, rc, jax.default_backend()


def _deployment(rc: dict, clients: int) -> dict:
    from experiments.flower import deploy

    with tempfile.TemporaryDirectory(prefix="sidejax-bench-flower-") as tmp:
        out = deploy({**rc, "out": str(Path(tmp) / "run")}, clients, timeout=1800)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
    later = [r["seconds"] for r in rows[1:]]
    uplinks = [
        {
            "round": r["round"],
            "client": c,
            "bits": r["uplink_bits"][i],
            "stream_bytes": r["uplink_stream_bytes"][i],
            "envelope_bytes": r["uplink_envelope_bytes"][i],
            "info_bytes": r["uplink_info_bytes"][i],
            "flower_message_bytes": r["flower_uplink_bytes"][i],
        }
        for r in rows
        for i, c in enumerate(r["participants"])
    ]
    return {
        "round_seconds": [r["seconds"] for r in rows],
        "median_later_round_s": sorted(later)[len(later) // 2],
        "total_seconds": summary["seconds"],
        "uplinks": uplinks,
        "downlink_envelope_bytes": rows[0]["downlink_envelope_bytes"],
        "flower_downlink_bytes": rows[0]["flower_downlink_bytes"],
    }


def main(argv: list[str] | None = None) -> dict:
    p = parser("experiments.bench.flower_rounds", __doc__, FLAGS, out="results/bench/flower_rounds.json")
    args = p.parse_args(argv)
    if args.rounds < 2 or args.clients < 1 or args.repeats < 1:
        p.error("--rounds must be >= 2, --clients and --repeats >= 1")
    load_before = load_average()
    report = {"benchmark": "flower_rounds", "rounds": args.rounds, "clients": args.clients, "algorithms": {}}
    lines = [
        "| algorithm | engine round (s) | loopback round (s) | deployment round (s) | loopback / engine |"
    ]
    for algorithm in args.algorithms:
        cases, rc, backend = _in_process(algorithm, args)
        deployed = _deployment(rc, args.clients)
        e, lb = cases["engine"]["median_wall_s"], cases["loopback"]["median_wall_s"]
        d = deployed["median_later_round_s"]
        report["algorithms"][algorithm] = {**cases, "deployment": deployed}
        lines.append(f"| {algorithm} | {e:.3f} | {lb:.3f} | {d:.2f} | {lb / e:.2f} |")
    report["machine"] = machine_record(load_before=load_before)
    write_report(report, args.out, table="\n".join(lines))
    return report


if __name__ == "__main__":
    main()
