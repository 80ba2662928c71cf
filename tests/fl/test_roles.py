"""The round engine's parties apart (sidejax.fl.roles, driven by sidejax.flower's parties over the in-process
loopback transport): every round's uplink messages are the engine's bit for bit, the server and client states
agree within a few ULP, for 3 rounds with a non-participant each round (4 clients, 3 per round, where the
algorithm allows it). The six methods the deployment tests run are checked here; the whole family is slow."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from roles_family import CLIENTS_PER_ROUND, NUM_CLIENTS, compare, federation, model  # noqa: E402

# FedAvg, FedPM-KLMS and QSGD-KLMS (KLMS protocol state), BICompFL-GR (a relayed, compressed downlink),
# CEPAM (a lattice stream), BPC-FL (one shot, a pseudocoreset upload)
DEPLOYED = ("fedavg", "fedpm_klms", "qsgd_klms", "bicompfl_gr", "cepam", "bpcfl")


@pytest.fixture(scope="module")
def family():
    from helpers import every_algorithm

    spec, params, loss = model()
    algorithms = every_algorithm(loss, spec, num_clients=NUM_CLIENTS, clients_per_round=CLIENTS_PER_ROUND)
    return algorithms, params, federation()


def _check(family, name):
    algorithms, params, fed = family
    reports = compare(algorithms[name], params, fed)
    assert len(reports) == 3
    # the listener's rounds: a partial-participation method leaves one client out of each round
    if algorithms[name].clients_per_round < NUM_CLIENTS:
        assert all(len(r.info.client_ids) == CLIENTS_PER_ROUND for r in reports)


# `make test` runs the three whose views follow protocol state (a KLMS partition, QSGD-KLMS's prior, GR's
# relay), about 20 s each; the others are slow. BPC-FL's upload is float32 pseudocoreset values: bit for bit
# across the two programs at XLA's default optimisation level (`make test-all`), but at the -O0 of
# `make test` a value differs by a few ULP.
FAST = ("fedpm_klms", "qsgd_klms", "bicompfl_gr")


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in DEPLOYED]
)
def test_parties_send_the_engines_messages(family, name):
    _check(family, name)


def _others():
    from helpers import every_algorithm

    spec, _, loss = model()
    return sorted(set(every_algorithm(loss, spec, num_clients=NUM_CLIENTS)) - set(DEPLOYED))


@pytest.mark.breadth  # every other algorithm of the family: 10-40 s each at -O0 on a CPU core
@pytest.mark.parametrize("name", _others())
def test_every_algorithm_sends_the_engines_messages_apart(family, name):
    _check(family, name)
