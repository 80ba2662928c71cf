"""CEPAM's FedAvg (sidejax/algorithms/cepam.py): the server average of decoded updates, real uplink bits,
with-replacement local sampling, persistent momentum, per-client noise levels (Theorem 12's aggregate law
with unequal levels), determinism, and bad input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import BASE, tree_equal
from jax.flatten_util import ravel_pytree
from scipy import stats

from sidejax.algorithms.cepam import cepam, sampled_sgd
from sidejax.coding import float32_coder
from sidejax.coding.lattice import NoisePrior, clip_update, lrsuq_coder
from sidejax.coding.lrsuq import GaussianNoise
from sidejax.distributions import PointMass
from sidejax.fl import build_round_step, run_rounds
from sidejax.keys import client_keys, round_key
from sidejax.lattices import integer_lattice

LEVELS = np.array([0.05, 0.1, 0.2, 0.05, 0.1, 0.2, 0.05, 0.1, 0.2, 0.3], np.float32)


@pytest.fixture(scope="module")
def cepam_run(small_model, digits_fed):
    """CEPAM (Z^2, Gaussian, per-client levels) on digits: 10 clients, all participate, 4 rounds."""
    _, params, loss = small_model
    coder = clip_update(lrsuq_coder(integer_lattice(2), GaussianNoise(0.1)), gamma=1.0)
    algo = cepam(loss, clients_per_round=10, coder=coder, local_steps=15, noise_levels=LEVELS)
    state = algo.init(BASE, params, 10)
    out = run_rounds(algo, BASE, state, digits_fed, 4)
    return algo, state, out


def test_rounds_run_with_real_bits_and_levels_kept(cepam_run, small_model):
    _, params, _ = small_model
    d = ravel_pytree(params)[0].size
    _, state0, (state, info) = cepam_run
    assert np.asarray(info.clients.valid).all() and not np.asarray(info.uplink_errors).any()
    bits = np.asarray(info.uplink_bits)
    # 32 bits of ||X|| plus a variable-length stream: every message has its own length
    assert (bits > 32).all() and len(np.unique(bits)) > 10
    assert np.all(bits < 32 * d)
    np.testing.assert_array_equal(np.asarray(state.server.levels), LEVELS)
    np.testing.assert_array_equal(np.asarray(state.clients.level), LEVELS)
    # persistent momentum: every client's buffer moved away from zero after its rounds
    mom = jax.tree.leaves(state.clients.opt_state)
    assert any(float(jnp.abs(m).sum()) > 0 for m in mom)
    assert not tree_equal(state0.server.params, state.server.params)
    assert np.isfinite(np.asarray(info.server.update_norm)).all()


def test_determinism(cepam_run, digits_fed):
    algo, state0, (state, info) = cepam_run
    again, info2 = run_rounds(algo, BASE, state0, digits_fed, 4)
    assert tree_equal(again, state)
    np.testing.assert_array_equal(np.asarray(info2.uplink_bits), np.asarray(info.uplink_bits))


@pytest.mark.slow  # two programs agree within a few ULP with XLA's default emitters only (Makefile)
def test_uncompressed_round_is_the_plain_mean(small_model, digits_fed):
    """With the float32 coder (vanilla FL) the new model is the mean of the local models, each trained by
    sampled_sgd with the client's own keys. The reference runs the clients under lax.map like the engine's
    "map" strategy, in the same jitted program; XLA may still fuse the two copies differently, and five
    momentum steps amplify a rounding difference, hence a few ulp rather than bit equality."""
    _, params, loss = small_model
    opt = optax.sgd(0.05, momentum=0.9)
    algo = cepam(loss, clients_per_round=10, coder=float32_coder(), optimizer=opt, local_steps=5)
    state = algo.init(BASE, params, 10)
    train = sampled_sgd(loss, opt, num_steps=5, batch_size=1)
    from sidejax.fl.base import ClientData
    from sidejax.keys import client_streams

    rkey = round_key(BASE, 0)

    @jax.jit
    def both(state):
        new, _ = build_round_step(algo, client_map="map")(rkey, state, digits_fed)

        def local(i, idx, n):
            data = ClientData(digits_fed.x, digits_fed.y, idx, n)
            k = client_streams(client_keys(rkey, i).private).train
            return ravel_pytree(train(k, params, opt.init(params), data)[0])[0]

        locals_ = jax.lax.map(
            lambda a: local(*a), (jnp.arange(10), digits_fed.client_indices, digits_fed.num_examples)
        )
        return ravel_pytree(new.server.params)[0], jnp.mean(locals_, axis=0)

    got, want = both(state)
    np.testing.assert_array_max_ulp(np.asarray(got), np.asarray(want), maxulp=4)


def test_aggregate_error_with_unequal_levels():
    """Theorem 12 with per-client levels (extension, docs/papers/cepam.md#s2-12): the mean of K decoded
    updates minus the mean of the updates is N(0, Σ_k σ_k² ||X^k||² / (K² γ²)) per coordinate."""
    k, d, gamma = 10, 3000, 1.0
    coder = clip_update(lrsuq_coder(integer_lattice(1), GaussianNoise(0.1)), gamma=gamma)
    rng = np.random.default_rng(0)
    updates = jnp.asarray(rng.normal(0, 1, (k, d)) * rng.uniform(0.5, 2.0, (k, 1)), jnp.float32)
    center = jnp.zeros(d)

    @jax.jit
    def roundtrip(x, level, i):
        keys = client_keys(round_key(BASE, 0), i)
        p = NoisePrior(center, level)
        message, _ = coder.encode(keys, PointMass(x), p, ())
        return coder.decode(keys.shared, p, (), message)[0]

    decoded = jax.vmap(roundtrip)(updates, jnp.asarray(LEVELS), jnp.arange(k))
    err = np.asarray(jnp.mean(decoded, 0) - jnp.mean(updates, 0), np.float64)
    norms = np.linalg.norm(np.asarray(updates, np.float64), axis=1)
    std = math.sqrt(np.sum(LEVELS.astype(np.float64) ** 2 * norms**2) / (k**2 * gamma**2))
    assert stats.kstest(err / std, "norm").pvalue > 1e-3


def test_bad_input(small_model):
    _, params, loss = small_model
    coder = float32_coder()
    with pytest.raises(ValueError, match="one level per client"):
        cepam(loss, clients_per_round=2, coder=coder, noise_levels=[0.1, 0.2]).init(BASE, params, 3)
    with pytest.raises(ValueError, match="finite and > 0"):
        cepam(loss, clients_per_round=2, coder=coder, noise_levels=[0.1, 0.0, 0.2]).init(BASE, params, 3)
    with pytest.raises(ValueError, match="local_steps|num_steps"):
        cepam(loss, clients_per_round=2, coder=coder, local_steps=0)
    with pytest.raises(ValueError, match="coder must be"):
        cepam(loss, clients_per_round=2, coder="lrsuq")
