"""Mean-field Gaussian posteriors (sidejax/bayes/variational.py): T1 (closed-form KL vs Monte Carlo,
KL(q||q) = 0, KL >= 0, gradient; docs/papers/coreset_pfedbayes.md#t1) and T2 (reparameterised moments;
docs/papers/coreset_pfedbayes.md#t2)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from sidejax.bayes.variational import (
    MeanField,
    diag_gaussian_kl,
    init_mean_field,
    mean_field_kl,
    sample,
    scales,
)
from sidejax.keys import draw_key

PARAMS = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}


def _posterior(seed, shift=0.0):
    v = init_mean_field(jax.random.key(seed), PARAMS, weight_scale=0.5, rho=-1.0)
    rng = np.random.default_rng(seed)
    rho = jax.tree.map(lambda a: a + jnp.asarray(rng.uniform(-0.5, 0.5, a.shape), a.dtype), v.rho)
    return MeanField(jax.tree.map(lambda a: a + shift, v.mu), rho)


def test_kl_closed_form_matches_monte_carlo():
    q, z = _posterior(0), _posterior(1, shift=0.3)
    kl = float(mean_field_kl(q, z))
    assert kl > 0 and float(mean_field_kl(q, q)) == pytest.approx(0.0, abs=1e-5)
    # Monte Carlo: E_q[log q - log z] with 1e5 samples (float64 numpy)
    leaves = lambda t: np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(t)])
    mq, sq = leaves(q.mu), leaves(scales(q))
    mz, sz = leaves(z.mu), leaves(scales(z))
    x = mq + sq * np.random.default_rng(2).standard_normal((100_000, mq.size))
    logq = -0.5 * (((x - mq) / sq) ** 2).sum(1) - np.log(sq).sum()
    logz = -0.5 * (((x - mz) / sz) ** 2).sum(1) - np.log(sz).sum()
    diff = logq - logz
    se = diff.std() / math.sqrt(diff.size)
    assert abs(diff.mean() - kl) < 5 * se and abs(diff.mean() / kl - 1) < 1e-2


def test_kl_gradient_vanishes_at_z_equal_q():
    q = _posterior(3)
    g = jax.grad(lambda z: mean_field_kl(q, z))(q)
    assert all(float(jnp.max(jnp.abs(a))) < 1e-6 for a in jax.tree.leaves(g))


def test_reparameterised_samples_have_the_posterior_moments():
    q = _posterior(4)
    keys = jax.vmap(lambda i: draw_key(jax.random.key(5), i))(jnp.arange(20_000))
    draws = jax.vmap(lambda k: ravel_pytree(sample(k, q))[0])(keys)
    mu = np.concatenate([np.ravel(a) for a in jax.tree.leaves(q.mu)])
    sd = np.concatenate([np.ravel(a) for a in jax.tree.leaves(scales(q))])
    n = draws.shape[0]
    assert np.all(np.abs(np.asarray(draws).mean(0) - mu) < 5 * sd / math.sqrt(n))
    assert np.all(np.abs(np.asarray(draws).std(0) / sd - 1) < 5 / math.sqrt(2 * n))


def test_non_positive_scale_raises():
    with pytest.raises(ValueError, match="sigma_q must be finite and > 0"):
        diag_gaussian_kl(jnp.zeros(3), jnp.array([1.0, 0.0, 1.0]), jnp.zeros(3), jnp.ones(3))
    with pytest.raises(ValueError, match="sigma_z"):
        diag_gaussian_kl(jnp.zeros(3), jnp.ones(3), jnp.zeros(3), jnp.array([1.0, -1.0, jnp.nan]))
    with pytest.raises(ValueError, match="same parameters"):
        mean_field_kl(_posterior(0), init_mean_field(jax.random.key(0), {"w": jnp.zeros(2)}))
