"""The App. F toy distributed-mean experiment and the Thm 4.1 calculator (sidejax.coding.toy;
docs/papers/klms.md#s4-8, docs/papers/klms.md#s7-10 to docs/papers/klms.md#s7-12).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.coding.toy import (
    distributed_mean,
    gaussian_log_ratio_tail,
    log2_candidates_for_overhead,
    theorem41_epsilon,
)

# one compiled program per (clients, log2 K) instead of the vmapped runs op by op
mean_estimates = jax.jit(distributed_mean, static_argnums=(2, 3))


def test_toy_error_shrinks_with_clients_and_overhead():
    mu = 0.8
    b = log2_candidates_for_overhead(mu * mu / 2, 6.0)
    assert b == 10  # e^{6.32} = 556 -> 1024 candidates
    runs = 400
    err = {}
    for n in (1, 16):
        est = np.asarray(mean_estimates(jax.random.key(0), jnp.full((n,), mu), 4, runs), np.float64)
        err[n] = est - mu
    # the std of the estimate falls roughly like 1/sqrt(N): 1/4 from N=1 to N=16 (allow 0.4)
    assert err[16].std() < 0.4 * err[1].std()
    # with overhead r = 6 nats the bias is small (docs/papers/klms.md#s7-10: < 0.03 at r >= 4)
    est = np.asarray(mean_estimates(jax.random.key(1), jnp.full((16,), mu), b, runs), np.float64)
    assert abs(est.mean() - mu) < 0.03 + 4 * est.std() / math.sqrt(runs)


def test_theorem41_epsilon_calculator_and_single_client_bound():
    # docs/papers/klms.md#s7-12: Gaussian toy, mu = 0.8, r = 6 nats
    mu, r = 0.8, 6.0
    tail = gaussian_log_ratio_tail(mu, r)
    assert tail == pytest.approx(0.5 * math.erfc(3.75 / math.sqrt(2)), rel=1e-12)
    assert theorem41_epsilon([tail], r) == pytest.approx(0.492, abs=5e-4)
    assert theorem41_epsilon([tail] * 10, r) == pytest.approx(5.5e-4, rel=0.01)
    # the N = 1 bound against the self-normalised estimate J_K(f), f(x) = x, K = ceil(e^{KL + r}) = 556
    eps = theorem41_epsilon([tail], r)
    rng = np.random.default_rng(0)
    y = rng.standard_normal((2000, 556))
    logw = mu * y - mu * mu / 2
    w = np.exp(logw - logw.max(axis=1, keepdims=True))
    j = (w * y).sum(axis=1) / w.sum(axis=1)
    threshold = 2 * math.sqrt(mu * mu + 1) * eps / (1 - eps)
    assert np.mean(np.abs(j - mu) >= threshold) <= 2 * eps
    with pytest.raises(ValueError, match="tail_probs"):
        theorem41_epsilon([1.5], r)
    with pytest.raises(ValueError, match="overhead_nats"):
        theorem41_epsilon([0.1], -1.0)
