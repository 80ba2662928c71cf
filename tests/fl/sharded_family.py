"""Every algorithm on one device and on a mesh of forced CPU devices: the same participants, the same bits,
each client's message bit for bit, the server state within a few ULP.

Run by ``tests/fl/test_sharding.py`` in a subprocess (the device count must be set before JAX starts)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/fl/sharded_family.py --devices 8 fedavg

It prints one JSON line per algorithm (``{"name": ..., "ok": true}`` or the first mismatch) and exits 1 if
any algorithm differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout (sidejax)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from helpers import assert_trees_close_across_programs, every_algorithm, tree_equal  # noqa: E402

from sidejax.data import load_dataset, make_federated_data, partition  # noqa: E402
from sidejax.fl import ClientMap, build_round_step, classification_loss, mesh_client_map, run_rounds  # noqa: E402
from sidejax.keys import round_key, run_keys  # noqa: E402
from sidejax.models import get_model, init_params  # noqa: E402

NUM_CLIENTS = 12
CLIENTS_PER_ROUND = 10  # partial participation, and neither 10 nor 12 divides by 8 devices
ROUNDS = 2
SERVER_ULPS = 8
# End to end, round 1's ULP differences feed round 2's local training: after 2 rounds pFedBayes' personal
# posteriors differ by up to 3.7e-5 of a leaf's largest magnitude (measured; the other algorithms less). A
# wrong aggregate (a client dropped or counted twice) is off by percents. The exact claims are per round.
DRIFT_RTOL = 1e-3


def federation():
    train = load_dataset("digits", "train")
    keep = np.random.default_rng(0).permutation(len(train.y))[:600]
    x, y = train.x[keep], train.y[keep]
    return make_federated_data(x, y, partition("iid", y, NUM_CLIENTS, seed=0))


def compare(algo, params, fed, sharded: ClientMap, strategy: str) -> None:
    """Each round from the same state: the same participants and messages bit for bit, the server state
    within ``SERVER_ULPS``; then ``ROUNDS`` rounds end to end: the same participants, bits and stream errors,
    the server state within ``DRIFT_RTOL`` (the ULPs of round 1 change round 2's local training)."""
    single = ClientMap(strategy)
    init_key, rounds_key = run_keys(0)
    state = algo.init(init_key, params, NUM_CLIENTS)
    steps = {m: build_round_step(algo, client_map=m) for m in (single, sharded)}
    phases = {m: jax.jit(step.client_phase) for m, step in steps.items()}
    rounds = {m: jax.jit(step) for m, step in steps.items()}
    start = state
    for t in range(ROUNDS):
        rkey = round_key(rounds_key, t)
        one, many = phases[single](rkey, state, fed), phases[sharded](rkey, state, fed)
        np.testing.assert_array_equal(np.asarray(one.client_ids), np.asarray(many.client_ids))
        assert tree_equal(one.messages, many.messages), f"round {t}: an uplink message differs"
        assert tree_equal(one.downlink, many.downlink), f"round {t}: the downlink differs"
        assert_trees_close_across_programs(many.client_states, one.client_states, SERVER_ULPS)
        (next_one, _), (next_many, _) = rounds[single](rkey, state, fed), rounds[sharded](rkey, state, fed)
        assert_trees_close_across_programs(next_many.server, next_one.server, SERVER_ULPS)
        state = next_one
    final_one, info_one = run_rounds(algo, rounds_key, start, fed, ROUNDS, client_map=single)
    final_many, info_many = run_rounds(algo, rounds_key, start, fed, ROUNDS, client_map=sharded)
    for field in ("client_ids", "uplink_bits", "downlink_bits", "uplink_errors"):
        np.testing.assert_array_equal(
            np.asarray(getattr(info_one, field)), np.asarray(getattr(info_many, field)), err_msg=field
        )
    for a, b in zip(jax.tree.leaves(final_many.server), jax.tree.leaves(final_one.server), strict=True):
        if jnp.issubdtype(a.dtype, jnp.floating):
            scale = float(np.max(np.abs(np.asarray(b)), initial=1e-30))
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=DRIFT_RTOL * scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", help="algorithms (default: every one)")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--strategy", default="map", choices=("map", "vmap"))
    args = parser.parse_args(argv)
    if len(jax.devices()) < args.devices:
        flags = os.environ.get("XLA_FLAGS")
        print(f"need {args.devices} devices, have {len(jax.devices())} (XLA_FLAGS={flags})")
        return 2
    spec = get_model("mlp_32_16", num_classes=10, input_shape=(8, 8, 1))
    params = init_params(jax.random.key(0), spec)
    loss = classification_loss(spec.module.apply)
    algorithms = every_algorithm(loss, spec, num_clients=NUM_CLIENTS, clients_per_round=CLIENTS_PER_ROUND)
    names = args.names or sorted(algorithms)
    unknown = sorted(set(names) - set(algorithms))
    if unknown:
        print(f"unknown algorithms {unknown}; known: {sorted(algorithms)}")
        return 2
    fed = federation()
    sharded = mesh_client_map(args.devices, strategy=args.strategy)
    failed = 0
    for name in names:
        try:
            compare(algorithms[name], params, fed, sharded, args.strategy)
            print(json.dumps({"name": name, "ok": True}), flush=True)
        except Exception as exc:  # report every algorithm, then fail
            failed += 1
            detail = "".join(traceback.format_exception_only(exc)).strip()[-2000:]
            print(json.dumps({"name": name, "ok": False, "error": detail}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
