"""A-IHT (sidejax/bayes/coresets.py): the properties T6-T10 (docs/papers/coreset_pfedbayes.md#s5-3)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.bayes import aiht, coreset_objective, project_sparse_nonnegative, projected_potentials
from sidejax.utils import enable_x64


def _planted(seed, j=200, n=500, k=10):
    rng = np.random.default_rng(seed)
    phi = rng.normal(size=(j, n)) / np.sqrt(j)
    w = np.zeros(n)
    w[rng.choice(n, k, replace=False)] = rng.uniform(0.5, 2.0, k)
    return phi, w, phi @ w


def test_planted_sparse_nonnegative_solution_is_recovered():
    """T9 (docs/papers/coreset_pfedbayes.md#t9) in float64 (the numpy check there: relative error < 1e-6 at
    tol 1e-8), exact and reference steps; A-IHT II as well."""
    with enable_x64():
        for seed in range(3):
            phi, w_star, y = _planted(seed)
            for kwargs in ({}, {"step_scale": 0.5}, {"debias": True}):
                out = aiht(jnp.asarray(y), jnp.asarray(phi), 10, tol=1e-8, max_iter=500, **kwargs)
                w = np.asarray(out.weights)
                assert w.dtype == np.float64 and bool(out.converged), (seed, kwargs)
                assert np.linalg.norm(w - w_star) / np.linalg.norm(w_star) < 1e-6, (seed, kwargs)


def test_invariants_and_objective_below_zero_weights():
    """T6 (docs/papers/coreset_pfedbayes.md#t6; float32): w >= 0 and at most k nonzeros;
    f(w) <= f(0) = ||y||^2 without the sum constraint (w = 0 is not feasible with one); with sum_to = L the
    weights sum to L."""
    rng = np.random.default_rng(5)
    phi = jnp.asarray(rng.normal(size=(60, 40)), jnp.float32)
    y = jnp.asarray(rng.normal(size=60), jnp.float32)
    for kwargs in ({}, {"debias": True}, {"sum_to": 40.0}):
        out = aiht(y, phi, 7, **kwargs)
        w = np.asarray(out.weights)
        assert np.all(w >= 0) and np.count_nonzero(w) <= 7, kwargs
        if "sum_to" not in kwargs:
            assert float(out.objective) <= float(jnp.dot(y, y)), kwargs
        np.testing.assert_allclose(
            float(out.objective), float(coreset_objective(y, phi, out.weights)), rtol=1e-6
        )
    for debias in (False, True):  # A-IHT II's de-bias step keeps the sum too
        w = np.asarray(aiht(y, phi, 7, sum_to=40.0, debias=debias).weights)
        assert abs(w.sum() - 40.0) < 1e-3 and np.all(w >= 0) and np.count_nonzero(w) <= 7, debias


def test_every_iterate_is_sparse_nonnegative_and_the_exact_line_searches_never_increase_f():
    """T6/T8 per iteration (docs/papers/coreset_pfedbayes.md#t6, docs/papers/coreset_pfedbayes.md#t8; the
    trace): every ``w_t`` is k-sparse and non-negative; the gradient step with the exact line search never
    increases ``f`` from ``z_t``, and the momentum step never from ``w_{t+1}`` (step 0 is a candidate of each
    exact line search: this is where the theory says ``f`` does not increase; the projection in between may
    increase it, so ``f(w_t)`` is not asserted monotone). A noisy problem that runs all ``max_iter``
    iterations (float64, so the inequalities are not blurred by rounding)."""
    rng = np.random.default_rng(9)
    with enable_x64():
        phi = jnp.asarray(rng.normal(size=(80, 60)))
        y = jnp.asarray(rng.normal(size=80))
        for kwargs in ({}, {"debias": True}, {"step_scale": 0.5}):
            out = aiht(y, phi, 9, max_iter=40, tol=0.0, trace=True, **kwargs)
            tr = out.trace
            t = int(out.iterations)
            assert t >= 5, kwargs
            assert np.all(np.asarray(tr.support)[:t] <= 9) and np.all(np.asarray(tr.min_weight)[:t] >= 0)
            slack = 1e-12 * float(jnp.dot(y, y))
            if "debias" not in kwargs:  # A-IHT II's de-bias step changes w between the two line searches
                assert np.all(np.asarray(tr.step_objective)[:t] <= np.asarray(tr.start_objective)[:t] + slack)
            assert np.all(np.asarray(tr.momentum_objective)[:t] <= np.asarray(tr.objective)[:t] + slack), (
                kwargs
            )
            assert np.all(np.isnan(np.asarray(tr.objective)[t:]))
            np.testing.assert_allclose(np.asarray(tr.objective)[t - 1], float(out.objective), rtol=1e-12)


def test_projection_is_optimal_by_brute_force():
    """T7 (docs/papers/coreset_pfedbayes.md#t7): for n <= 10 the signed top-k then clip equals the best of all
    supports of size <= k."""
    rng = np.random.default_rng(6)
    for _ in range(20):
        n, k = 8, 3
        b = rng.normal(size=n)
        got = np.asarray(project_sparse_nonnegative(jnp.asarray(b), k))
        best = min(
            (np.sum((b - np.where(np.isin(np.arange(n), s), np.maximum(b, 0), 0)) ** 2), s)
            for r in range(k + 1)
            for s in itertools.combinations(range(n), r)
        )
        want = np.where(np.isin(np.arange(n), best[1]), np.maximum(b, 0), 0)
        np.testing.assert_allclose(np.sum((b - got) ** 2), best[0], rtol=1e-6)
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_coreset_potentials_full_size_fits():
    """T10 (docs/papers/coreset_pfedbayes.md#t10): centred potentials, y = Phi 1: f(1) = 0, and with k = n
    A-IHT drives f / ||y||^2 below 1e-5."""
    rng = np.random.default_rng(7)
    with enable_x64():
        phi = rng.normal(size=(50, 20))
        phi -= phi.mean(axis=0)
        y = phi.sum(axis=1)
        assert float(coreset_objective(jnp.asarray(y), jnp.asarray(phi), jnp.ones(20))) < 1e-20
        out = aiht(jnp.asarray(y), jnp.asarray(phi), 20, tol=1e-10, max_iter=1000)
        assert float(out.objective) / float(np.dot(y, y)) < 1e-5


def test_bad_input():
    phi, y = jnp.ones((5, 4)), jnp.ones(5)
    with pytest.raises(ValueError, match="at most the number of points"):
        aiht(y, phi, 5)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        aiht(y, phi, 0)
    with pytest.raises(ValueError, match="phi must be"):
        aiht(jnp.ones(4), phi, 2)
    with pytest.raises(ValueError, match="y must be finite"):
        aiht(y.at[0].set(jnp.nan), phi, 2)
    with pytest.raises(ValueError, match="step_scale"):
        aiht(y, phi, 2, step_scale=2.0)
    with pytest.raises(ValueError, match="sum_to"):
        aiht(y, phi, 2, sum_to=-1.0)
    with pytest.raises(ValueError, match="w must be non-negative"):
        coreset_objective(y, phi, jnp.array([1.0, -0.5, 0.0, 2.0]))
    with pytest.raises(ValueError, match="w must be finite"):
        coreset_objective(y, phi, jnp.array([1.0, jnp.nan, 0.0, 2.0]))


def test_vmaps_over_clients():
    rng = np.random.default_rng(8)
    phis = jnp.asarray(rng.normal(size=(3, 30, 12)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(3, 30)), jnp.float32)
    batched = jax.vmap(lambda y, p: aiht(y, p, 4).weights)(ys, phis)
    for i in range(3):
        np.testing.assert_allclose(
            np.asarray(batched[i]), np.asarray(aiht(ys[i], phis[i], 4).weights), rtol=1e-5, atol=1e-6
        )


def _blr_posterior(x, t, w, prior_var, noise_var):
    """Conjugate Bayesian linear regression with weighted likelihood (float64 numpy): mean and covariance."""
    prec = np.eye(x.shape[1]) / prior_var + (x * w[:, None]).T @ x / noise_var
    cov = np.linalg.inv(prec)
    return cov @ ((x * w[:, None]).T @ t) / noise_var, cov


def _gauss_kl(m0, c0, m1, c1):
    inv1 = np.linalg.inv(c1)
    d = m1 - m0
    return 0.5 * (
        np.trace(inv1 @ c0) + d @ inv1 @ d - len(m0) + np.linalg.slogdet(c1)[1] - np.linalg.slogdet(c0)[1]
    )


def test_bayesian_linear_regression_coreset_beats_random_subsets():
    """T15 (docs/papers/coreset_pfedbayes.md#t15; the paper's §7.1 experiment on synthetic data):
    KL(pi_w || pi) of the A-IHT coreset posterior does not grow with k and is below the KL of uniform random
    subsets (weights n/k) on average over seeds."""
    n, dim, prior_var, noise_var = 300, 5, 4.0, 0.5
    aiht_kl, random_kl = {}, {}
    with enable_x64():
        for seed in range(3):
            rng = np.random.default_rng(seed)
            x = rng.normal(size=(n, dim)) * rng.uniform(0.2, 3.0, size=(n, 1))  # heterogeneous leverage
            t = x @ rng.normal(size=dim) + rng.normal(scale=np.sqrt(noise_var), size=n)
            mean, cov = _blr_posterior(x, t, np.ones(n), prior_var, noise_var)
            thetas = rng.multivariate_normal(mean, cov, size=500)  # J = 500 samples of the full posterior
            ll = -0.5 * (t[None, :] - thetas @ x.T) ** 2 / noise_var
            y, phi = projected_potentials(jnp.asarray(ll))
            for k in (3, 6, 9, 12):  # below the 20 sufficient statistics of a 5-dimensional model
                w = np.asarray(aiht(y, phi, k, tol=1e-8, max_iter=500).weights)
                aiht_kl.setdefault(k, []).append(
                    _gauss_kl(*_blr_posterior(x, t, w, prior_var, noise_var), mean, cov)
                )
                sub = np.zeros(n)
                sub[rng.choice(n, k, replace=False)] = n / k
                random_kl.setdefault(k, []).append(
                    _gauss_kl(*_blr_posterior(x, t, sub, prior_var, noise_var), mean, cov)
                )
    means = [np.mean(aiht_kl[k]) for k in sorted(aiht_kl)]
    assert all(b <= a for a, b in zip(means, means[1:], strict=False)), means
    for k in aiht_kl:
        assert np.mean(aiht_kl[k]) < np.mean(random_kl[k]), (k, aiht_kl[k], random_kl[k])
