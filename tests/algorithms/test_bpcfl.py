"""BPC-FL on the round engine (docs/papers/bpcfl.md#a1, docs/papers/bpcfl.md#a4, docs/papers/bpcfl.md#a8;
docs/papers/bpcfl.md#t8, docs/papers/bpcfl.md#t13 at the algorithm level; bad input).

One tiny federation (3 moons clients of 12, 12 and 16 points, the paper's moons MLP with GroupNorm) runs
the one round twice with the same keys (one compilation); everything else reads those two runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close_across_programs, small_bpcfl_settings

from sidejax.algorithms import (
    bpcfl,
    check_client_sizes,
    hmc_inference,
    map_inference,
    uplink_floats,
)
from sidejax.algorithms.bpcfl import check_settings
from sidejax.bayes import DivergenceWarning, check_divergences, cycled_labels
from sidejax.coding import pack_pseudocoreset, pseudocoreset_coder, sent_message
from sidejax.data import load_dataset, make_federated_data
from sidejax.distributions import PointMass
from sidejax.fl import classification_loss, finish_round, run_clients, run_rounds, start_round
from sidejax.keys import client_keys, round_key, run_keys
from sidejax.models import get_model, init_params

SIZES = (12, 12, 16)
K = small_bpcfl_settings().num_points  # 3 pseudo-points per client


@pytest.fixture(scope="module")
def moons():
    train = load_dataset("moons", "train", num_samples=sum(SIZES), noise=0.14, seed=3)
    bounds = np.cumsum((0, *SIZES))
    parts = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(SIZES))]
    spec = get_model("moons_mlp", num_classes=2, input_shape=(2,))
    return train, make_federated_data(train.x, train.y, parts), spec


@pytest.fixture(scope="module")
def one_round(moons):
    train, fed, spec = moons
    algo = bpcfl(
        classification_loss(spec.module.apply),
        lambda key: init_params(key, spec),
        input_shape=(2,),
        num_clients=len(SIZES),
        settings=small_bpcfl_settings(),
        inference=map_inference(optax.sgd(2e-2), 10),
    )
    init_key, rounds_key = run_keys(0)
    state0 = algo.init(init_key, init_params(init_key, spec), len(SIZES))
    runs = [run_rounds(algo, rounds_key, state0, fed, 1, client_map="map") for _ in range(2)]
    return algo, state0, runs


def test_one_shot_upload_is_a_real_stream_of_the_formula_length(one_round):
    _, _, [(state, info), _] = one_round
    # [Z: K x 2 float32] [labels: 1 bit each, 2 classes] [n_m: 32 bits]; nothing downlink
    expected = 32 * K * 2 + K * 1 + 32
    np.testing.assert_array_equal(np.asarray(info.uplink_bits), expected)
    np.testing.assert_array_equal(np.asarray(info.downlink_bits), 0)
    np.testing.assert_array_equal(np.asarray(info.uplink_errors), 0)
    assert bool(np.all(np.asarray(info.clients.valid))) and bool(np.all(np.asarray(info.clients.finite)))
    assert bool(np.asarray(info.server_finite).all())


def test_server_aggregates_with_the_decoded_counts_and_cycled_labels(one_round, moons):
    train, _, _ = moons
    _, _, [(state, _), _] = one_round
    server = state.server
    m, n = len(SIZES), np.asarray(SIZES, np.float64)
    # docs/papers/bpcfl.md#a4: w_m = M n_m / N, repeated over each client's K points (from the counts in
    # the streams)
    np.testing.assert_allclose(np.asarray(server.weights), np.repeat(m * n / n.sum(), K), rtol=1e-6)
    # docs/papers/bpcfl.md#a3: each client's labels are its present labels by descending frequency, cycled
    # to K
    bounds = np.cumsum((0, *SIZES))
    for c in range(m):
        y = jnp.asarray(train.y[bounds[c] : bounds[c + 1]])
        want = cycled_labels(y, jnp.ones_like(y, bool), 2, K)
        np.testing.assert_array_equal(
            np.asarray(server.coreset.labels[c * K : (c + 1) * K]), np.asarray(want)
        )
    assert server.coreset.inputs.shape == (m * K, 2)
    # the pseudo-inputs moved from their initialisation (N(X_bar, sigma_z^2)): finite and not all equal
    z = np.asarray(server.coreset.inputs)
    assert np.all(np.isfinite(z)) and np.unique(z.round(6), axis=0).shape[0] == m * K


def test_same_keys_same_bits(one_round):
    _, _, [(s1, i1), (s2, i2)] = one_round
    for a, b in zip(jax.tree.leaves((s1, i1)), jax.tree.leaves((s2, i2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_client_phase_in_parts_gives_the_same_uploads_and_posterior(one_round, moons):
    """docs/papers/bpcfl.md#a1's one round with one client per part (sidejax.fl.run_clients, a
    checkpointable PartialRound after each): every client's keys derive from its id as in one go, so the
    same pseudocoreset streams of the same lengths, and the same posterior. One client per part is another
    compiled program than all clients at once, so the uploaded float32 values agree within a few ULP
    (bit-equal at XLA's default optimisation on this CPU; 3 ULP apart on one value at LLVM -O0, which
    `make test` compiles with), and the posterior, updated from them, within 16."""
    _, fed, _ = moons
    algo, state0, [(state, info), _] = one_round
    _, rounds_key = run_keys(0)
    partial = start_round(algo, rounds_key, state0, fed, client_map="map")
    for _ in SIZES:  # one client per part: one program (tests/fl/test_rounds.py runs parts of two sizes)
        partial = run_clients(algo, rounds_key, state0, fed, partial, 1, client_map="map")
    parts_state, parts_info = finish_round(algo, rounds_key, state0, fed, partial, client_map="map")
    np.testing.assert_array_equal(np.asarray(parts_info.uplink_bits), np.asarray(info.uplink_bits[0]))
    # the server's coreset and weights are the decoded uploads
    assert_trees_close_across_programs(parts_state.server[1:3], state.server[1:3], ulps=4)
    assert_trees_close_across_programs(parts_state, state, ulps=16)


def test_eval_params_are_the_posterior_samples(one_round):
    algo, state0, [(state, _), _] = one_round
    samples = algo.eval_params(state)
    assert algo.evaluation.ensemble
    for leaf, init in zip(jax.tree.leaves(samples), jax.tree.leaves(state0.server.params), strict=True):
        assert leaf.shape == (1, *init.shape)
    # MAP moved away from the initialisation
    moved = [
        float(jnp.max(jnp.abs(a[0] - b)))
        for a, b in zip(jax.tree.leaves(samples), jax.tree.leaves(state0.server.params), strict=True)
    ]
    assert max(moved) > 0
    metrics = algo.metrics(jax.tree.map(lambda a: a[0], one_round[2][0][1]))
    assert np.isfinite(float(metrics["coreset_surrogate_last"]))


def test_uplink_floats_match_the_spec_counts():
    # docs/papers/bpcfl.md#a8 / docs/papers/bpcfl.md#t13: EMNIST Z alone M K D = 4,860,800; with int labels
    # M K (D + 1) = 4,867,000 (+ M for n_m)
    emnist = small_bpcfl_settings(num_points=62, num_classes=62)
    assert 100 * (uplink_floats(emnist, 784) - 1) == 4_867_000
    assert 100 * 62 * 784 == 4_860_800
    assert 100 * (uplink_floats(emnist, 784, one_hot=True) - 1) == 5_245_200
    # regression: 5 clients x 6 points x (1 + 1) = 60; moons: 5 x 5 x (2 + 1) = 75
    assert (
        5 * (uplink_floats(small_bpcfl_settings(num_points=6, num_classes=None, step_size_labels=1.0), 1) - 1)
        == 60
    )
    assert 5 * (uplink_floats(small_bpcfl_settings(num_points=5), 2) - 1) == 75


@pytest.mark.slow  # paper-scale: EMNIST-62's K = 62 pseudo-images of 784 pixels
def test_emnist_stream_length_is_measured_from_the_message():
    # K = 62 pseudo-points of 784 pixels, 62 classes (6 bits per label), n_m in 32 bits
    coder = pseudocoreset_coder(62, 62)
    z = jnp.zeros((62, 784), jnp.float32)
    v = pack_pseudocoreset(z, jnp.arange(62) % 62, 250)
    keys = client_keys(round_key(jax.random.key(0), 0), 0)
    message, info = coder.encode(keys, PointMass(v), None, coder.init(v.shape[0]))
    assert float(message.num_bits) == 32 * 62 * 784 + 62 * 6 + 32
    assert sent_message(message).payload.shape[0] == -(-int(message.num_bits) // 32)
    value, decoded = coder.decode(keys.shared, PointMass(jnp.zeros_like(v)), coder.init(v.shape[0]), message)
    assert bool(info.valid) and int(decoded.errors) == 0
    np.testing.assert_array_equal(np.asarray(value), np.asarray(v))


def test_bad_input_is_refused_with_the_argument_named(moons):
    _, fed, spec = moons
    with pytest.raises(ValueError, match="num_points=13 .* exceeds the data of client\\(s\\) \\[0, 1\\]"):
        check_client_sizes(13, np.asarray(SIZES))
    with pytest.raises(ValueError, match="zero clients"):
        check_client_sizes(3, np.zeros((0,), int))
    with pytest.raises(ValueError, match="step_size_labels must be 0 for classification"):
        check_settings(small_bpcfl_settings(step_size_labels=0.5))
    with pytest.raises(ValueError, match="r \\+ L_D <= T_pre"):
        check_settings(small_bpcfl_settings(max_start=15))
    with pytest.raises(ValueError, match="data_chain_length=7 must be a multiple"):
        check_settings(small_bpcfl_settings(data_chain_length=7))
    with pytest.raises(ValueError, match="settings.num_updates"):
        check_settings(small_bpcfl_settings(num_updates=0))
    with pytest.raises(ValueError, match="prior_precision"):
        check_settings(small_bpcfl_settings(prior_precision=-1.0))
    loss = classification_loss(spec.module.apply)
    algo = bpcfl(
        loss,
        lambda key: init_params(key, spec),
        input_shape=(2,),
        num_clients=3,
        settings=small_bpcfl_settings(num_points=17),
        inference=map_inference(optax.sgd(1e-2), 1),
    )
    init_key, _ = run_keys(0)
    with pytest.raises(
        ValueError, match="one-shot: .* so clients_per_round \\(3\\) must equal num_clients \\(4\\)"
    ):
        algo.init(init_key, init_params(init_key, spec), 4)
    with pytest.raises(ValueError, match="num_clients must be an integer >= 1"):
        bpcfl(loss, None, input_shape=(2,), num_clients=0, settings=small_bpcfl_settings(), inference=None)
    # K larger than every client's data (at most 16 examples here): refused when the round is traced
    state = algo.init(init_key, init_params(init_key, spec), 3)
    with pytest.raises(ValueError, match="num_points=17 .* exceeds every client's data"):
        jax.eval_shape(lambda s: run_rounds(algo, run_keys(0)[1], s, fed, 1, client_map="map"), state)


def test_divergent_hmc_is_reported_not_silent():
    # a standard Gaussian target with a step size far past the leapfrog stability limit (eps > 2)
    inference = hmc_inference(
        step_size=3.0, num_integration_steps=10, inverse_mass_matrix=1.0, num_burnin=5, num_samples=5
    )
    out = inference.run(jax.random.key(0), lambda th: -0.5 * jnp.sum(th**2) * 1e3, jnp.ones(4))
    assert int(out.num_divergent) > 0
    with pytest.warns(DivergenceWarning, match="lower step_size"):
        check_divergences(out)
