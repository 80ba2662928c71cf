"""The round engine and FedAvg: exactness, determinism, strategies, keys, bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tree_equal
from jax.flatten_util import ravel_pytree

from sidejax.coding import decode_float32, encode_float32
from sidejax.data import make_federated_data
from sidejax.fl import (
    Batch,
    build_round_step,
    default_client_strategy,
    epoch_order,
    fedavg,
    run_rounds,
    sample_clients,
)
from sidejax.keys import (
    CLIENTS,
    ORDER,
    PRIVATE,
    SHARED,
    client_keys,
    client_streams,
    epoch_key,
    round_key,
    run_keys,
    stream_key,
)

BASE = jax.random.key(42)


def assert_trees_close_across_programs(a, b, ulps: int) -> None:
    """``a`` and ``b`` come from two differently compiled programs computing the same thing.

    XLA may fuse, vectorise and order float reductions differently in two programs (and differently on
    another CPU), so their floats agree to a few units in the last place, not bit for bit: on another
    machine of the same kind the one-step FedAvg test below differed by 1-3 ULP on 9 of its 2,778 weights.
    Float leaves must agree within ``ulps`` ULPs of the leaf's largest magnitude (rounding errors are
    absolute at the scale of the sums that produce them, so an entry near zero is not held to its own, much
    finer, spacing); integer and bool leaves (client ids, step counts, flags) and key leaves must be equal.
    """
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if jnp.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating):
            scale = np.spacing(np.max(np.abs(y), initial=np.finfo(y.dtype).tiny).astype(y.dtype))
            np.testing.assert_allclose(x, y, rtol=0, atol=ulps * float(scale))
        else:
            np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def algo_map(small_model):
    _, _, loss = small_model
    return fedavg(
        loss, optax.sgd(0.1), clients_per_round=4, batch_size=16, local_epochs=1, client_strategy="map"
    )


@pytest.fixture(scope="module")
def algo_vmap(small_model):
    _, _, loss = small_model
    return fedavg(
        loss, optax.sgd(0.1), clients_per_round=4, batch_size=16, local_epochs=1, client_strategy="vmap"
    )


@pytest.fixture(scope="module")
def ten_rounds(algo_map, small_model, digits_fed):
    _, params, _ = small_model
    state = algo_map.init(BASE, params, 10)
    return state, run_rounds(algo_map, BASE, state, digits_fed, 10)


def test_fedavg_one_client_one_step_equals_centralized_sgd(small_model, digits):
    spec, params, loss = small_model
    train, _ = digits
    x, y = train.x[:64], train.y[:64]
    fed = make_federated_data(x, y, [np.arange(64)])
    lr = 0.3
    algo = fedavg(loss, optax.sgd(lr), clients_per_round=1, batch_size=64, local_epochs=1)
    state = algo.init(BASE, params, 1)
    new_state, info = jax.jit(algo.round_step)(round_key(BASE, 0), state, fed)

    # The same step, centrally: one SGD step on the full batch, in the client's epoch order.
    keys = client_keys(round_key(BASE, 0), 0)
    ekey = epoch_key(client_streams(keys.private).train, 0)
    order = epoch_order(stream_key(ekey, ORDER), jnp.int32(64), 64)
    batch = Batch(jnp.asarray(x)[order], jnp.asarray(y)[order], jnp.ones(64))
    grads = jax.jit(jax.grad(loss))(params, batch, None)
    expected = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a - lr * b, p, g))(params, grads)
    # Two differently compiled programs (the round, and a separate grad + update): equal to a few ULP, not bit
    # for bit (on another machine of the same kind: 1-3 ULP on 9 of 2,778 weights; 0 on this one).
    for got, want in zip(jax.tree.leaves(new_state.server.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_max_ulp(np.asarray(got), np.asarray(want), maxulp=8)
    assert int(info.clients.extra[0]) == 1  # exactly one local step


def test_cross_program_tolerance_is_tight():
    w = np.linspace(-0.5, 1.0, 101, dtype=np.float32)
    one_ulp = np.nextafter(w, np.float32(2.0))
    assert_trees_close_across_programs({"w": one_ulp, "ids": np.arange(3)}, {"w": w, "ids": np.arange(3)}, 16)
    off = w.copy()
    off[7] += 20 * np.spacing(np.float32(1.0))  # 20 ULPs of the leaf's scale
    with pytest.raises(AssertionError):
        assert_trees_close_across_programs({"w": off}, {"w": w}, 16)
    with pytest.raises(AssertionError):
        assert_trees_close_across_programs({"ids": np.array([0, 2])}, {"ids": np.array([0, 1])}, 16)


def test_scan_equals_python_loop_of_rounds(algo_map, small_model, digits_fed, ten_rounds):
    _, params, _ = small_model
    state = algo_map.init(BASE, params, 10)
    step = jax.jit(algo_map.round_step)
    infos = []
    for t in range(3):
        state, info = step(round_key(BASE, t), state, digits_fed)
        infos.append(info)
    scanned, sinfos = run_rounds(algo_map, BASE, algo_map.init(BASE, params, 10), digits_fed, 3)
    # The jitted round called from Python and the scan of it are two compiled programs: a few ULP apart at
    # most (bit-equal on this machine); client ids, step counts and bit counts exactly equal.
    assert_trees_close_across_programs(state, scanned, ulps=16)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *infos)
    assert_trees_close_across_programs(stacked, sinfos, ulps=16)
    np.testing.assert_array_equal(stacked.uplink_bits, sinfos.uplink_bits)


def test_five_plus_five_rounds_equal_ten_bit_for_bit(algo_map, small_model, digits_fed, ten_rounds):
    _, params, _ = small_model
    state0, (final10, info10) = ten_rounds
    mid, info_a = run_rounds(algo_map, BASE, state0, digits_fed, 5)
    final, info_b = run_rounds(algo_map, BASE, mid, digits_fed, 5)
    assert tree_equal(final, final10)
    both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), info_a, info_b)
    assert tree_equal(both, info10)


def test_same_seed_same_bits_and_second_chunk_does_not_recompile(algo_map, digits_fed, ten_rounds):
    state0, (final10, info10) = ten_rounds
    before = run_rounds._cache_size()
    again, info_again = run_rounds(algo_map, BASE, state0, digits_fed, 10)
    assert run_rounds._cache_size() == before
    assert tree_equal(again, final10) and tree_equal(info_again, info10)
    other, _ = run_rounds(algo_map, jax.random.key(7), state0, digits_fed, 10)
    assert not tree_equal(other.server.params, final10.server.params)


def test_vmap_and_map_client_strategies_agree(algo_map, algo_vmap, small_model, digits_fed):
    _, params, _ = small_model
    sa, ia = run_rounds(algo_map, BASE, algo_map.init(BASE, params, 10), digits_fed, 2)
    sb, ib = run_rounds(algo_vmap, BASE, algo_vmap.init(BASE, params, 10), digits_fed, 2)
    np.testing.assert_allclose(
        ravel_pytree(sa.server.params)[0], ravel_pytree(sb.server.params)[0], rtol=0, atol=1e-5
    )
    np.testing.assert_array_equal(ia.client_ids, ib.client_ids)
    np.testing.assert_allclose(ia.clients.loss, ib.clients.loss, rtol=1e-5)


def test_bits_are_message_lengths(ten_rounds, small_model):
    _, params, _ = small_model
    d = ravel_pytree(params)[0].size
    _, (_, info) = ten_rounds
    assert info.uplink_bits.shape == (10, 4)
    np.testing.assert_array_equal(info.uplink_bits, 32.0 * d)
    np.testing.assert_array_equal(info.downlink_bits, 32.0 * d)
    x = jax.random.normal(jax.random.key(1), (37,))
    msg = encode_float32(x)
    assert msg.payload.dtype == jnp.uint32 and float(msg.num_bits) == 37 * 32
    np.testing.assert_array_equal(decode_float32(msg), x)


def test_participants_unequal_sizes_take_their_own_number_of_steps(ten_rounds, digits_fed):
    _, (_, info) = ten_rounds
    counts = np.asarray(digits_fed.num_examples)
    ids = np.asarray(info.client_ids)
    steps = np.asarray(info.clients.extra)
    np.testing.assert_array_equal(steps, -(-counts[ids] // 16))
    assert len(set(counts.tolist())) > 1  # the fixture really has unequal clients


def test_sample_clients_without_replacement_and_uniform():
    n, c, trials = 20, 5, 4000
    keys = jax.random.split(jax.random.key(3), trials)
    ids = np.asarray(jax.jit(jax.vmap(lambda k: sample_clients(k, n, c)))(keys))
    assert all(len(set(row)) == c for row in ids)
    assert (np.diff(ids, axis=1) > 0).all() and ids.min() >= 0 and ids.max() < n
    freq = np.bincount(ids.ravel(), minlength=n) / trials  # each client: Binomial(trials, c/n) / trials
    p = c / n
    se = np.sqrt(p * (1 - p) / trials)
    assert np.abs(freq - p).max() < 5 * se
    with pytest.raises(ValueError, match="clients_per_round"):
        sample_clients(jax.random.key(0), 3, 4)


def test_client_keys_follow_global_id_and_streams_differ():
    rk = round_key(jax.random.key(0), 7)
    k3 = client_keys(rk, 3)
    batch = jax.vmap(client_keys, (None, 0))(rk, jnp.array([9, 3, 1]))
    assert np.array_equal(jax.random.key_data(batch.shared[1]), jax.random.key_data(k3.shared))
    assert not np.array_equal(jax.random.key_data(k3.shared), jax.random.key_data(k3.private))
    base = jax.random.fold_in(jax.random.fold_in(rk, CLIENTS), 3)  # the documented schedule
    assert np.array_equal(
        jax.random.key_data(k3.shared), jax.random.key_data(jax.random.fold_in(base, SHARED))
    )
    assert np.array_equal(
        jax.random.key_data(k3.private), jax.random.key_data(jax.random.fold_in(base, PRIVATE))
    )
    init_key, rounds_key = run_keys(0)
    assert not np.array_equal(jax.random.key_data(init_key), jax.random.key_data(rounds_key))


def test_builder_argument_errors(small_model):
    _, _, loss = small_model
    with pytest.raises(ValueError, match="client_strategy"):
        fedavg(loss, optax.sgd(0.1), clients_per_round=2, batch_size=4, client_strategy="pmap")
    with pytest.raises(ValueError, match="batch_size"):
        fedavg(loss, optax.sgd(0.1), clients_per_round=2, batch_size=0)
    with pytest.raises(ValueError, match="clients_per_round"):
        fedavg(loss, optax.sgd(0.1), clients_per_round=0, batch_size=4)


def test_state_for_another_number_of_clients_is_refused(algo_map, small_model, digits_fed):
    """init for 7 clients, then 10-client data: before, run_rounds silently sampled clients 7-9."""
    _, params, _ = small_model
    state = algo_map.init(BASE, params, 7)
    assert int(state.num_clients) == 7
    with pytest.raises(ValueError, match=r"num_clients=7 but the data has 10 clients"):
        run_rounds(algo_map, BASE, state, digits_fed, 1)
    with pytest.raises(ValueError, match=r"num_clients=7 but the data has 10 clients"):
        algo_map.round_step(round_key(BASE, 0), state, digits_fed)  # eager call: checked too
    # a per-client state is checked by its (static) leading axis, also under jit
    stacked = state._replace(clients=jnp.zeros((7, 3)), num_clients=None)
    with pytest.raises(ValueError, match=r"stacked over 7 clients but the data has 10"):
        jax.jit(algo_map.round_step)(round_key(BASE, 0), stacked, digits_fed)
    with pytest.raises(ValueError, match="num_clients must be an integer >= 1"):
        algo_map.init(BASE, params, 0)
    # the matching federation runs, and num_clients is carried through the rounds
    final, _ = run_rounds(algo_map, BASE, algo_map.init(BASE, params, 10), digits_fed, 1)
    assert int(final.num_clients) == 10


def test_client_strategy_defaults_to_map_on_cpu_and_vmap_on_accelerators(small_model, monkeypatch):
    """Builders take client_strategy=None and resolve it in one place (default_client_strategy): "map" on
    CPU (2.2-2.4x faster than vmap at 50-100 clients), "vmap" on GPU/TPU. Before, every builder defaulted
    to "vmap"."""
    from sidejax.algorithms import fedpm, langevin, qsgd, signsgd

    _, _, loss = small_model
    common = dict(clients_per_round=2, batch_size=8)

    def builders():
        return [
            fedavg(loss, optax.sgd(0.1), **common),
            fedpm(loss, optax.adam(0.1), **common),
            qsgd(loss, optax.sgd(0.1), **common),
            signsgd(loss, optax.sgd(0.1), **common),
            langevin(loss, num_clients=10, clients_per_round=2),
        ]

    expected = "map" if jax.default_backend() == "cpu" else "vmap"
    assert default_client_strategy() == expected
    assert all(a.round_step.client_strategy == expected for a in builders())
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert default_client_strategy() == "vmap"
    assert all(a.round_step.client_strategy == "vmap" for a in builders())
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert all(a.round_step.client_strategy == "map" for a in builders())
    explicit = fedavg(loss, optax.sgd(0.1), client_strategy="vmap", **common)
    assert explicit.round_step.client_strategy == "vmap"
    assert build_round_step(None, None, None, clients_per_round=1).client_strategy == "map"
