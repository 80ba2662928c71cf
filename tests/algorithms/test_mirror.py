"""Mirror descent with the negative binary entropy (sidejax.algorithms.mirror; docs/papers/bicompfl.md#s3-2
and docs/papers/bicompfl.md#s7-19): the Bregman divergence is the Bernoulli KL, grad F = logit and its inverse
the sigmoid, the logit-space step solves the KL-proximal problem (checked by numerical minimisation in
float64), and the Optax transformation on scores reproduces that step through ``optax.apply_updates``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy.optimize import minimize

from sidejax.algorithms.mirror import (
    MIRROR_EPS,
    bregman_divergence,
    inverse_mirror_map,
    kl_prox_step,
    mirror_descent,
    mirror_map,
    neg_entropy,
    scale_by_inverse_sigmoid_jacobian,
)
from sidejax.distributions import Bernoulli


def kl64(p, q):
    """Summed Bernoulli KL in float64 (numpy)."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    return float(np.sum(p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))))


def test_bregman_divergence_is_the_bernoulli_kl():
    # docs/papers/bicompfl.md#s7-19: p = 0.3, q = 0.6 -> 0.18378689738681 nats (float32: a few ulp)
    assert float(bregman_divergence(jnp.float32(0.3), jnp.float32(0.6))) == pytest.approx(
        0.18378689738681, rel=1e-6
    )
    assert kl64(0.3, 0.6) == pytest.approx(0.18378689738681, abs=1e-14)
    rng = np.random.default_rng(0)
    p, q = rng.uniform(0.02, 0.98, 50).astype(np.float32), rng.uniform(0.02, 0.98, 50).astype(np.float32)
    got = float(bregman_divergence(p, q))
    assert got == pytest.approx(kl64(p, q), rel=2e-6)
    assert got == pytest.approx(float(jnp.sum(Bernoulli(p).kl_nats(Bernoulli(q)))), rel=2e-6)
    # summed over pytrees; zero iff p = q; the endpoints of p are fine (0 log 0 = 0)
    tree_p, tree_q = {"a": p[:20], "b": p[20:]}, {"a": q[:20], "b": q[20:]}
    assert float(bregman_divergence(tree_p, tree_q)) == pytest.approx(got, rel=1e-6)
    assert float(bregman_divergence(q, q)) == 0.0
    assert float(bregman_divergence(jnp.array([0.0, 1.0]), jnp.array([0.5, 0.5]))) == pytest.approx(
        2 * np.log(2), rel=1e-6
    )


def test_grad_f_is_logit_and_its_inverse_is_the_sigmoid():
    x = jnp.linspace(0.01, 0.99, 99)
    np.testing.assert_allclose(
        jax.vmap(jax.grad(neg_entropy))(x), jax.scipy.special.logit(x), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(mirror_map(x), jax.scipy.special.logit(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(inverse_mirror_map(mirror_map(x)), x, rtol=1e-6)
    y = jnp.linspace(-6.0, 6.0, 97)
    np.testing.assert_allclose(mirror_map(inverse_mirror_map(y)), y, atol=2e-5)
    np.testing.assert_array_equal(inverse_mirror_map(y), 1 / (jnp.exp(-y) + 1))
    # F is the negative entropy: -ln 2 at 1/2, 0 at the ends, convex
    assert float(neg_entropy(0.5)) == pytest.approx(-np.log(2), rel=1e-7)
    assert float(neg_entropy(0.0)) == 0.0 and float(neg_entropy(1.0)) == 0.0
    assert np.all(np.asarray(jax.vmap(jax.grad(jax.grad(neg_entropy)))(x)) > 0)


def _objective64(x, theta, g, lr):
    """lr <g, x> + D_F(x, theta), in float64 (the KL form of D_F, checked equal to the definition above)."""
    return lr * float(np.dot(g, x)) + kl64(x, theta)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_logit_space_step_solves_the_kl_proximal_problem(dim):
    rng = np.random.default_rng(dim)
    theta = rng.uniform(0.05, 0.95, dim)
    g = rng.normal(0.0, 3.0, dim)
    lr = 0.4
    step = np.asarray(
        kl_prox_step(jnp.asarray(theta, jnp.float32), jnp.asarray(g, jnp.float32), lr), np.float64
    )
    # numerical minimisation (no gradient given: the closed form is not used), from the centre
    res = minimize(
        _objective64,
        np.full(dim, 0.5),
        args=(theta, g, lr),
        method="Nelder-Mead",
        bounds=[(1e-9, 1 - 1e-9)] * dim,
        options={"xatol": 1e-11, "fatol": 1e-15, "maxiter": 20000},
    )
    assert res.success
    np.testing.assert_allclose(step, res.x, atol=1e-6)

    # and it is a minimum of the library's own objective (float32, its bregman_divergence)
    def objective32(x):
        return lr * jnp.dot(jnp.asarray(g, jnp.float32), x) + bregman_divergence(
            x, jnp.asarray(theta, jnp.float32)
        )

    best = float(objective32(jnp.asarray(step, jnp.float32)))
    for k in range(dim):
        for delta in (-1e-3, 1e-3):
            assert float(objective32(jnp.asarray(step, jnp.float32).at[k].add(delta))) > best
    if dim == 1:  # a fine grid (spacing 5e-7) agrees too
        x = np.linspace(1e-6, 1 - 1e-6, 2_000_001)
        values = lr * g[0] * x + x * np.log(x / theta[0]) + (1 - x) * np.log((1 - x) / (1 - theta[0]))
        assert step[0] == pytest.approx(x[np.argmin(values)], abs=1e-6)


def _loss_theta(theta):
    """A smooth, non-separable loss of the probabilities (cross terms and a nonlinearity)."""
    return jnp.sum(jnp.sin(3 * theta["w"]) * theta["w"]) + jnp.sum(theta["b"]) * jnp.sum(theta["w"] ** 2)


def _scores_and_grads():
    s = {"w": jnp.array([-3.0, -0.5, 0.0, 1.2, 4.0]), "b": jnp.array([0.7, -2.0])}
    theta = jax.tree.map(jax.nn.sigmoid, s)
    grad_s = jax.grad(lambda s_: _loss_theta(jax.tree.map(jax.nn.sigmoid, s_)))(s)
    grad_theta = jax.grad(_loss_theta)(theta)
    return s, theta, grad_s, grad_theta


def test_transformation_update_is_the_kl_prox_step_through_apply_updates():
    s, theta, grad_s, grad_theta = _scores_and_grads()
    lr = 0.3
    tx = mirror_descent(lr)
    state = tx.init(s)

    @jax.jit
    def step(s, state):
        updates, state = tx.update(grad_s, state, s)
        return optax.apply_updates(s, updates), updates

    new_s, updates = step(s, state)
    # the updates are -lr * grad_theta (the sigmoid Jacobian divided out) ...
    for k in s:
        np.testing.assert_allclose(updates[k], -lr * grad_theta[k], rtol=1e-5, atol=1e-7)
        # ... so the new scores are SGD in logit space and their sigmoid is the KL-proximal step
        np.testing.assert_allclose(new_s[k], s[k] - lr * grad_theta[k], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(
            jax.nn.sigmoid(new_s[k]), kl_prox_step(theta, grad_theta, lr)[k], rtol=2e-6, atol=1e-7
        )
    # a schedule is applied by step count (optax.scale_by_learning_rate)
    tx_s = mirror_descent(optax.constant_schedule(lr))
    upd_s, _ = tx_s.update(grad_s, tx_s.init(s), s)
    for k in s:
        np.testing.assert_allclose(upd_s[k], updates[k], rtol=1e-6)


def test_jacobian_guard_and_validation():
    # far outside [eps, 1 - eps] the Jacobian is evaluated at the clip: finite, shorter steps, never inf
    s = jnp.array([-40.0, -20.0, 20.0, 40.0, 0.0])
    g = jnp.full(5, 0.25)
    upd, _ = scale_by_inverse_sigmoid_jacobian().update(g, optax.EmptyState(), s)
    jac_eps = MIRROR_EPS * (1 - MIRROR_EPS)
    np.testing.assert_allclose(upd[:4], 0.25 / jac_eps, rtol=1e-5)
    assert float(upd[4]) == pytest.approx(1.0)  # theta = 1/2: 0.25 / 0.25
    # exactly at the clip edge the guard is inactive
    edge = jnp.log(MIRROR_EPS) - jnp.log1p(-MIRROR_EPS)
    upd_edge, _ = scale_by_inverse_sigmoid_jacobian().update(jnp.ones(1), optax.EmptyState(), edge[None])
    assert float(upd_edge[0]) == pytest.approx(1 / jac_eps, rel=1e-5)
    with pytest.raises(ValueError, match="needs params"):
        mirror_descent(0.1).update(g, mirror_descent(0.1).init(s))
    for bad in (0.0, -0.1, "fast"):
        with pytest.raises(ValueError, match="learning_rate"):
            mirror_descent(bad)
    for bad in (0.0, 0.5, -1.0):
        with pytest.raises(ValueError, match="eps"):
            mirror_descent(0.1, eps=bad)
