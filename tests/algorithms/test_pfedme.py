"""pFedMe (sidejax.algorithms.pfedme; docs/papers/coreset_pfedbayes.md#pfedme), against the closed forms of a
quadratic loss: the K-step inner solve is gradient descent on the proximal problem and converges to the
Moreau envelope's proximal point, the local step is a gradient step on the envelope
(``∇F(w) = λ(w − θ̂(w))``), the limits ``λ → 0`` (independent personal models, ``w`` still) and ``λ → ∞``
(SGD on ``f``), a whole round through the engine (R warm-started iterations, the personal model), the
server's ``β``; bad settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.algorithms import PFedMeSettings, pfedme
from sidejax.algorithms.pfedme import pfedme_inner, pfedme_local_step
from sidejax.data import make_federated_data
from sidejax.fl import Batch, masked_mean, run_rounds
from sidejax.utils import enable_x64

D = 3
A = np.array([[2.0, 0.5, 0.0], [0.5, 1.0, 0.3], [0.0, 0.3, 0.5]])  # SPD, eigenvalues in (0.3, 2.3)


def quadratic_loss(params, batch, key):
    """``mean_j ½ (θ − x_j)ᵀ A (θ − x_j)`` over the valid rows: ``½ (θ − c)ᵀ A (θ − c)`` + const with ``c``
    the valid rows' mean (the minimiser)."""
    del key
    r = params["w"] - batch.x
    return masked_mean(0.5 * jnp.einsum("bi,ij,bj->b", r, jnp.asarray(A, jnp.float32), r), batch.mask)


def _batch(seed=0):
    """Six rows, the last two padding: ``c`` is the mean of the first four."""
    x = np.random.default_rng(seed).normal(size=(6, D)).astype(np.float32)
    mask = np.array([1, 1, 1, 1, 0, 0], np.float32)
    return Batch(jnp.asarray(x), jnp.zeros(6, jnp.int32), jnp.asarray(mask)), x[:4].mean(0).astype(np.float64)


def prox_point(w, c, lam):
    """``θ̂(w) = argmin ½(θ − c)ᵀA(θ − c) + λ/2 ‖θ − w‖² = (A + λI)⁻¹ (A c + λ w)``."""
    return np.linalg.solve(A + lam * np.eye(D), A @ c + lam * w)


W = np.array([0.7, -1.2, 0.4])
THETA0 = np.array([-0.3, 0.8, 1.5])


def _run_inner(settings, w=W, theta=THETA0):
    batch, c = _batch()
    theta, _ = pfedme_inner(
        quadratic_loss, settings, {"w": jnp.asarray(theta, jnp.float32)}, {"w": jnp.asarray(w, jnp.float32)},
        batch, jax.random.key(0),
    )  # fmt: skip
    return np.asarray(theta["w"], np.float64), c


@pytest.mark.parametrize("steps", [1, 5])
def test_inner_solve_is_gradient_descent_on_the_proximal_problem(steps):
    """``K`` steps at rate ``p`` from ``θ₀``: ``θ̂ + (I − p(A + λI))^K (θ₀ − θ̂)`` exactly (float32)."""
    s = PFedMeSettings(lam=1.5, personal_lr=0.2, inner_steps=steps)
    theta, c = _run_inner(s)
    target = prox_point(W, c, s.lam)
    contraction = np.linalg.matrix_power(np.eye(D) - s.personal_lr * (A + s.lam * np.eye(D)), steps)
    np.testing.assert_allclose(theta, target + contraction @ (THETA0 - target), rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(theta - target) > 1e-3  # a few steps are not there yet


def test_inner_solve_converges_to_the_moreau_proximal_point():
    """With enough steps (contraction ≤ 0.64 per step) the solve reaches ``θ̂(w)`` whatever the start, and
    ``θ̂`` is the minimiser of ``f(θ) + λ/2‖θ − w‖²`` (its gradient vanishes there)."""
    s = PFedMeSettings(lam=1.5, personal_lr=0.2, inner_steps=60)
    for start in (THETA0, W, np.zeros(D)):
        theta, c = _run_inner(s, theta=start)
        np.testing.assert_allclose(theta, prox_point(W, c, s.lam), atol=2e-6)
    grad = A @ (theta - c) + s.lam * (theta - W)
    assert np.linalg.norm(grad) < 1e-5


def moreau_envelope(w, c, lam):
    """``F(w) = min_θ f(θ) + λ/2‖θ − w‖²`` at the closed-form minimiser (differentiable in ``w``)."""
    theta = jnp.linalg.solve(A + lam * jnp.eye(D), A @ c + lam * w)
    return 0.5 * (theta - c) @ A @ (theta - c) + 0.5 * lam * jnp.sum((theta - w) ** 2)


def test_local_step_is_a_gradient_step_on_the_moreau_envelope():
    """``w ← w − ηλ(w − θ)`` with a converged ``θ`` is ``w − η ∇F(w)``, ``∇F`` the autodiff gradient of the
    closed-form envelope (float64), which is also ``λA(A + λI)⁻¹(w − c)`` (the envelope of a quadratic is the
    quadratic with matrix ``(A⁻¹ + I/λ)⁻¹``); ``θ`` returned is the proximal point."""
    s = PFedMeSettings(lam=1.5, personal_lr=0.2, lr=0.3, inner_steps=60)
    batch, c = _batch()
    to32 = lambda v: {"w": jnp.asarray(v, jnp.float32)}
    w_new, theta, _ = pfedme_local_step(quadratic_loss, s, to32(W), to32(THETA0), batch, jax.random.key(0))
    with enable_x64():
        grad_env = np.asarray(jax.grad(moreau_envelope)(jnp.asarray(W), jnp.asarray(c), s.lam))
    np.testing.assert_allclose(
        grad_env, s.lam * A @ np.linalg.solve(A + s.lam * np.eye(D), W - c), rtol=1e-10
    )
    np.testing.assert_allclose(np.asarray(w_new["w"]), W - s.lr * grad_env, atol=2e-6)
    np.testing.assert_allclose(np.asarray(theta["w"]), prox_point(W, c, s.lam), atol=2e-6)


def test_lambda_limits():
    """``λ → 0``: the personal model is the local minimiser ``c`` (independent learning) and ``w`` does not
    move; ``λ → ∞``: ``θ → w`` and the local step is plain gradient descent on ``f`` at rate ``η``."""
    batch, c = _batch()
    to32 = lambda v: {"w": jnp.asarray(v, jnp.float32)}
    small = PFedMeSettings(lam=1e-4, personal_lr=0.5, lr=0.3, inner_steps=200)
    w_new, theta, _ = pfedme_local_step(quadratic_loss, small, to32(W), to32(W), batch, jax.random.key(0))
    np.testing.assert_allclose(np.asarray(theta["w"]), c, atol=1e-3)
    np.testing.assert_allclose(np.asarray(w_new["w"]), W, atol=1e-4)
    lam = 1e4
    large = PFedMeSettings(lam=lam, personal_lr=1.0 / (lam + 3.0), lr=0.3, inner_steps=20)
    w_new, theta, _ = pfedme_local_step(quadratic_loss, large, to32(W), to32(W), batch, jax.random.key(0))
    sgd = W - large.lr * A @ (W - c)
    np.testing.assert_allclose(np.asarray(theta["w"]), W, atol=1e-3)
    np.testing.assert_allclose(np.asarray(w_new["w"]), sgd, atol=1e-3)
    assert np.linalg.norm(sgd - W) > 0.3  # the step itself is large: the agreement is not trivial


def _one_client(c, n=12):
    x = np.tile(np.asarray(c, np.float32), (n, 1))  # every example the same: each minibatch is f itself
    return make_federated_data(x, np.zeros(n, np.int32), [np.arange(n)])


def test_a_round_is_R_envelope_steps_with_warm_started_inner_solves():
    """One client whose minibatches all give ``f = ½(θ − c)ᵀA(θ − c)``: the round's upload (the server's new
    model, ``β = 1``) and personal model are the closed-form recursion ``θ ← K GD steps from θ`` (starting at
    ``w⁰``, carried across iterations), ``w ← w − ηλ(w − θ)``, ``R`` times; with ``personal = "local"`` the
    personal model is the local model ``w_R``."""
    c = np.array([1.0, -2.0, 0.5])
    s = PFedMeSettings(lam=2.0, personal_lr=0.15, lr=0.1, inner_steps=3, local_iters=7, batch_size=4)
    algo, w0 = pfedme(quadratic_loss, clients_per_round=1, settings=s), {"w": jnp.asarray(W, jnp.float32)}
    state = algo.init(jax.random.key(0), w0, 1)
    state, info = run_rounds(algo, jax.random.key(1), state, _one_client(c), 1)
    w, theta = W.copy(), W.copy()
    for _ in range(s.local_iters):
        for _ in range(s.inner_steps):
            theta = theta - s.personal_lr * (A @ (theta - c) + s.lam * (theta - w))
        w = w - s.lr * s.lam * (w - theta)
    np.testing.assert_allclose(np.asarray(state.server.params["w"]), w, atol=2e-6)
    np.testing.assert_allclose(np.asarray(algo.evaluation.personal(state)["w"][0]), theta, atol=2e-6)
    assert int(info.clients.extra[0, 0]) == s.local_iters and int(info.uplink_bits[0, 0]) == 32 * D
    # personal = "local" (pFedMe's code's evaluation): the local model, here the one client's upload
    local = pfedme(quadratic_loss, clients_per_round=1, settings=s._replace(personal="local"))
    state, _ = run_rounds(local, jax.random.key(1), local.init(jax.random.key(0), w0, 1), _one_client(c), 1)
    np.testing.assert_array_equal(local.evaluation.personal(state)["w"][0], state.server.params["w"])


def test_server_beta_mixes_the_old_model_and_the_clients_mean():
    """``w ← (1 − β) w + β · mean``: with the same keys the clients' uploads do not depend on ``β``, so the
    ``β = 2`` model (the paper's other setting) is the mix ``−w⁰ + 2 · mean`` of ``w⁰`` and the ``β = 1``
    model (the plain mean)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(30, D)).astype(np.float32)
    fed = make_federated_data(x, np.zeros(30, np.int32), [np.arange(10), np.arange(10, 30)])
    w0 = {"w": jnp.asarray(W, jnp.float32)}
    models = {}
    for beta in (1.0, 2.0):
        s = PFedMeSettings(
            lam=2.0, personal_lr=0.15, lr=0.1, inner_steps=2, local_iters=3, batch_size=4, beta=beta
        )
        algo = pfedme(quadratic_loss, clients_per_round=2, settings=s)
        state, _ = run_rounds(algo, jax.random.key(1), algo.init(jax.random.key(0), w0, 2), fed, 1)
        models[beta] = np.asarray(state.server.params["w"], np.float64)
    np.testing.assert_allclose(models[2.0], -W + 2 * models[1.0], atol=4e-6)
    assert np.linalg.norm(models[1.0] - W) > 0.05


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(lam=0.0), "settings.lam"),
        (dict(personal_lr=float("inf")), "settings.personal_lr"),
        (dict(beta=-1.0), "settings.beta"),
        (dict(inner_steps=0), "settings.inner_steps"),
        (dict(batch_size=2.5), "settings.batch_size"),
        (dict(personal="theta"), "settings.personal must be one of"),
    ],
)
def test_bad_settings_name_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        pfedme(quadratic_loss, clients_per_round=1, settings=PFedMeSettings()._replace(**change))
    with pytest.raises(ValueError, match="settings must be a PFedMeSettings"):
        pfedme(quadratic_loss, clients_per_round=1, settings={"lam": 1.0})
