"""Per-FedAvg (sidejax.algorithms.perfedavg; docs/papers/coreset_pfedbayes.md#perfedavg), against the closed
forms of quadratic losses: the local step is the MAML meta-gradient step (HF: with the exact Hessian-vector
product, equal to the autodiff gradient of ``f(w − α∇f(w))``; FO: without the Hessian term), each of its
gradients on its own minibatch; a whole round through the engine (R steps) and the personal model (one
gradient step from the received model on all of the client's data); bad settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.algorithms import PerFedAvgSettings, perfedavg
from sidejax.algorithms.perfedavg import perfedavg_step
from sidejax.data import make_federated_data
from sidejax.fl import Batch, masked_mean, run_rounds
from sidejax.utils import enable_x64

D = 3
A = np.array([[2.0, 0.5, 0.0], [0.5, 1.0, 0.3], [0.0, 0.3, 0.5]])  # SPD


def scaled_quadratic(params, batch, key):
    """``mean_j ½ y_j (θ − x_j)ᵀ A (θ − x_j)`` over the valid rows: a batch of equal rows ``(c, s)`` is
    ``½ s (θ − c)ᵀ A (θ − c)``, gradient ``s A (θ − c)``, Hessian ``s A``."""
    del key
    r = params["w"] - batch.x
    quad = jnp.einsum("bi,ij,bj->b", r, jnp.asarray(A, r.dtype), r)
    return masked_mean(0.5 * batch.y * quad, batch.mask)


W = np.array([0.7, -1.2, 0.4])
CENTRES = np.array([[1.0, 0.0, -1.0], [-0.5, 2.0, 0.3], [0.2, -0.7, 1.1]])
SCALES = np.array([1.5, 0.6, 2.2])


def _batches(rows=4):
    """Batches ``D, D', D''``: batch ``k`` holds ``rows`` copies of ``(CENTRES[k], SCALES[k])`` (one padding
    row, pointing elsewhere)."""
    x = np.repeat(CENTRES[:, None, :], rows, axis=1).astype(np.float32)
    y = np.repeat(SCALES[:, None], rows, axis=1).astype(np.float32)
    x[:, -1] = 9.0
    mask = np.ones((3, rows), np.float32)
    mask[:, -1] = 0
    return Batch(jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)), jax.vmap(jax.random.key)(jnp.arange(3))


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_local_step_is_the_maml_meta_gradient_step(variant):
    """``w̃ = w − α s₁A(w − c₁)``, ``g = s₂A(w̃ − c₂)``; FO: ``w − βg``; HF: ``w − β(I − α s₃A) g``: each
    gradient on its own minibatch, the Hessian on ``D''``."""
    s = PerFedAvgSettings(alpha=0.3, beta=0.2, variant=variant)
    batches, keys = _batches()
    count = 3 if variant == "hf" else 2
    batches, keys = jax.tree.map(lambda a: a[:count], batches), keys[:count]
    w, _ = perfedavg_step(scaled_quadratic, s, {"w": jnp.asarray(W, jnp.float32)}, batches, keys)
    adapted = W - s.alpha * SCALES[0] * A @ (W - CENTRES[0])
    g = SCALES[1] * A @ (adapted - CENTRES[1])
    if variant == "hf":
        g = (np.eye(D) - s.alpha * SCALES[2] * A) @ g
    np.testing.assert_allclose(np.asarray(w["w"]), W - s.beta * g, rtol=1e-5, atol=1e-6)


def test_hessian_free_step_is_the_exact_gradient_of_the_one_step_objective():
    """With ``D = D' = D''`` the HF step is ``w − β∇F(w)``, ``F(w) = f(w − α∇f(w))`` differentiated by
    autodiff (float64, on a non-quadratic loss, where the Hessian varies with ``w``); the FO step differs
    from it by the Hessian term."""

    def loss(params, batch, key):
        del key
        z = batch.x @ params["w"]
        return masked_mean(jnp.log1p(jnp.exp(-batch.y * z)) + 0.1 * z**4, batch.mask)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, D))
    y = np.sign(rng.normal(size=8))
    with enable_x64():
        batch = Batch(jnp.asarray(x), jnp.asarray(y), jnp.ones(8))
        batches = jax.tree.map(lambda a: jnp.stack([a] * 3), batch)
        keys = jax.vmap(jax.random.key)(jnp.arange(3))
        w = {"w": jnp.asarray(W)}
        s = PerFedAvgSettings(alpha=0.4, beta=0.1, variant="hf")
        one_step = lambda v: loss(
            jax.tree.map(lambda a, g: a - s.alpha * g, v, jax.grad(loss)(v, batch, 0)), batch, 0
        )
        meta = jax.jit(jax.grad(one_step))(w)["w"]
        step = jax.jit(perfedavg_step, static_argnums=(0, 1))
        hf, _ = step(loss, s, w, batches, keys)
        fo, _ = step(loss, s._replace(variant="fo"), w, jax.tree.map(lambda a: a[:2], batches), keys[:2])
    np.testing.assert_allclose(np.asarray(hf["w"]), W - s.beta * np.asarray(meta), rtol=1e-12)
    assert np.linalg.norm(np.asarray(fo["w"]) - np.asarray(hf["w"])) > 1e-3


def test_a_round_is_R_meta_steps_and_the_personal_model_is_one_step():
    """Two clients whose examples are all equal (every minibatch is ``f_i = ½ s_i (θ − c_i)ᵀA(θ − c_i)``): the
    round's mean (equal sizes, ``β``-free plain mean) is the mean of ``R`` closed-form FO steps per client,
    and each personal model is ``w⁰ − α s_i A(w⁰ − c_i)``, one step from the model the client received."""
    s = PerFedAvgSettings(alpha=0.3, beta=0.2, local_iters=5, batch_size=3)
    n = 7
    x = np.concatenate([np.tile(CENTRES[i], (n, 1)) for i in range(2)]).astype(np.float32)
    y = np.repeat(SCALES[:2], n).astype(np.float32)
    fed = make_federated_data(x, y, [np.arange(n), np.arange(n, 2 * n)])
    algo = perfedavg(scaled_quadratic, clients_per_round=2, settings=s)
    state = algo.init(jax.random.key(0), {"w": jnp.asarray(W, jnp.float32)}, 2)
    state, info = run_rounds(algo, jax.random.key(1), state, fed, 1)
    finals = []
    for i in range(2):
        grad = lambda v, i=i: SCALES[i] * A @ (v - CENTRES[i])
        w = W.copy()
        for _ in range(s.local_iters):
            w = w - s.beta * grad(w - s.alpha * grad(w))
        finals.append(w)
        personal = np.asarray(algo.evaluation.personal(state)["w"][i])
        np.testing.assert_allclose(personal, W - s.alpha * grad(W), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.server.params["w"]), np.mean(finals, 0), rtol=1e-5, atol=1e-6)
    # 7 examples in batches of 3: the third step of every epoch has one example, never none
    assert np.asarray(info.clients.extra).tolist() == [[s.local_iters] * 2]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(alpha=0.0), "settings.alpha"),
        (dict(beta=float("nan")), "settings.beta"),
        (dict(local_iters=0), "settings.local_iters"),
        (dict(variant="so"), "settings.variant must be one of"),
    ],
)
def test_bad_settings_name_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        perfedavg(scaled_quadratic, clients_per_round=1, settings=PerFedAvgSettings()._replace(**change))
