"""Mirror descent on Bernoulli mask probabilities with the negative binary entropy (BICompFL App. B).

BICompFL trains the mask probabilities :math:`\\theta \\in (0, 1)^d` through scores
:math:`s = \\sigma^{-1}(\\theta)` and calls this mirror descent with a KL proximity term (App. B;
docs/papers/bicompfl.md#s3-2 "Mirror-descent view"). With the mirror map

.. math::

    F(x) = \\sum_k x_k \\log x_k + (1 - x_k) \\log(1 - x_k)\\quad\\text{(negative binary entropy)},\\qquad
    \\nabla F(x) = \\log x - \\log(1 - x) = \\mathrm{logit}(x),\\qquad
    (\\nabla F)^{-1}(y) = \\frac{1}{e^{-y} + 1} = \\sigma(y),

the Bregman divergence is the Bernoulli KL summed over coordinates,

.. math::

    D_F(p, q) = F(p) - F(q) - \\langle \\nabla F(q), p - q \\rangle
             = \\sum_k p_k \\log\\frac{p_k}{q_k} + (1-p_k) \\log\\frac{1-p_k}{1-q_k},

and the mirror-descent step for a loss :math:`f` with step size :math:`\\eta`,

.. math::

    \\theta^+ = \\arg\\min_{x \\in (0,1)^d}\\; \\eta \\langle \\nabla_\\theta f(\\theta), x \\rangle
        + D_F(x, \\theta),

has the closed form :math:`\\mathrm{logit}(\\theta^+) = \\mathrm{logit}(\\theta) - \\eta\\, \\nabla_\\theta
f(\\theta)` (set the gradient :math:`\\eta g + \\mathrm{logit}(x) - \\mathrm{logit}(\\theta)` to zero; the
objective is strictly convex and separable): :func:`kl_prox_step`. In score space that is plain SGD on
:math:`\\nabla_\\theta f`, i.e. on :math:`\\nabla_s f / (\\theta (1 - \\theta))` since
:math:`\\nabla_s f = \\nabla_\\theta f \\odot \\theta(1-\\theta)`: :func:`mirror_descent`, an Optax
transformation on the scores.

Note (docs/papers/bicompfl.md#s3-2 [A]): the paper's Alg. 1 steps along :math:`\\nabla_s f` itself and uses
Adam, which is a KL-proximal-like step but not exact mirror descent; ``update_rule = "mirror"`` (this module)
exists for the theory (Theorem 1's :math:`|q - p| \\le \\rho` assumption comes from this step).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.scipy.special import xlogy

from sidejax.utils import check_number

__all__ = [
    "MIRROR_EPS",
    "neg_entropy",
    "mirror_map",
    "inverse_mirror_map",
    "bregman_divergence",
    "kl_prox_step",
    "scale_by_inverse_sigmoid_jacobian",
    "mirror_descent",
]

#: The probability clip of docs/papers/bicompfl.md#s2 (FedPM's 0.01): the Jacobian :math:`\theta(1-\theta)` is
#: guarded with :math:`\theta` clipped to [MIRROR_EPS, 1 - MIRROR_EPS].
MIRROR_EPS = 0.01


def neg_entropy(x):
    """The mirror map's potential :math:`F(x) = x \\log x + (1-x) \\log(1-x)`, elementwise (0 at 0 and 1)."""
    return xlogy(x, x) + xlogy(1 - x, 1 - x)


def mirror_map(x):
    """:math:`\\nabla F(x) = \\log x - \\log(1 - x) = \\mathrm{logit}(x)`, elementwise (primal to dual)."""
    return jnp.log(x) - jnp.log1p(-x)


def inverse_mirror_map(y):
    """:math:`(\\nabla F)^{-1}(y) = 1 / (e^{-y} + 1) = \\sigma(y)`, elementwise (dual to primal)."""
    return jax.nn.sigmoid(y)


def bregman_divergence(p, q) -> jax.Array:
    """:math:`D_F(p, q) = F(p) - F(q) - \\langle \\nabla F(q), p - q \\rangle` of the negative binary entropy.

    Computed from that definition (not from the KL formula it equals,
    :math:`\\sum_k d_{KL}(p_k \\| q_k)`), summed over every coordinate of the pytrees ``p`` and ``q`` (same
    structure; ``p`` in [0, 1], ``q`` in (0, 1)). Returns a scalar.
    """
    terms = jax.tree.map(
        lambda a, b: jnp.sum(neg_entropy(a) - neg_entropy(b) - mirror_map(b) * (a - b)), p, q
    )
    return sum(jax.tree.leaves(terms), jnp.float32(0))


def kl_prox_step(theta, grad_theta, learning_rate):
    """The mirror-descent (KL-proximal) step :math:`\\sigma(\\mathrm{logit}(\\theta) - \\eta\\, g)`.

    The unique minimiser over :math:`x \\in (0,1)^d` of :math:`\\eta \\langle g, x \\rangle +
    D_F(x, \\theta)` (module docstring). Elementwise over pytrees ``theta`` (in (0, 1)) and ``grad_theta``
    (:math:`g = \\nabla_\\theta f(\\theta)`); ``learning_rate`` is :math:`\\eta`.
    """
    return jax.tree.map(lambda t, g: inverse_mirror_map(mirror_map(t) - learning_rate * g), theta, grad_theta)


def _check_eps(eps) -> None:
    check_number(eps, "eps", "a number in (0, 0.5) (the probability clip)", lambda x: 0 < x < 0.5)


def scale_by_inverse_sigmoid_jacobian(eps: float = MIRROR_EPS) -> optax.GradientTransformation:
    """Turns gradients w.r.t. scores into gradients w.r.t. probabilities: ``g_s / (theta (1 - theta))``.

    With :math:`\\theta = \\sigma(s)` the chain rule gives :math:`\\nabla_s f = \\nabla_\\theta f \\odot
    \\theta (1 - \\theta)`, so dividing by the sigmoid's Jacobian recovers :math:`\\nabla_\\theta f`. The
    Jacobian vanishes as :math:`|s| \\to \\infty` (in float32 :math:`1 - \\sigma(s) = 0` for
    :math:`s > 17`), so it is evaluated at :math:`\\theta` clipped to :math:`[\\epsilon, 1 - \\epsilon]`
    (``eps``, default 0.01, docs/papers/bicompfl.md#s2), as :math:`\\sigma(s_c)\\sigma(-s_c)` with
    :math:`s_c = \\mathrm{clip}(s, \\mathrm{logit}\\,\\epsilon, -\\mathrm{logit}\\,\\epsilon)` (no
    cancellation in :math:`1 - \\theta`). Inside :math:`[\\epsilon, 1 - \\epsilon]` the result is exactly
    :math:`\\nabla_\\theta f`; outside it is :math:`\\nabla_\\theta f \\cdot \\theta(1-\\theta) /
    (\\epsilon(1-\\epsilon)) `, a shorter step, never an infinite one. Needs ``params`` (the scores).
    """
    _check_eps(eps)
    bound = math.log(eps) - math.log1p(-eps)  # logit(eps) < 0

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "scale_by_inverse_sigmoid_jacobian needs params (the scores s, theta = sigmoid(s)): call "
                "update(grads, state, params)"
            )

        def divide(g, s):
            sc = jnp.clip(s, bound, -bound)
            jac = jax.nn.sigmoid(sc) * jax.nn.sigmoid(-sc)
            return (g / jac).astype(g.dtype)

        return jax.tree.map(divide, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def mirror_descent(
    learning_rate: optax.ScalarOrSchedule, *, eps: float = MIRROR_EPS
) -> optax.GradientTransformation:
    """Mirror descent with the negative binary entropy, as an Optax transformation on mask **scores**.

    Given gradients w.r.t. the scores :math:`s` (:math:`\\theta = \\sigma(s)`) it returns the updates
    :math:`-\\eta\\, \\nabla_s f / (\\theta(1-\\theta)) = -\\eta\\, \\nabla_\\theta f`, so that
    ``optax.apply_updates(s, updates)`` is :math:`\\mathrm{logit}(\\theta) - \\eta \\nabla_\\theta f` and
    :math:`\\sigma` of it is :func:`kl_prox_step`: plain SGD in logit space on :math:`\\nabla_\\theta f`
    (docs/papers/bicompfl.md#s3-2, ``update_rule = "mirror"``). The Jacobian is guarded with ``eps``
    (:func:`scale_by_inverse_sigmoid_jacobian`): exact while :math:`\\theta \\in [\\epsilon, 1-\\epsilon]`,
    where BICompFL keeps every prior and target.

    Args:
      learning_rate: :math:`\\eta > 0`, or an Optax schedule (step count to step size).
      eps: the probability clip of the Jacobian guard, in (0, 0.5).

    Returns:
      ``optax.chain(scale_by_inverse_sigmoid_jacobian(eps), optax.scale_by_learning_rate(learning_rate))``;
      ``update`` needs ``params`` (the scores).
    """
    if not callable(learning_rate):
        check_number(learning_rate, "learning_rate", "a number > 0 or an optax schedule", lambda x: x > 0)
    return optax.chain(scale_by_inverse_sigmoid_jacobian(eps), optax.scale_by_learning_rate(learning_rate))
