"""HMC and SGLD through blackjax (sidejax/bayes/inference.py): docs/papers/bpcfl.md#t11 (HMC recovers a
Gaussian posterior's mean and variance within Monte-Carlo error; acceptance and the energy error; divergences
are reported), SGLD's stationary law, bad input. Standard errors by batch means over 40 batches (the chains
are autocorrelated); fixed keys."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.bayes.inference import DivergenceWarning, check_divergences, hmc, sgld

MU = np.array([1.0, -2.0, 0.5])
SD = np.array([0.5, 1.0, 2.0])


def _logdensity(theta):
    return -0.5 * jnp.sum(((theta["x"] - MU) / SD) ** 2)


def _gaussian_hmc(seed, step_size, steps, inverse_mass_matrix, burnin, samples, *, start=None, **kwargs):
    """``hmc`` on the test posterior N(MU, diag(SD²)) (``_logdensity``) from ``start`` (zeros by default)."""
    start = {"x": jnp.zeros(3) if start is None else start}
    return hmc(
        jax.random.key(seed),
        _logdensity,
        start,
        step_size=step_size,
        num_integration_steps=steps,
        inverse_mass_matrix=inverse_mass_matrix,
        num_burnin=burnin,
        num_samples=samples,
        **kwargs,
    )


def _batch_se(values, batches=40):
    b = values.reshape(batches, -1, *values.shape[1:]).mean(axis=1)
    return b.mean(axis=0), b.std(axis=0, ddof=1) / np.sqrt(batches)


def test_hmc_recovers_a_gaussian_posterior_mean_and_variance():
    """T11 (docs/papers/bpcfl.md#t11): N(μ, diag(s²)) with M⁻¹ = diag(s²) (ε = 0.2, L = 7, a trajectory that
    is not a resonant half-period): sample mean and variance within 4 batch-means standard errors."""
    out = _gaussian_hmc(0, 0.2, 7, SD**2, 100, 4000)
    x = np.asarray(out.samples["x"], np.float64)
    assert x.shape == (4000, 3) and int(out.num_divergent) == 0
    mean, se = _batch_se(x)
    assert np.all(np.abs(mean - MU) < 4 * se), (mean, se)
    var, se_var = _batch_se((x - MU) ** 2)
    assert np.all(np.abs(var - SD**2) < 4 * se_var), (var, se_var)
    # the acceptance probability is min(1, exp(-ΔH)) of the reported energy error
    acc, err = np.asarray(out.acceptance_rate), np.asarray(out.energy_error)
    np.testing.assert_allclose(acc, np.minimum(1.0, np.exp(-err)), atol=1e-5)


def test_energy_error_is_second_order_and_acceptance_tends_to_one():
    """T11 (docs/papers/bpcfl.md#t11): halving ε along the same trajectory length (L doubled) divides the mean
    |ΔH| by about 4 (leapfrog's global error is O(ε²); with L fixed the shorter trajectory would shrink it
    faster), and acceptance → 1 as ε → 0; independent chains (mode "chains") from the same start give the
    posterior mean."""
    errs = []
    for eps, steps in ((0.04, 10), (0.02, 20), (0.01, 40)):
        out = _gaussian_hmc(1, eps, steps, 1.0, 1, 400, start=jnp.asarray(MU + SD), mode="chains")
        errs.append(float(np.mean(np.abs(np.asarray(out.energy_error, np.float64)))))
    assert 3.0 < errs[0] / errs[1] < 5.0 and 3.0 < errs[1] / errs[2] < 5.0, errs
    assert float(np.mean(np.asarray(out.acceptance_rate))) > 0.999
    out = _gaussian_hmc(2, 0.2, 7, SD**2, 30, 800, mode="chains")
    x = np.asarray(out.samples["x"], np.float64)
    assert np.all(np.abs(x.mean(axis=0) - MU) < 4 * x.std(axis=0, ddof=1) / np.sqrt(800))


def test_divergences_are_reported_not_silent():
    def run(step_size, num_integration_steps):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DivergenceWarning)  # hmc counts, the host boundary warns
            return _gaussian_hmc(0, step_size, num_integration_steps, 1.0, 5, 10)

    out = run(50.0, 10)
    assert int(out.num_divergent) == 15 and bool(np.all(out.divergent))
    with pytest.warns(DivergenceWarning, match=r"15 of 15 transitions diverged.*lower step_size"):
        assert check_divergences(out) is out
    good = run(0.2, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)  # a good step size: no warning
        check_divergences(good)


def test_sgld_reaches_its_discretised_stationary_law_and_minibatches_are_unbiased():
    """Full batch: for N(μ, s²) SGLD is the AR(1) chain x' = a x + √ε ξ, a = 1 − ε/(2s²), whose stationary
    variance is ε/(1 − a²) (the ε-bias made exact); the samples match it within 4 batch-means SE. Minibatch:
    the posterior mean of a Gaussian mean with 200 observations, estimated through (N/b)-scaled batches."""
    eps = 0.05
    out = sgld(
        jax.random.key(3),
        _logdensity,
        {"x": jnp.asarray(MU)},
        step_size=eps,
        num_burnin=200,
        num_samples=8000,
        thinning=10,
    )
    x = np.asarray(out.samples["x"], np.float64)
    a = 1 - eps / (2 * SD**2)
    mean, se = _batch_se(x)
    assert bool(out.finite) and np.all(np.abs(mean - MU) < 4 * se), (mean, se)
    var, se_var = _batch_se((x - MU) ** 2)
    assert np.all(np.abs(var - eps / (1 - a**2)) < 4 * se_var), (var, eps / (1 - a**2), se_var)

    rng = np.random.default_rng(0)
    data = jnp.asarray(rng.normal(1.5, 1.0, size=200), jnp.float32)

    def minibatch_logdensity(theta, batch):  # prior N(0, 10²), unit-variance likelihood, scaled N/b
        return -0.5 * theta**2 / 100.0 - (200 / 20) * 0.5 * jnp.sum((batch - theta) ** 2)

    post_mean = float(data.sum()) / (200 + 1 / 100.0)
    out = sgld(
        jax.random.key(4),
        minibatch_logdensity,
        jnp.float32(0.0),
        step_size=1e-3,
        num_burnin=500,
        num_samples=4000,
        thinning=2,
        data=data,
        batch_size=20,
    )
    m, se = _batch_se(np.asarray(out.samples, np.float64))
    assert abs(m - post_mean) < 4 * se + 0.01, (m, post_mean, se)


def test_bad_input_names_the_argument():
    common = dict(num_integration_steps=5, inverse_mass_matrix=1.0, num_burnin=1, num_samples=2)
    start = {"x": jnp.zeros(3)}
    with pytest.raises(ValueError, match="step_size must be a finite number > 0"):
        hmc(jax.random.key(0), _logdensity, start, step_size=0.0, **common)
    with pytest.raises(ValueError, match="inverse_mass_matrix must be a scalar c"):
        hmc(
            jax.random.key(0),
            _logdensity,
            start,
            step_size=0.1,
            **{**common, "inverse_mass_matrix": [1.0, 2.0]},
        )
    with pytest.raises(ValueError, match="inverse_mass_matrix must be finite and > 0"):
        hmc(jax.random.key(0), _logdensity, start, step_size=0.1, **{**common, "inverse_mass_matrix": -1.0})
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
        hmc(jax.random.key(0), _logdensity, start, step_size=0.1, **{**common, "num_samples": 0})
    with pytest.raises(ValueError, match="mode must be one of"):
        hmc(jax.random.key(0), _logdensity, start, step_size=0.1, mode="parallel", **common)
    with pytest.raises(ValueError, match="batch_size=50 exceeds the 10 examples"):
        sgld(
            jax.random.key(0),
            lambda t, b: -jnp.sum(t**2),
            jnp.zeros(2),
            step_size=0.1,
            num_burnin=1,
            num_samples=1,
            data=jnp.zeros(10),
            batch_size=50,
        )
