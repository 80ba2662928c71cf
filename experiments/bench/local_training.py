"""Benchmark: client-epochs per second of LeNet5 local training, ``vmap`` vs sequential ``map`` strategy, and
sidejax's loop-friendly convolution (:mod:`sidejax.models.conv`) vs plain ``lax.conv_general_dilated``.

Setting (issue #2): Fashion-MNIST (real files; falls back to random images of the same shape, flagged in
the JSON, if they are not installed), 10 iid clients of 6,000 examples, batch 32, SGD, 1 local epoch per
round, FedAvg rounds through :func:`sidejax.fl.run_rounds`. Each strategy is compiled and warmed up once,
then timed over ``--repeats`` calls of ``--rounds`` rounds; a client-epoch is one client's pass over its
data. Every strategy runs with each of ``--convs``: the models' convolution (``sidejax``, whose kernel and
input gradients stay on XLA CPU's fast path inside the local-training scan, and whose small stride-1
convolutions are banded matrix products), ``no_banded`` (the same without banded products), ``kernel_only``
(the convolution before issue 12: canonical kernel gradient, JAX's ``b01f_01oi`` input gradient; traced inside
:func:`sidejax.models.conv.lax_input_gradient`) and plain ``lax`` (the baseline, traced inside
:func:`sidejax.models.conv.plain_lax_convolution`). Writes JSON (default
``results/bench/local_training.json``) with the throughput of each (strategy, convolution), the
``map / vmap`` ratio and the ``sidejax / lax`` and ``sidejax / kernel_only`` speed-ups measured in the same
run. ``experiments.bench.torch_compare`` compares one client's local training with PyTorch.

Run: ``python -m experiments.bench.local_training [--clients 10] [--rounds 1] [--repeats 2]
[--convs sidejax,kernel_only,lax]``.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import optax

from experiments.bench.common import (
    CONVS,
    clock,
    conv_context,
    fashion_mnist,
    load_average,
    machine_record,
    parser,
    timing,
    write_report,
)
from sidejax.algorithms import fedavg
from sidejax.data import iid_partition, make_federated_data
from sidejax.fl import LocalTraining, classification_loss, run_rounds
from sidejax.keys import run_keys
from sidejax.models import get_model, init_params

#: the command line: flag -> (type, default, help)
FLAGS = {
    "--clients": (int, 10, None),
    "--examples-per-client": (int, 6000, None),
    "--batch-size": (int, 32, None),
    "--rounds": (int, 1, "rounds per timed call"),
    "--repeats": (int, 2, None),
    "--strategies": (str, "vmap,map", None),
    "--convs": (
        str,
        "sidejax,lax",
        "convolutions to time: sidejax, no_banded, kernel_only, lax",
    ),
    "--output": (Path, Path("results/bench/local_training.json"), None),
}


def _parse_args(argv):
    p = parser("experiments.bench.local_training", __doc__, FLAGS)
    args = p.parse_args(argv)
    bad = sorted(set(args.convs.split(",")) - set(CONVS))
    if bad:
        p.error(f"--convs takes sidejax, kernel_only and/or lax, got {','.join(bad)}")
    return args


def _federated_data(args):
    """``(fed, real)``: the clients' Fashion-MNIST (or same-shape random images when it is not installed)."""
    x, y, real = fashion_mnist(args.clients * args.examples_per_client)
    return make_federated_data(x, y, iid_partition(len(y), args.clients, seed=0)), real


def _time_strategy(args, strategy, conv, fed, loss, init_key, rounds_key, params) -> dict:
    """Compiles and warms up ``--rounds`` FedAvg rounds with ``strategy`` and convolution ``conv``, then
    times ``--repeats`` calls."""
    local = LocalTraining(optax.sgd(0.05, momentum=0.9), batch_size=args.batch_size, num_epochs=1)
    algo = fedavg(loss, local, clients_per_round=args.clients)
    state = algo.init(init_key, params, args.clients)
    trace_ctx = conv_context(conv)
    t0 = time.perf_counter()
    with trace_ctx:  # tracing and compilation happen in this first call
        warm, _ = run_rounds(algo, rounds_key, state, fed, args.rounds, client_map=strategy)
        jax.block_until_ready(warm)
    compile_and_first = time.perf_counter() - t0
    call = lambda: run_rounds(algo, rounds_key, state, fed, args.rounds, client_map=strategy)[0]
    times = [clock(call)[1:] for _ in range(args.repeats)]  # (wall, CPU) seconds
    best = min(w for w, _ in times)
    return {
        "strategy": strategy,
        "conv": conv,
        "client_epochs_per_s": args.clients * args.rounds / best,
        "examples_per_s": args.clients * args.rounds * args.examples_per_client / best,
        "seconds_per_round_best": best / args.rounds,
        "seconds_per_round_all": [w / args.rounds for w, _ in times],
        "timing": timing(times),
        "first_call_s_incl_compile": compile_and_first,
    }


def _add_speedups(report: dict, results: dict, args) -> None:
    """Adds (and prints) the ``map / vmap`` and ``sidejax / <baseline> conv`` throughput ratios."""
    rate = {k: v["client_epochs_per_s"] for k, v in results.items()}
    for conv in args.convs.split(","):
        if f"vmap/{conv}" in rate and f"map/{conv}" in rate:
            report[f"map_over_vmap_speedup_{conv}"] = rate[f"map/{conv}"] / rate[f"vmap/{conv}"]
            print(f"map / vmap throughput ratio ({conv} conv): {report[f'map_over_vmap_speedup_{conv}']:.2f}")
    for strategy in args.strategies.split(","):
        for base in ("lax", "kernel_only", "no_banded"):
            if f"{strategy}/sidejax" in rate and f"{strategy}/{base}" in rate:
                ratio = rate[f"{strategy}/sidejax"] / rate[f"{strategy}/{base}"]
                report[f"sidejax_over_{base}_conv_speedup_{strategy}"] = ratio
                print(f"sidejax / {base} conv throughput ({strategy}): {ratio:.2f}")


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    load_before = load_average()
    fed, real = _federated_data(args)
    spec = get_model("lenet5")
    init_key, rounds_key = run_keys(0)
    params = init_params(init_key, spec)
    loss = classification_loss(spec.module.apply)

    results = {}
    for strategy in args.strategies.split(","):
        for conv in args.convs.split(","):
            name = f"{strategy}/{conv}"
            results[name] = _time_strategy(args, strategy, conv, fed, loss, init_key, rounds_key, params)
            print(
                f"{name:>12}: {results[name]['client_epochs_per_s']:.3f} client-epochs/s "
                f"({results[name]['seconds_per_round_best']:.2f} s/round)",
                flush=True,
            )
    report = {
        "benchmark": "lenet5_local_training",
        "data": "fashion_mnist" if real else "random (fashion_mnist not installed)",
        "clients": args.clients,
        "examples_per_client": args.examples_per_client,
        "batch_size": args.batch_size,
        "rounds_per_call": args.rounds,
        "repeats": args.repeats,
        "machine": machine_record(load_before=load_before),
        "results": results,
    }
    _add_speedups(report, results, args)
    write_report(report, args.output, trailing_newline=False)
    return report


if __name__ == "__main__":
    main()
