"""Every algorithm on one device and on a mesh of forced CPU devices: the same participants, the same bits,
each client's message bit for bit, the server state within a few ULP.

Run by ``tests/fl/test_sharding.py`` in a subprocess (the device count must be set before JAX starts)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/fl/sharded_family.py --devices 8 fedavg

It prints one JSON line per algorithm (``{"name": ..., "ok": true}`` or the first mismatch) and exits 1 if
any algorithm differs.

Several processes (``tests/test_multiprocess.py``): each runs this script with ``--processes P --process-id
I --coordinator 127.0.0.1:PORT`` and its own forced devices; the mesh spans every process's devices, and
each process compares with the single-device run it computes on its own first device.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout (sidejax)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sidejax.data import load_dataset, make_federated_data, partition  # noqa: E402
from sidejax.fl import (  # noqa: E402
    ClientMap,
    build_round_step,
    classification_loss,
    gather_to_host,
    mesh_client_map,
    place_federation,
    run_rounds,
)
from sidejax.keys import round_key, run_keys  # noqa: E402
from sidejax.models import get_model, init_params  # noqa: E402

NUM_CLIENTS = 16  # 8 devices divide it: each holds the client state of 2 clients (place_federation)
CLIENTS_PER_ROUND = 10  # partial participation, not divisible by 8 devices (padded)
ROUNDS = 2
SERVER_ULPS = 8


def federation(num_clients: int):
    train = load_dataset("digits", "train")
    keep = np.random.default_rng(0).permutation(len(train.y))[:600]
    x, y = train.x[keep], train.y[keep]
    return make_federated_data(x, y, partition("iid", y, num_clients, seed=0))


def compare(
    algo, params, fed, sharded: ClientMap, strategy: str, num_clients: int, rounds: int = ROUNDS
) -> None:
    """Round by round from the same state (the single-device run's): the same participants and messages bit
    for bit (``client_phase``); then one round of :func:`run_rounds` on each map, the sharded one from
    placed inputs (:func:`place_federation`): the same participants, bits and stream errors, the server and
    client states within ``SERVER_ULPS``.

    Each round starts from the same state on purpose: a run of several rounds carries round 1's ULP
    differences into round 2's local training, where a ReLU that flips or an Adam denominator near zero
    can turn them into differences of a percent (pFedBayes' personal Adam moments, 2 rounds on 4 devices),
    which no tolerance separates from a wrong aggregate."""
    from helpers import assert_trees_close_across_programs, tree_equal

    single = ClientMap(strategy)
    init_key, rounds_key = run_keys(0)
    state = algo.init(init_key, params, num_clients)
    phases = {m: jax.jit(build_round_step(algo, client_map=m).client_phase) for m in (single, sharded)}
    for t in range(rounds):
        rkey = round_key(rounds_key, t)
        placed_state, placed_fed = place_federation(sharded, state, fed)
        assert_trees_close_across_programs(gather_to_host(placed_state), state, 0)
        one = phases[single](rkey, state, fed)
        many = gather_to_host(phases[sharded](rkey, placed_state, placed_fed))
        np.testing.assert_array_equal(np.asarray(one.client_ids), np.asarray(many.client_ids))
        assert tree_equal(one.messages, many.messages), f"round {t}: an uplink message differs"
        assert tree_equal(one.downlink, many.downlink), f"round {t}: the downlink differs"
        assert_trees_close_across_programs(many.client_states, one.client_states, SERVER_ULPS)
        next_one, info_one = run_rounds(algo, rounds_key, state, fed, 1, client_map=single)
        next_many, info_many = run_rounds(algo, rounds_key, placed_state, placed_fed, 1, client_map=sharded)
        for field in ("round_index", "client_ids", "uplink_bits", "downlink_bits", "uplink_errors"):
            np.testing.assert_array_equal(
                np.asarray(getattr(info_one, field)), np.asarray(getattr(info_many, field)), err_msg=field
            )
        next_many = gather_to_host(next_many)
        assert_trees_close_across_programs(next_many.server, next_one.server, SERVER_ULPS)
        assert_trees_close_across_programs(next_many.clients, next_one.clients, SERVER_ULPS)
        state = next_one


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", help="algorithms (default: every one)")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--strategy", default="map", choices=("map", "vmap"))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument(
        "--part", default="0/1", help="I/N: the I-th of N interleaved parts of the algorithms (0/1: all)"
    )
    parser.add_argument("--processes", type=int, default=1, help="processes of the run (jax.distributed)")
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", default=None, help="host:port of process 0 (with --processes > 1)")
    parser.add_argument(
        "--num-clients",
        type=int,
        default=NUM_CLIENTS,
        help="clients in the federation (a multiple of --devices splits the client state, else replicated)",
    )
    args = parser.parse_args(argv)
    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator,
            args.processes,
            args.process_id,
            initialization_timeout=120,
            heartbeat_timeout_seconds=20,
        )
    # (tests/helpers makes keys at import, which starts JAX's backend: after jax.distributed.initialize)
    from helpers import every_algorithm, report_each

    if len(jax.devices()) < args.devices:
        flags = os.environ.get("XLA_FLAGS")
        print(f"need {args.devices} devices, have {len(jax.devices())} (XLA_FLAGS={flags})")
        return 2
    spec = get_model("mlp_32_16", num_classes=10, input_shape=(8, 8, 1))
    params = init_params(jax.random.key(0), spec)
    loss = classification_loss(spec.module.apply)
    algorithms = every_algorithm(
        loss, spec, num_clients=args.num_clients, clients_per_round=CLIENTS_PER_ROUND
    )
    part, parts = (int(v) for v in args.part.split("/"))
    names = (args.names or sorted(algorithms))[part::parts]
    unknown = sorted(set(names) - set(algorithms))
    if unknown:
        print(f"unknown algorithms {unknown}; known: {sorted(algorithms)}")
        return 2
    fed = federation(args.num_clients)
    sharded = mesh_client_map(args.devices, strategy=args.strategy)
    return report_each(
        names,
        lambda name: compare(
            algorithms[name], params, fed, sharded, args.strategy, args.num_clients, args.rounds
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
