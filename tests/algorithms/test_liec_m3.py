"""LIEC and M3, the BICompFL paper's other two bi-directionally compressed baselines
(docs/papers/bicompfl.md#liec, docs/papers/bicompfl.md#m3): the property that defines each in its own paper,
checked exactly, the bits read from the messages, and learning.

LIEC: the virtual model w + e_s + mean_i e_i moves exactly as uncompressed FedAvg (the compensated models
differ from it only by the errors they carry) and every period-th round's float32 averaging resets the errors.
M3: the permutation compressor's parts are disjoint, cover every coordinate, sum to n times the update and are
unbiased; TopK keeps exactly the K largest; EF21 loses nothing of what TopK drops."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import BASE, rounds_one_by_one, small_digits_federation
from jax.flatten_util import ravel_pytree

from sidejax.algorithms import liec, m3
from sidejax.algorithms.compressed import compressed_broadcast
from sidejax.algorithms.liec import liec_client_update, liec_init, liec_receive, liec_server_update
from sidejax.algorithms.m3 import (
    M3ClientState,
    M3Received,
    downlink_sync,
    m3_client_update,
    permutation_compress,
    permutation_parts,
)
from sidejax.coding import ERR_INPUT, ERR_PARSE, Message, topk_bits, topk_coder
from sidejax.distributions import PointMass
from sidejax.fl import LocalTraining
from sidejax.fl.local import LocalInfo
from sidejax.keys import DOWNLINK, client_keys, draw_key, round_key, stream_key

NUM_CLIENTS = 4
ROUNDS = 6
PERIOD = 3  # LIEC's float32 averaging ends rounds 2 and 5


def _fake_train(key, params, data):
    """A local 'training' that adds a known change, passed as the client's data."""
    del key
    moved = jax.tree.map(lambda a, d: a + d, params, data)
    return moved, LocalInfo(jnp.float32(0.0), jnp.int32(1), jnp.asarray(True))


# ---------------------------------------------------------------------------------------------------
# LIEC


def test_liec_virtual_model_moves_as_uncompressed_fedavg_and_averaging_resets_the_errors():
    """The kernels, round by round, with known local changes Delta_i: the virtual model w + e_s + mean_i e_i
    advances by eta * mean_i Delta_i (to float32 rounding), every client's copy of w is the server's bit for
    bit, and a sync round (float32 both ways) leaves e_i = e_s = 0, so every local model w + e_i is w."""
    dim, n, eta = 203, 3, 0.5
    algo = liec(lambda p, b, k: 0.0, LocalTraining(optax.sgd(0.1), batch_size=1), clients_per_round=n)
    method = algo.client_update.args[0]
    method = method._replace(reset_period=PERIOD, server_lr=eta)
    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal(dim), jnp.float32)}
    state = liec_init(method, jax.random.key(0), params, n)
    receive = jax.jit(jax.vmap(functools.partial(liec_receive, method), (None, 0, None, 0, None)))
    update = jax.jit(jax.vmap(functools.partial(liec_client_update, method, _fake_train)))
    server_update = jax.jit(functools.partial(liec_server_update, method))
    server, clients = state.server, state.clients
    rng = np.random.default_rng(1)
    one, full = 32 + dim, 32 * dim
    for t in range(ROUNDS):
        rkey = round_key(BASE, t)
        keys = jax.vmap(client_keys, (None, 0))(rkey, jnp.arange(n))
        dkey = stream_key(rkey, DOWNLINK)
        _, message = compressed_broadcast(method, dkey, server, jnp.arange(n))
        assert int(message.num_bits) == (full if t > 0 and t % PERIOD == 0 else one)
        received = receive(dkey, keys, server, clients, message)
        w = np.asarray(ravel_pytree(server.params)[0])
        virtual = w + np.asarray(server.residual) + np.asarray(clients.error).mean(0)
        changes = (0.01 * rng.standard_normal((n, dim))).astype(np.float32)
        clients, messages, info = update(keys, received, clients, {"w": jnp.asarray(changes)})
        assert np.all(info.valid) and np.all(info.finite) and np.all(info.extra.downlink_errors == 0)
        sync = (t + 1) % PERIOD == 0
        np.testing.assert_array_equal(messages.num_bits, full if sync else one)
        # every client holds the server's w bit for bit (and trained from w + e_i)
        np.testing.assert_array_equal(np.asarray(clients.model), np.broadcast_to(w, (n, dim)))
        server, sinfo, errors = server_update(rkey, server, jnp.arange(n), keys.shared, messages, None)
        assert np.all(np.asarray(errors) == 0) and bool(sinfo.downlink_valid)
        after = np.asarray(ravel_pytree(server.params)[0])
        new_virtual = after + np.asarray(server.residual) + np.asarray(clients.error).mean(0)
        np.testing.assert_allclose(new_virtual, virtual + eta * changes.mean(0), rtol=0, atol=2e-6)
        if sync:  # the float32 averaging: no error left anywhere, w is the virtual model
            np.testing.assert_array_equal(np.asarray(clients.error), 0.0)
            np.testing.assert_array_equal(np.asarray(server.residual), 0.0)
        else:
            assert np.all(np.linalg.norm(np.asarray(clients.error), axis=1) > 0)


@pytest.fixture(scope="module")
def federation():
    """4 iid clients of 60 digits each, and the whole training set as one batch (for the loss)."""
    return small_digits_federation(NUM_CLIENTS)


@pytest.fixture(scope="module")
def runs(small_model, federation):
    """``runs(name) -> (algo, [state_0, ..., state_6], infos)``, one round per call (one compiled program)."""
    _, params, loss = small_model
    fed, _ = federation
    local = LocalTraining(optax.adam(0.01), batch_size=30, num_epochs=1)
    build = {
        "liec": lambda: liec(loss, local, clients_per_round=NUM_CLIENTS, server_lr=1.0, period=PERIOD),
        # p = 1/2 so that 6 rounds see both kinds of downlink; no momentum (6 rounds from z = 0)
        "m3": lambda: m3(
            loss, local, clients_per_round=NUM_CLIENTS, server_lr=1.0, momentum=1.0, sync_probability=0.5
        ),
    }
    cache = {}

    def run(name):
        if name not in cache:
            algo = build[name]()
            cache[name] = (algo, *rounds_one_by_one(algo, params, fed, ROUNDS))
        return cache[name]

    return run


# the engine runs compile a round of each method (10-25 s cold on 2 CPU cores): make test-all
@pytest.mark.slow
@pytest.mark.parametrize("name", ["liec", "m3"])
def test_runs_learn_and_send_what_the_messages_say(runs, small_model, federation, name):
    _, params, loss = small_model
    _, batch = federation
    algo, states, infos = runs(name)
    d = ravel_pytree(params)[0].size
    up, down = np.asarray(infos.uplink_bits), np.asarray(infos.downlink_bits)
    t = np.arange(ROUNDS)[:, None]
    if name == "liec":
        np.testing.assert_array_equal(up, np.where((t + 1) % PERIOD == 0, 32 * d, 32 + d) * np.ones_like(up))
        np.testing.assert_array_equal(
            down, np.where((t > 0) & (t % PERIOD == 0), 32 * d, 32 + d) * np.ones_like(up)
        )
    else:
        np.testing.assert_array_equal(up, topk_bits(d, NUM_CLIENTS))  # K = floor(d / n) values + positions
        sync = np.asarray(infos.server.sync)
        assert sync.any() and not sync.all()  # both kinds of downlink were exercised
        parts = 32 * -(-(d - np.arange(NUM_CLIENTS)) // NUM_CLIENTS)  # 32 |B_i|, |B_i| = ceil((d - i) / n)
        np.testing.assert_array_equal(down, np.where(sync[:, None], 32 * d, parts[None, :]))
    np.testing.assert_array_equal(infos.uplink_errors, 0)
    np.testing.assert_array_equal(infos.clients.extra.downlink_errors, 0)
    assert np.all(infos.clients.valid) and np.all(infos.clients.finite) and np.all(infos.server_finite)
    loss = jax.jit(loss)
    first, last = float(loss(params, batch, None)), float(loss(states[-1].server.params, batch, None))
    assert last < 0.75 * first, (name, first, last)


@pytest.mark.slow
def test_m3_clients_hold_the_permutation_compressed_model(runs):
    """In a sync round every client's w_i is the server's x; otherwise client i moved by exactly its own part
    Q_i(s) of the server's last step s, so the n moves sum to n s; and g is the mean of the clients' g_i."""
    algo, states, infos = runs("m3")
    method = algo.receive.args[0]
    for t in range(ROUNDS):
        before, after = states[t], states[t + 1]
        dkey = stream_key(round_key(BASE, t), DOWNLINK)
        sync = bool(downlink_sync(method, dkey, before.server.rounds))
        assert sync == bool(infos.server.sync[t])
        x = np.asarray(ravel_pytree(before.server.params)[0])
        models = np.asarray(after.clients.model)
        if sync:
            np.testing.assert_array_equal(models, np.broadcast_to(x, models.shape))
        else:
            step = np.asarray(before.server.step)
            moves = models - np.asarray(before.clients.model)
            positions, live = permutation_parts(draw_key(dkey, 0), x.size, NUM_CLIENTS)
            positions, live = np.asarray(positions), np.asarray(live)
            for i in range(NUM_CLIENTS):
                mine = positions[i][live[i]]
                np.testing.assert_allclose(moves[i, mine], NUM_CLIENTS * step[mine], rtol=1e-5, atol=1e-7)
                np.testing.assert_array_equal(np.delete(moves[i], mine), 0.0)  # nothing outside B_i
        np.testing.assert_allclose(
            np.asarray(after.server.estimate),
            np.asarray(after.clients.estimate).mean(0),
            rtol=1e-5,
            atol=1e-7,
        )


# ---------------------------------------------------------------------------------------------------
# M3's compressors and error feedback


def test_permutation_parts_are_disjoint_cover_and_are_unbiased():
    dim, n = 23, 4  # not a multiple of n: parts of 6, 6, 6, 5
    positions, live = jax.jit(permutation_parts, static_argnums=(1, 2))(jax.random.key(3), dim, n)
    positions, live = np.asarray(positions), np.asarray(live)
    np.testing.assert_array_equal(live.sum(1), [6, 6, 6, 5])
    np.testing.assert_array_equal(np.sort(positions[live]), np.arange(dim))  # disjoint and covering
    s = jnp.asarray(np.random.default_rng(0).standard_normal(dim), jnp.float32)
    parts = np.zeros((n, dim), np.float32)
    values = np.asarray(permutation_compress(s, jnp.asarray(positions), jnp.asarray(live), n))
    for i in range(n):
        parts[i, positions[i][live[i]]] = values[i][live[i]]
    np.testing.assert_array_equal(parts.sum(0), n * np.asarray(s))  # sum of the parts = n s, exactly
    # unbiased: over random permutations E Q_i(s) = s (each coordinate is in part i with probability 1/n)

    def part_of_client(key, i):
        pos, lv = permutation_parts(key, dim, n)
        vals = permutation_compress(s, pos[i], lv[i], n)
        return jnp.zeros(dim).at[pos[i]].add(vals, mode="drop")

    keys = jax.random.split(jax.random.key(4), 4000)
    mean = np.asarray(jax.jit(jax.vmap(part_of_client, (0, None)))(keys, 1).mean(0))
    sd = np.abs(np.asarray(s)) * np.sqrt((n - 1) / len(keys))  # of the mean over the draws
    assert np.all(np.abs(mean - np.asarray(s)) <= 5 * sd + 1e-7)


def test_topk_keeps_exactly_the_k_largest():
    dim, divisor = 203, 10
    coder = topk_coder(divisor)
    v = np.random.default_rng(5).standard_normal(dim).astype(np.float32)
    p = PointMass(jnp.zeros(dim, jnp.float32))
    keys = client_keys(round_key(BASE, 0), 0)
    message, info = jax.jit(coder.encode)(keys, PointMass(jnp.asarray(v)), p, coder.init(dim))
    k = dim // divisor
    assert bool(info.valid) and int(message.num_bits) == topk_bits(dim, divisor) == k * (32 + 8)
    decoded, check = jax.jit(coder.decode)(keys.shared, p, coder.init(dim), message)
    decoded = np.asarray(decoded)
    assert int(check.errors) == 0
    kept = np.flatnonzero(decoded)
    np.testing.assert_array_equal(kept, np.sort(np.argsort(-np.abs(v))[:k]))
    np.testing.assert_array_equal(decoded[kept], v[kept])  # exact values
    # a corrupted stream: a position out of order, a wrong length
    words = np.asarray(message.payload).copy()
    words[k] ^= 0xFF  # the first positions' bits
    _, bad = jax.jit(coder.decode)(
        keys.shared, p, coder.init(dim), Message(jnp.asarray(words), message.num_bits)
    )
    assert int(bad.errors) & ERR_INPUT
    _, short = jax.jit(coder.decode)(
        keys.shared, p, coder.init(dim), Message(message.payload, message.num_bits - 8)
    )
    assert int(short.errors) & ERR_PARSE
    with pytest.raises(ValueError, match="divisor"):
        topk_coder(0)


def test_m3_error_feedback_conserves_mass():
    """z_i <- (1 - beta) z_i + beta Delta_i; c_i = TopK(z_i - g_i); g_i <- g_i + c_i: g_i grows by exactly the
    decoded message and z_i - g_i keeps all that TopK dropped; with a constant Delta, g_i reaches z_i in at
    most n rounds (each sends a disjoint tenth of the coordinates that are left)."""
    dim, n = 40, 4
    algo = m3(
        lambda p, b, k: 0.0, LocalTraining(optax.sgd(0.1), batch_size=1), clients_per_round=n, momentum=1.0
    )
    method = algo.client_update.args[0]
    update = jax.jit(functools.partial(m3_client_update, method, _fake_train))
    coder = method.coder
    p = PointMass(jnp.zeros(dim, jnp.float32))
    decode = jax.jit(coder.decode)
    change = np.random.default_rng(6).standard_normal(dim).astype(np.float32)
    zeros = jnp.zeros(dim, jnp.float32)
    cstate = M3ClientState(zeros, zeros, zeros, jnp.int32(0))
    received = M3Received({"w": zeros}, jnp.int32(0))
    keys = client_keys(round_key(BASE, 0), 0)
    for _ in range(n):
        old = np.asarray(cstate.estimate)
        cstate, message, info = update(keys, received, cstate, {"w": jnp.asarray(change)})
        assert bool(info.valid) and bool(info.finite)
        c, _ = decode(keys.shared, p, coder.init(dim), message)
        np.testing.assert_array_equal(np.asarray(cstate.estimate) - old, np.asarray(c))  # g_i += c_i
        np.testing.assert_array_equal(np.asarray(cstate.momentum), change)  # beta = 1: z_i = Delta_i
    np.testing.assert_array_equal(np.asarray(cstate.estimate), change)  # nothing lost


def test_bad_arguments(small_model):
    _, params, loss = small_model
    local = LocalTraining(optax.sgd(0.1), batch_size=8)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="period"):
            liec(loss, local, clients_per_round=2, period=bad)
    for bad in (0.0, -1.0, True):
        with pytest.raises(ValueError, match="server_lr"):
            m3(loss, local, clients_per_round=2, server_lr=bad)
    for field in ("momentum", "sync_probability"):
        for bad in (0.0, 1.5, True, "x"):
            with pytest.raises(ValueError, match=field):
                m3(loss, local, clients_per_round=2, **{field: bad})
    with pytest.raises(ValueError, match="clients_per_round"):
        m3(loss, local, clients_per_round=0)
    # both broadcast model changes: every client in every round
    with pytest.raises(ValueError, match=r"clients_per_round == num_clients.*clients_per_round=3"):
        liec(loss, local, clients_per_round=3).init(jax.random.key(0), params, 4)
    with pytest.raises(ValueError, match=r"clients_per_round == num_clients.*clients_per_round=3"):
        m3(loss, local, clients_per_round=3).init(jax.random.key(0), params, 4)
