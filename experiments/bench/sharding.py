"""Benchmark: one round with the participants split over 1, 2, 4, 8 devices (``sidejax.fl.mesh_client_map``),
at equal total work, against the single-device round of the same program family, measured in one run.

Each device count runs in its own subprocess (the forced CPU device count, ``XLA_FLAGS=
--xla_force_host_platform_device_count=N``, must be set before JAX starts); the subprocesses are started in
turn, ``--repeats`` times over the list of counts (interleaved, so a change of load falls on every count).
Each one builds LeNet5 on random images of Fashion-MNIST's shape (no files needed), ``--participants`` of
``--clients`` clients of ``--examples`` examples each, and for each method (FedAvg, FedPM-KLMS) reports:

- ``compile_s``: lowering and compiling ``run_rounds`` for ``--rounds`` rounds;
- ``round_s``: the best of ``--calls`` timed calls, per round, wall and process CPU time;
- ``per_device_bytes``: XLA's memory analysis of the compiled round (arguments + outputs + temporaries, per
  device);
- ``resident_bytes_per_device``: the bytes of the federation's examples and the run's state that the first
  device holds once placed (:func:`sidejax.fl.place_federation`: the examples split in row ranges, the
  client state split when the devices divide ``--clients``; the server state replicated).

On a 2-core CPU the forced devices share the same two cores, so the ratios measure the overhead of the
sharded program (padding, ``shard_map``, gathering the messages), not a speed-up. Writes JSON (default
``results/bench/sharding.json``) with the ratios to the single-device round, the threads and cores used,
the load average and CPU time.

Run: ``python -m experiments.bench.sharding [--devices 1,2,4,8] [--repeats 2] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from experiments.bench.common import (
    Sized,
    child_json,
    interleave,
    load_average,
    machine_record,
    parser,
    write_json,
)

METHODS = ("fedavg", "fedpm_klms")


def _problem(args):
    """The federation (random images of Fashion-MNIST's shape), LeNet5's keys and parameters, and a builder
    per method."""
    import numpy as np
    import optax

    from sidejax.algorithms import fedavg, fedpm
    from sidejax.coding import KLMSConfig, klms_coder
    from sidejax.data import make_federated_data
    from sidejax.fl import LocalTraining, classification_loss
    from sidejax.keys import run_keys
    from sidejax.models import get_model, init_params

    rng = np.random.default_rng(0)
    total = args.clients * args.examples
    x = rng.uniform(0, 1, (total, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, total).astype(np.int32)
    fed = make_federated_data(x, y, np.arange(total).reshape(args.clients, args.examples))
    spec = get_model("lenet5", num_classes=10, input_shape=(28, 28, 1))
    init_key, rounds_key = run_keys(0)
    params = init_params(init_key, spec)
    loss = classification_loss(spec.module.apply)
    local = LocalTraining(optax.sgd(0.05), batch_size=32, num_epochs=1)
    builders = {
        "fedavg": lambda: fedavg(loss, local, clients_per_round=args.participants),
        "fedpm_klms": lambda: fedpm(
            loss,
            LocalTraining(optax.adam(0.1), batch_size=32, num_epochs=1),
            clients_per_round=args.participants,
            coder=klms_coder(KLMSConfig(log2_num_candidates=6, max_block_size=64)),
        ),
    }
    return fed, init_key, rounds_key, params, builders


def _resident(tree, device) -> int:
    """Bytes of ``tree``'s shards held by ``device``."""
    import jax

    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in getattr(leaf, "addressable_shards", [])
        if shard.device == device
    )


def _child(args) -> dict:
    import jax
    import numpy as np

    from sidejax.fl import ClientMap, mesh_client_map, place_federation, run_rounds

    n = args.child
    fed, init_key, rounds_key, params, builders = _problem(args)
    cmap = ClientMap("map") if n == 1 else mesh_client_map(n, strategy="map")
    out = {"devices": n, "jax_devices": len(jax.devices()), "methods": {}}
    first = jax.devices()[0]
    for name in args.methods:
        algo = builders[name]()
        state, data = place_federation(
            cmap, algo.init(init_key, params, args.clients), jax.device_put(fed, first)
        )
        t0 = time.perf_counter()
        lowered = jax.jit(
            lambda s, d, a=algo: run_rounds(a, rounds_key, s, d, args.rounds, client_map=cmap)
        ).lower(state, data)
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        per_device = None
        if mem is not None:
            per_device = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
        jax.block_until_ready(compiled(state, data))  # warm-up
        times = interleave({"round": lambda c=compiled, s=state, d=data: c(s, d)}, args.calls)[0]["round"]
        walls, cpus = [w / args.rounds for w, _ in times], [c / args.rounds for _, c in times]
        best = int(np.argmin(walls))
        out["methods"][name] = {
            "compile_s": compile_s,
            "round_s": walls[best],
            "round_cpu_s": cpus[best],
            "per_device_bytes": per_device,
            "resident_bytes_per_device": _resident((state, data), first),
        }
    return out


#: the command line: flag -> (type, default, help)
FLAGS = {
    "--devices": (str, "1,2,4,8", None),
    "--methods": (str, ",".join(METHODS), None),
    "--clients": (int, Sized(32, 8), None),
    "--participants": (int, Sized(16, 4), None),
    "--examples": (int, Sized(64, 16), "examples per client"),
    "--rounds": (int, 1, "rounds per timed call"),
    "--calls": (int, Sized(3, 1), "timed calls per subprocess (best is kept)"),
    "--repeats": (int, Sized(2, 1), "passes over the device counts (interleaved)"),
    "--quick": (bool, False, "tiny sizes, for tests"),
    "--out": (Path, Path("results/bench/sharding.json"), None),
    "--child": (int, None, argparse.SUPPRESS),
}


def _parse_args(argv):
    p = parser("experiments.bench.sharding", __doc__, FLAGS)
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    counts = None
    if args.child is None:
        counts = [int(c) for c in args.devices.split(",") if c]
        if not counts or min(counts) < 1 or max(counts) > args.participants:
            p.error(f"--devices must be between 1 and --participants={args.participants}, got {args.devices}")
    return args, counts


def _run_child(args, n: int) -> dict:
    """One ``n``-device subprocess's measurements (its ``CHILD`` line)."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
    cmd = [sys.executable, "-m", "experiments.bench.sharding", "--child", str(n)]
    forwarded = ["--methods", ",".join(args.methods), "--clients", str(args.clients)]
    forwarded += ["--participants", str(args.participants), "--examples", str(args.examples)]
    forwarded += ["--rounds", str(args.rounds), "--calls", str(args.calls)]
    try:
        return child_json(cmd + forwarded, tag="CHILD ", env=env, timeout=1800)
    except RuntimeError as e:
        raise RuntimeError(f"the {n}-device run failed:\n{e}") from None


def _aggregate(runs: dict, counts, methods) -> tuple[dict, dict]:
    """``(results, ratios)``: per count and method the best round times over the repeats, the median compile
    time and the bytes, and their ratios to the first count."""
    results = {}
    for n in counts:
        results[str(n)] = {}
        for m in methods:
            rows = [r["methods"][m] for r in runs[n]]
            results[str(n)][m] = {
                "round_s": min(r["round_s"] for r in rows),
                "round_cpu_s": min(r["round_cpu_s"] for r in rows),
                "compile_s": statistics.median(r["compile_s"] for r in rows),
                "per_device_bytes": rows[0]["per_device_bytes"],
                "resident_bytes_per_device": rows[0]["resident_bytes_per_device"],
            }
    base = str(counts[0])
    ratios = {
        str(n): {
            m: {
                "round_time": results[str(n)][m]["round_s"] / results[base][m]["round_s"],
                "compile_time": results[str(n)][m]["compile_s"] / results[base][m]["compile_s"],
                "resident_bytes": results[str(n)][m]["resident_bytes_per_device"]
                / results[base][m]["resident_bytes_per_device"],
            }
            for m in methods
        }
        for n in counts
    }
    return results, ratios


def main(argv: list[str] | None = None) -> dict:
    args, counts = _parse_args(argv)
    if args.child is not None:
        print("CHILD " + json.dumps(_child(args)), flush=True)
        return {}
    load_before = load_average()
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    for _ in range(args.repeats):
        for n in counts:
            runs[n].append(_run_child(args, n))
            print(
                f"devices {n}: "
                + ", ".join(
                    f"{m} {r['round_s'] * 1e3:.0f} ms/round" for m, r in runs[n][-1]["methods"].items()
                ),
                flush=True,
            )
    results, ratios = _aggregate(runs, counts, args.methods)
    report = {
        "benchmark": "sharding",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "child")},
        "machine": {
            **machine_record(load_before=load_before),
            "note": "every device count runs in its own process on the same cores (cpu_affinity), with XLA's "
            "default threads and XLA_FLAGS=--xla_force_host_platform_device_count=N",
        },
        "results": results,
        "ratio_to_first_count": ratios,
    }
    write_json(report, args.out, trailing_newline=False)
    for n in counts:
        parts = []
        for m in args.methods:
            r = ratios[str(n)][m]
            parts.append(
                f"{m} x{r['round_time']:.2f} round, x{r['compile_time']:.2f} compile, "
                f"x{r['resident_bytes']:.2f} resident bytes per device"
            )
        print(f"{n} device(s): " + ", ".join(parts))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
