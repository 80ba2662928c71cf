"""What a client knows is wrong reaches the server, and every algorithm excludes it (issue 28).

A client whose data is NaN reports ``ClientInfo.valid``/``finite`` False; the engine withholds its stream
(:func:`sidejax.coding.withhold`: length -1, which no decoder accepts), and every ``server_update`` takes
its aggregates over the included participants alone (:func:`sidejax.coding.included`), renormalised. So,
for every algorithm family, a round in which one participant is poisoned gives the server state of the
same round with that participant removed (its message, key and weight dropped, the others' weights
renormalised), ``RoundInfo.included`` says who counted, and a round with every participant poisoned
leaves the server where it was.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import every_algorithm, tree_equal
from jax.flatten_util import ravel_pytree

from sidejax.algorithms import cepam
from sidejax.coding import Message, included, withhold
from sidejax.coding.lattice import lrsuq_coder
from sidejax.coding.lrsuq import GaussianNoise
from sidejax.data import load_dataset, make_federated_data, partition
from sidejax.distributions import PointMass
from sidejax.fl import build_round_step, classification_loss
from sidejax.keys import ClientKeys, round_key, run_keys
from sidejax.lattices import integer_lattice
from sidejax.models import get_model, init_params

NUM_CLIENTS = 3
BAD = 1  # the poisoned participant (full participation: participant i is client i)


@functools.lru_cache(maxsize=1)
def _setup():
    spec = get_model("mlp_32_16", num_classes=10, input_shape=(8, 8, 1))
    params = init_params(jax.random.key(0), spec)
    loss = classification_loss(spec.module.apply)
    algorithms = every_algorithm(loss, spec, num_clients=NUM_CLIENTS, clients_per_round=NUM_CLIENTS)
    train = load_dataset("digits", "train")
    keep = np.random.default_rng(0).permutation(len(train.y))[:150]
    fed = make_federated_data(
        train.x[keep], train.y[keep], partition("iid", train.y[keep], NUM_CLIENTS, seed=0)
    )
    return params, loss, algorithms, fed


def _poison(fed, clients):
    """``fed`` with every example of ``clients`` replaced by NaN (their losses and updates become NaN)."""
    x = np.array(fed.x, np.float32)
    for c in clients:
        rows = np.asarray(fed.client_indices)[c, : int(fed.num_examples[c])]
        x[rows] = np.nan
    return fed._replace(x=jnp.asarray(x))


def _compared(name: str, server):
    """The part of a server state that the removed-participant round must reproduce: everything, except the
    records whose shape follows the participants (BICompFL-GR's relay of the round's streams, BPC-FL's
    concatenated pseudocoreset, both checked on their own below)."""
    if name == "bicompfl_gr":
        return (server.theta, server.coder)
    if name in ONE_SHOT:
        return server.params
    return server


def _round(algo, state, fed, rkey):
    step = jax.jit(build_round_step(algo, client_map="map"))
    return step(rkey, state, fed)


def _removed(algo, state, fed, rkey, drop, *, withheld: bool = False):
    """The server's step on the clean round's messages with participants ``drop`` removed (their messages,
    keys and weights dropped), or, with ``withheld``, kept in place but withheld (for BPC-FL, whose server
    state is shaped by the federation)."""
    phase = jax.jit(build_round_step(algo, client_map="map").client_phase)(rkey, state, fed)
    keep = np.setdiff1d(np.arange(NUM_CLIENTS), drop)
    if withheld:
        keep = np.arange(NUM_CLIENTS)
        phase = phase._replace(messages=withhold(phase.messages, ~np.isin(keep, drop)))
    sub = lambda tree: jax.tree.map(lambda a: a[keep], tree)  # noqa: E731
    server, _, errors = jax.jit(algo.server_update)(
        rkey,
        phase.sent_server,
        phase.client_ids[keep],
        phase.keys.shared[keep],
        sub(phase.messages),
        phase.counts[keep].astype(jnp.float32),
    )
    return server, np.asarray(errors), phase


#: the one-shot methods, whose server state is shaped by the federation (checked with the client withheld)
ONE_SHOT = ("bpcfl", "dosfl")
# fedavg runs in make test (a few seconds: the engine, the weighted mean); every other family compiles a
# round of its own (15-95 s cold each on 2 CPU cores): the breadth sweep of make test-all. FedPA is among
# them: its burn-in round equals FedAvg's bit for bit with XLA's default emitters, not with make test's.
FAST = ("fedavg",)
FAMILIES = [
    "fedavg",
    "fedpa",
    "fedpm",
    "fedpm_klms",
    "qsgd",
    "qsgd_klms",
    "signsgd",
    "qlsd",
    "sgld_klms",
    "memsgd",
    "cser",
    "doublesqueeze",
    "neolithic",
    "bicompfl_gr",
    "bicompfl_gr_reconst",
    "bicompfl_pr_splitdl",
    "cepam",
    "pfedbayes",
    "coreset_pfedbayes",
    "pfedme",
    "perfedavg",
    "bpcfl",
    "dosfl",
]


def _start(name: str):
    """``(algorithm, initial state, federation, rounds key)`` of family ``name`` (run seed 0)."""
    params, _, algorithms, fed = _setup()
    algo = algorithms[name]
    init_key, rounds_key = run_keys(0)
    return algo, algo.init(init_key, params, NUM_CLIENTS), fed, rounds_key


FAMILY_PARAMS = [name if name in FAST else pytest.param(name, marks=pytest.mark.breadth) for name in FAMILIES]


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_a_poisoned_participant_is_excluded_as_if_removed(name):
    algo, state, fed, rounds_key = _start(name)
    rkey = round_key(rounds_key, 0)
    new, info = _round(algo, state, _poison(fed, [BAD]), rkey)
    assert not bool(np.asarray(info.clients.valid)[BAD] & np.asarray(info.clients.finite)[BAD])
    np.testing.assert_array_equal(np.asarray(info.included), np.arange(NUM_CLIENTS) != BAD)
    assert bool(info.server_finite), "the poisoned participant reached the server's state"
    want, errors, _ = _removed(algo, state, fed, rkey, [BAD], withheld=name in ONE_SHOT)
    np.testing.assert_array_equal(
        errors[np.arange(errors.shape[0]) != BAD] if name in ONE_SHOT else errors, 0
    )
    assert tree_equal(_compared(name, new.server), _compared(name, want)), name
    if name == "bicompfl_gr":
        # the relay keeps every stream (framed) and says who counted: each client rebuilds the federator's
        # model from it, bit for bit
        np.testing.assert_array_equal(np.asarray(new.server.relay_included), np.arange(NUM_CLIENTS) != BAD)
        following = jax.jit(build_round_step(algo, client_map="map").client_phase)(
            round_key(rounds_key, 1), new, fed
        )
        np.testing.assert_array_equal(np.asarray(following.client_info.downlink_errors), 0)
        for c in range(NUM_CLIENTS):
            assert tree_equal(following.client_states.theta[c], new.server.theta)
    if name == "dosfl":
        # the whole server state: the replay without the client, whose distilled data is zeros
        assert tree_equal(new.server, want)
        np.testing.assert_array_equal(np.asarray(new.server.distilled.inputs[BAD]), 0)
    if name == "bpcfl":
        # the whole server state (coreset, weights, posterior samples) is the clean round's with the client
        # withheld; its points weigh 0 and the others' weights are those without it: w_m = |I| n_m / N_I
        assert tree_equal(new.server, want)
        k = new.server.coreset.inputs.shape[0] // NUM_CLIENTS
        w = np.asarray(new.server.weights).reshape(NUM_CLIENTS, k)
        n = np.asarray(fed.num_examples, np.float32)
        others = np.arange(NUM_CLIENTS) != BAD
        np.testing.assert_array_equal(w[BAD], 0)
        np.testing.assert_allclose(
            w[others], (2 * n[others] / n[others].sum())[:, None].repeat(k, 1), rtol=1e-6
        )
        assert np.isfinite(np.asarray(new.server.coreset.inputs)).all()


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_a_round_with_every_participant_poisoned_keeps_the_server_state(name):
    algo, state, fed, rounds_key = _start(name)
    rkey = round_key(rounds_key, 0)
    poisoned = _poison(fed, range(NUM_CLIENTS))
    new, info = _round(algo, state, poisoned, rkey)
    assert not np.asarray(info.included).any()
    # the server state after its broadcast (what it knows once it has sent the downlink: BICompFL-PR's
    # copies of the clients' estimates), which server_update starts from
    before = jax.jit(build_round_step(algo, client_map="map").client_phase)(rkey, state, poisoned).sent_server
    if name in ("memsgd", "cser", "doublesqueeze", "neolithic"):
        # nothing received is a zero mean: the model does not move (the round counter of the error-reset
        # schedule, which every party keeps, advances)
        assert tree_equal(new.server.params, state.server.params)
    elif name == "bicompfl_gr":
        assert tree_equal((new.server.theta, new.server.coder), (state.server.theta, state.server.coder))
        assert not np.asarray(new.server.relay_included).any()
    else:
        assert tree_equal(new.server, before), name


BARE_LRSUQ = lrsuq_coder(integer_lattice(2), GaussianNoise(0.1))


def test_bare_lrsuq_nan_input_is_withheld_and_decodes_invalid():
    """Regression (issue 28): with a bare ``lrsuq_coder`` a NaN input made the encoder report
    ``valid=False``, yet its stream decoded as valid with plausible values and ``cepam()`` averaged it.
    The engine now withholds such a stream, and the decoder rejects the withheld message."""
    coder = BARE_LRSUQ
    dim = 16
    keys = ClientKeys(jax.random.key(1), jax.random.key(2))
    p = PointMass(jnp.zeros(dim))
    bad = jnp.full(dim, jnp.nan).at[0].set(1.0)  # a PointMass refuses NaN outside jit; a client's is traced
    message, info = jax.jit(lambda v: coder.encode(keys, PointMass(v), p, coder.init(dim)))(bad)
    assert not bool(info.valid)
    held = withhold(message, info.valid)
    assert int(held.num_bits) == -1
    _, decoded = jax.jit(coder.decode)(keys.shared, p, coder.init(dim), held)
    assert not bool(decoded.valid)
    assert not bool(included(Message(held.payload[None], held.num_bits[None]), decoded.valid[None])[0])


@pytest.mark.slow  # 80 s cold (the LRSUQ rejection loops of a 2,778-parameter model): make test-all
def test_bare_lrsuq_cepam_round_excludes_the_nan_client(small_model, digits_fed):
    """The issue's case end to end: ``cepam()`` with a bare ``lrsuq_coder``, one of three clients with NaN
    data: the round excludes it (``RoundInfo.included``) and the server state is that of the round without
    it."""
    _, params, loss = small_model
    coder = BARE_LRSUQ
    fed = make_federated_data(
        digits_fed.x[:90], digits_fed.y[:90], partition("iid", np.asarray(digits_fed.y[:90]), 3, seed=0)
    )
    algo = cepam(loss, clients_per_round=3, coder=coder, local_steps=2)
    init_key, rounds_key = run_keys(0)
    state = algo.init(init_key, params, 3)
    rkey = round_key(rounds_key, 0)
    new, round_info = _round(algo, state, _poison(fed, [BAD]), rkey)
    assert not bool(np.asarray(round_info.clients.valid)[BAD])
    np.testing.assert_array_equal(np.asarray(round_info.included), [True, False, True])
    want, _, _ = _removed(algo, state, fed, rkey, [BAD])
    assert tree_equal(new.server, want)
    assert np.isfinite(np.asarray(ravel_pytree(new.server.params)[0])).all()
