"""Every algorithm run by its parties apart (sidejax.flower's ServerParty / ClientParty over the in-process
loopback transport, envelopes as bytes) against the engine's run_rounds: the same participants, each
uplink message bit for bit, the server state within a few ULP, every round.

Used by ``tests/fl/test_roles.py``; also a script (``python tests/fl/roles_family.py [names]``) that prints
one JSON line per algorithm.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sidejax.coding.wire import message_to_bytes  # noqa: E402
from sidejax.data import load_dataset, make_federated_data, partition  # noqa: E402
from sidejax.fl import build_round_step, classification_loss  # noqa: E402
from sidejax.fl.roles import initial_parties  # noqa: E402
from sidejax.flower import ClientParty, ServerParty, config_fingerprint, loopback_round, own_partition  # noqa: E402
from sidejax.keys import round_key, run_keys  # noqa: E402
from sidejax.models import get_model, init_params  # noqa: E402

NUM_CLIENTS = 4
CLIENTS_PER_ROUND = 3  # partial participation: a listener each round
ROUNDS = 3
SERVER_ULPS = 8


def federation(num_clients: int = NUM_CLIENTS, examples: int = 240):
    train = load_dataset("digits", "train")
    keep = np.random.default_rng(0).permutation(len(train.y))[:examples]
    x, y = train.x[keep], train.y[keep]
    return make_federated_data(x, y, partition("iid", y, num_clients, seed=0))


def model():
    spec = get_model("mlp_32_16", num_classes=10, input_shape=(8, 8, 1))
    return spec, init_params(jax.random.key(0), spec), classification_loss(spec.module.apply)


def parties(algo, params, fed, num_clients, seed=0, config=None):
    """The server and every client, each built from what it alone would have."""
    init_key, base_key = run_keys(seed)
    fp = config_fingerprint(config or {"seed": seed})
    server, client0 = initial_parties(algo, init_key, params, num_clients, 0)
    server_party = ServerParty(
        algo, base_key, server, client0, own_partition(fed, 0), num_clients, fingerprint=fp
    )
    clients = {}
    for c in range(num_clients):
        view, cstate = initial_parties(algo, init_key, params, num_clients, c)
        clients[c] = ClientParty(
            algo, base_key, c, num_clients, view, cstate, own_partition(fed, c), fingerprint=fp
        )
    return server_party, clients


def compare(algo, params, fed, num_clients=NUM_CLIENTS, rounds=ROUNDS, seed=0):
    """Round by round: the engine's round (``client_phase`` for its messages, then the round) against the
    parties' loopback round; returns the per-round byte records."""
    from helpers import assert_trees_close_across_programs, tree_equal

    init_key, base_key = run_keys(seed)
    state = algo.init(init_key, params, num_clients)
    step = build_round_step(algo)
    phase_fn, round_fn = jax.jit(step.client_phase), jax.jit(step)
    server, clients = parties(algo, params, fed, num_clients, seed)
    records = []
    for t in range(rounds):
        rkey = round_key(base_key, t)
        phase = phase_fn(rkey, state, fed)
        state, info = round_fn(rkey, state, fed)
        report = loopback_round(server, clients)
        np.testing.assert_array_equal(np.asarray(report.info.client_ids), np.asarray(info.client_ids))
        for j, c in enumerate(np.asarray(info.client_ids)):
            sent = bool(info.clients.valid[j]) and bool(np.asarray(info.clients.finite)[j])
            engine = jax.tree.map(lambda a, j=j: a[j], phase.messages)
            if sent:
                mine = jax.tree.map(lambda a, j=j: a[j], report.messages)
                assert tree_equal(mine, engine), f"round {t}: client {int(c)}'s uplink message differs"
                want = len(message_to_bytes(engine)) + 36
                assert report.uplink_bytes[j] == want, (t, int(c), report.uplink_bytes[j], want)
        for field in ("uplink_bits", "downlink_bits", "uplink_errors", "included"):
            np.testing.assert_array_equal(
                np.asarray(getattr(report.info, field)),
                np.asarray(getattr(info, field)),
                err_msg=f"round {t}: {field}",
            )
        assert_trees_close_across_programs(server.server, state.server, SERVER_ULPS)
        for c, party in clients.items():
            row = jax.tree.map(lambda a, c=c: a[c], state.clients)
            assert_trees_close_across_programs(party.client_state, row, SERVER_ULPS)
        records.append(report)
    return records


def main(argv=None) -> int:
    from helpers import every_algorithm, report_each

    names = argv if argv is not None else sys.argv[1:]
    spec, params, loss = model()
    algorithms = every_algorithm(loss, spec, num_clients=NUM_CLIENTS, clients_per_round=CLIENTS_PER_ROUND)
    fed = federation()
    return report_each(names or sorted(algorithms), lambda name: compare(algorithms[name], params, fed))


if __name__ == "__main__":
    sys.exit(main())
