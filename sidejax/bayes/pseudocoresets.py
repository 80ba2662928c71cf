r"""Forward-KL Bayesian pseudocoresets: the gradient estimator of BPC-fKL (spec ``bpcfl.md`` §3 eq. (14),
Algorithm A2; Kim et al. 2022), the building block of BPC-FL's clients.

A pseudocoreset ``C`` (learnable pseudo-inputs ``Z`` and labels ``ŷ``, any pytree) defines the posterior
``π_C(θ) ∝ p0(θ) exp(−ℓ(C, θ))`` with the coreset loss ``ℓ`` (a negative log-likelihood). The forward KL to
the data posterior ``π_D`` has the gradient (**sign corrected**: the paper's eq. (14) is written with
``log p`` and is the negative of the gradient it then descends, spec §3)

.. math::

    \nabla_C\,\mathrm{KL}(\pi_D\,\|\,\pi_C) = \mathbb E_{\pi_D}[\nabla_C \ell(C,\theta)]
      - \mathbb E_{\pi_C}[\nabla_C \ell(C,\theta)],

with ``θ`` held fixed inside ``∇_C`` (no differentiation through any sampler: ``∇_C log Z(C) =
−E_{π_C}[∇_C ℓ]``). :func:`fkl_gradient` estimates it as the gradient of the surrogate

.. math::

    J(C) = \frac{1}{B S}\sum_{b,s}\Big[\ell(C, \mathrm{sg}(\theta_D^b) + \varepsilon_D^{bs})
      - \ell(C, \mathrm{sg}(\theta_C^b) + \varepsilon_C^{bs})\Big],

with ``ε ~ N(0, σ_ε² I)``, where ``θ_D^b`` are samples of ``π_D`` (BPC-FL: expert-trajectory
checkpoints) and ``θ_C^b`` come from ``chain_length`` optimizer steps on ``ℓ(C, ·)`` started at
``θ_start^b`` (the inner chain, under ``lax.stop_gradient``). ``J`` itself is a monitoring scalar (Kim
et al. log it).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from sidejax.keys import draw_key

__all__ = ["FKLGradient", "inner_chain", "fkl_surrogate", "fkl_gradient"]


class FKLGradient(NamedTuple):
    """The output of :func:`fkl_gradient`: ``grad`` (a pytree like the coreset), ``surrogate`` (``J``) and
    ``theta_coreset`` (the inner chains' end points, ``[B, ...]``)."""

    grad: object
    surrogate: jax.Array
    theta_coreset: object


def _count(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def inner_chain(
    loss_fn: Callable, coreset, theta_start, optimizer: optax.GradientTransformation, num_steps: int
):
    """``num_steps`` optimizer steps on ``θ ↦ loss_fn(coreset, θ)`` from ``theta_start`` (a fresh optimizer
    state; no noise injected, spec A2), in ``lax.scan``; the result is ``stop_gradient``-ed, so no gradient
    flows from it back to ``coreset``."""
    coreset = jax.lax.stop_gradient(coreset)
    grad = jax.grad(lambda th: loss_fn(coreset, th))

    def step(carry, _):
        theta, state = carry
        updates, state = optimizer.update(grad(theta), state, theta)
        return (optax.apply_updates(theta, updates), state), None

    (theta, _), _ = jax.lax.scan(step, (theta_start, optimizer.init(theta_start)), None, length=num_steps)
    return jax.lax.stop_gradient(theta)


def _perturb(key, theta, noise_std: float):
    flat, unravel = ravel_pytree(theta)
    return unravel(flat + noise_std * jax.random.normal(key, flat.shape, flat.dtype))


def fkl_surrogate(
    loss_fn: Callable, coreset, theta_data, theta_coreset, key, *, noise_std: float, num_noise: int
) -> jax.Array:
    """``J(C)`` of the module docstring for ``B`` sample pairs (pytrees with a leading ``[B]`` axis).

    Noise ``s`` of pair ``b`` is drawn from ``draw_key(key, 2(bS + s))`` for ``ε_D`` and
    ``draw_key(key, 2(bS + s) + 1)`` for ``ε_C``; ``noise_std = 0`` uses the samples as given."""
    num_noise = _count(num_noise, "num_noise", 1)
    theta_data = jax.lax.stop_gradient(theta_data)
    theta_coreset = jax.lax.stop_gradient(theta_coreset)
    num_pairs = jax.tree.leaves(theta_data)[0].shape[0]

    def pair(b, th_d, th_c):
        def one(s):
            index = 2 * (b * num_noise + s)
            ed = _perturb(draw_key(key, index), th_d, noise_std) if noise_std > 0 else th_d
            ec = _perturb(draw_key(key, index + 1), th_c, noise_std) if noise_std > 0 else th_c
            return loss_fn(coreset, ed) - loss_fn(coreset, ec)

        return jnp.mean(jax.vmap(one)(jnp.arange(num_noise)))

    return jnp.mean(jax.vmap(pair)(jnp.arange(num_pairs), theta_data, theta_coreset))


def fkl_gradient(
    loss_fn: Callable,
    coreset,
    theta_data,
    theta_start,
    key,
    *,
    optimizer: optax.GradientTransformation,
    chain_length: int,
    noise_std: float = 0.0,
    num_noise: int = 1,
) -> FKLGradient:
    """The BPC-fKL gradient estimate (spec A2, one update): run the inner chains from ``theta_start``
    (``[B, ...]``, vmapped), then ``grad(fkl_surrogate)`` at the fixed end points.

    Args:
      loss_fn: ``loss_fn(coreset, θ) -> scalar``, the coreset loss ``ℓ`` (mean-reduced NLL, plus the prior's
        ``λ/2‖θ‖²`` if the inner chain should see it).
      coreset: the pseudocoreset pytree (``Z``, ``ŷ``).
      theta_data: ``B`` samples of ``π_D`` (leading axis).
      theta_start: ``B`` starting points of the inner chains (leading axis).
      key: the noise key (:func:`fkl_surrogate`).
      optimizer: the inner chain's optimizer (the paper's "mcmc sampler": SGD or Adam).
      chain_length: ``L_C >= 0`` inner steps (0: ``theta_start`` are already samples of ``π_C``).
      noise_std: ``σ_ε >= 0``.
      num_noise: ``S >= 1``.

    Returns:
      :class:`FKLGradient`.
    """
    chain_length = _count(chain_length, "chain_length", 0)
    if not (isinstance(noise_std, numbers.Real) and 0 <= noise_std < float("inf")):
        raise ValueError(f"noise_std must be a finite number >= 0, got {noise_std!r}")
    theta_c = jax.vmap(lambda th: inner_chain(loss_fn, coreset, th, optimizer, chain_length))(theta_start)
    value, grad = jax.value_and_grad(
        lambda c: fkl_surrogate(
            loss_fn, c, theta_data, theta_c, key, noise_std=float(noise_std), num_noise=num_noise
        )
    )(coreset)
    return FKLGradient(grad, value, theta_c)
