"""Factorized distributions (sidejax.distributions): KL formulas, validation, inverse-CDF sampling.

Closed forms or float64 numpy are the references (docs/papers/klms.md#s7-6).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.bits import LN2
from sidejax.distributions import Bernoulli, DiagGaussian, Sign, Ternary


def test_kl_formulas():
    phi = jnp.array([0.2, 0.5, 0.9, 0.01, 0.99])
    theta = jnp.array([0.5, 0.5, 0.1, 0.99, 0.01])
    kl = np.asarray(Bernoulli(phi).kl_nats(Bernoulli(theta)), np.float64)
    f, t = np.asarray(phi, np.float64), np.asarray(theta, np.float64)
    ref = f * np.log(f / t) + (1 - f) * np.log((1 - f) / (1 - t))
    np.testing.assert_allclose(kl, ref, rtol=1e-5)
    assert kl[1] == 0 and (kl >= 0).all() and np.isfinite(kl).all()  # clipped to [0.01, 0.99]: finite
    np.testing.assert_allclose(Bernoulli(phi).kl_bits(Bernoulli(theta)), kl / LN2, rtol=1e-6)
    g = DiagGaussian(jnp.array([0.8, -1.0]), jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(g.kl_nats(DiagGaussian(jnp.zeros(2), g.scale)), [0.32, 0.125], rtol=1e-6)
    qt = np.array([[0.2, 0.3, 0.5], [0.0, 1.0, 0.0]])
    pt = np.array([[1 / 3] * 3, [0.25, 0.5, 0.25]])
    direct = [
        sum(a * math.log(a / b) for a, b in zip(qr, pr, strict=True) if a > 0)
        for qr, pr in zip(qt, pt, strict=True)
    ]
    np.testing.assert_allclose(Ternary(jnp.asarray(qt)).kl_nats(Ternary(jnp.asarray(pt))), direct, rtol=1e-5)
    np.testing.assert_allclose(Sign(phi).kl_nats(Sign(theta)), kl, rtol=1e-6)


def test_constructors_validate():
    with pytest.raises(ValueError, match="probs"):
        Bernoulli.create([0.5, 1.2])
    with pytest.raises(ValueError, match="probs"):
        Ternary.create([[0.5, 0.5, 0.5]])
    with pytest.raises(ValueError, match="scale"):
        DiagGaussian.create([0.0], [0.0])


@pytest.mark.parametrize("bad", [1.5, -0.2, float("nan")])
def test_distributions_reject_bad_parameters_on_the_host_and_flag_them_in_jit(bad):
    """Regression (issue 12): Bernoulli([.., 1.5]) (or -0.2, NaN) built silently and gave a NaN rate and a
    collapsed partition downstream. Concrete values raise naming the argument; traced ones are flagged by
    is_valid(); rebuilding from leaves (tree.map) does not re-check."""
    probs = np.array([0.5, bad, 0.2], np.float32)
    for cls in (Bernoulli, Sign):
        with pytest.raises(ValueError, match=f"{cls.__name__} probs must hold probabilities in \\[0, 1\\]"):
            cls(jnp.asarray(probs))
        with pytest.raises(ValueError, match=f"{cls.__name__} probs"):
            cls(probs.tolist())
        assert not bool(jax.jit(lambda a, cls=cls: cls(a).is_valid())(jnp.asarray(probs)))
        assert bool(jax.jit(lambda a, cls=cls: cls(a).is_valid())(jnp.full(3, 0.3)))
    tern = np.array([[0.2, 0.3, 0.5], [bad, 0.5, 0.5 - bad]], np.float32)
    with pytest.raises(ValueError, match="Ternary probs"):
        Ternary(jnp.asarray(tern))
    assert not bool(jax.jit(lambda a: Ternary(a).is_valid())(jnp.asarray(tern)))
    with pytest.raises(ValueError, match="DiagGaussian scale"):
        DiagGaussian(jnp.zeros(3), jnp.asarray([1.0, bad - 1.5, 1.0]))  # 0, -1.7 or NaN
    with pytest.raises(ValueError, match="DiagGaussian loc"):
        DiagGaussian(jnp.asarray([0.0, float("inf"), 0.0]), jnp.ones(3))
    g = jax.jit(lambda s: DiagGaussian(jnp.zeros(3), s).is_valid())
    assert not bool(g(jnp.asarray([1.0, bad - 1.5, 1.0]))) and bool(g(jnp.ones(3)))
    # pytree utilities rebuild without checking (their leaves need not be probabilities)
    scaled = jax.tree.map(lambda a: a * 3, Bernoulli(jnp.full(2, 0.5)))
    assert isinstance(scaled, Bernoulli) and float(scaled.probs[0]) == 1.5


def test_icdf_sampling_matches_means():
    u = (jnp.arange(100000) + 0.5) / 100000  # a quasi-uniform grid: exact frequencies
    np.testing.assert_allclose(Bernoulli(jnp.full(1, 0.3)).icdf(u[:, None]).mean(), 0.3, atol=1e-5)
    t = Ternary(jnp.array([[0.2, 0.5, 0.3]]))
    np.testing.assert_allclose(t.icdf(u[:, None]).mean(), 0.1, atol=1e-5)
    assert float(t.log_prob(jnp.array([1.0]))[0]) == pytest.approx(math.log(0.3), rel=1e-6)


def test_uniforms_are_strictly_inside_the_unit_interval():
    from sidejax.distributions import bits_to_open_uniform

    extremes = bits_to_open_uniform(jnp.array([0, 2**32 - 1], jnp.uint32))
    assert 0.0 < float(extremes[0]) and float(extremes[1]) < 1.0
    assert np.isfinite(DiagGaussian(jnp.zeros(2), jnp.ones(2)).icdf(extremes)).all()
