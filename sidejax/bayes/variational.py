r"""Mean-field Gaussian variational posteriors over a model's parameters (pFedBayes,
docs/papers/coreset_pfedbayes.md#s2-1).

A posterior is :class:`MeanField` ``v = (μ, ρ)``, two pytrees shaped like the model's parameters, with

.. math::

    q(\theta) = \prod_m \mathcal N(\theta_m; \mu_m, \sigma_m^2), \qquad \sigma_m = \mathrm{softplus}(\rho_m),

sampled by reparameterisation ``θ = μ + softplus(ρ)·g``, ``g ~ N(0, eps_std² I)`` (``eps_std = 1`` per Alg. 1;
the reference code's ``0.001`` is exposed, docs/papers/coreset_pfedbayes.md#s2-1-quirk), and compared by the
closed-form KL between diagonal Gaussians summed over all ``P`` coordinates,

.. math::

    \mathrm{KL}(q\,\|\,z) = \sum_m \Big[\log\frac{\sigma_{z,m}}{\sigma_{q,m}}
      + \frac{\sigma_{q,m}^2 + (\mu_{q,m} - \mu_{z,m})^2}{2\sigma_{z,m}^2} - \frac12\Big].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from sidejax.utils import is_concrete

__all__ = ["MeanField", "init_mean_field", "scales", "sample", "diag_gaussian_kl", "mean_field_kl"]


class MeanField(NamedTuple):
    """A mean-field Gaussian posterior: ``mu`` and ``rho`` (``σ = softplus(ρ)``), pytrees like the params."""

    mu: object
    rho: object


def scales(v: MeanField):
    """``σ = softplus(ρ)`` leaf by leaf."""
    return jax.tree.map(jax.nn.softplus, v.rho)


def init_mean_field(key, params, *, weight_scale: float = 0.1, rho: float = -3.0) -> MeanField:
    """``μ ~ N(0, weight_scale²)``, ``ρ = rho`` (``σ₀ = softplus(−3) ≈ 0.0486``, the reference code's values),
    shaped like ``params``; one draw of all ``P`` means from ``key``."""
    if not weight_scale > 0:
        raise ValueError(f"weight_scale must be > 0, got {weight_scale!r}")
    flat, unravel = ravel_pytree(params)
    mu = unravel(weight_scale * jax.random.normal(key, flat.shape, flat.dtype))
    return MeanField(mu, jax.tree.map(lambda a: jnp.full_like(a, rho), params))


def sample(key, v: MeanField, eps_std: float = 1.0):
    """One reparameterised sample ``θ = μ + softplus(ρ)·g``, ``g ~ N(0, eps_std²)``, differentiable in
    ``v``; all ``P`` normals are one draw from ``key``."""
    mu, unravel = ravel_pytree(v.mu)
    rho, _ = ravel_pytree(v.rho)
    g = eps_std * jax.random.normal(key, mu.shape, mu.dtype)
    return unravel(mu + jax.nn.softplus(rho) * g)


def _check_scale(sigma, name: str) -> None:
    if is_concrete(sigma):
        s = np.asarray(sigma)
        if not np.all(np.isfinite(s) & (s > 0)):
            raise ValueError(
                f"{name} must be finite and > 0 (a Gaussian's scale); found e.g. {s[~(s > 0)][:3]}"
            )


def diag_gaussian_kl(mu_q, sigma_q, mu_z, sigma_z) -> jax.Array:
    """``KL(N(μ_q, σ_q²) ‖ N(μ_z, σ_z²))`` summed over the coordinates of flat arrays (closed form).

    Raises:
      ValueError: a concrete scale that is not finite and positive.
    """
    _check_scale(sigma_q, "sigma_q")
    _check_scale(sigma_z, "sigma_z")
    ratio = (sigma_q / sigma_z) ** 2
    return 0.5 * jnp.sum(ratio + ((mu_q - mu_z) / sigma_z) ** 2 - 1.0 - jnp.log(ratio))


def mean_field_kl(q: MeanField, z: MeanField) -> jax.Array:
    """``KL(q ‖ z)`` of two mean-field posteriors of the same model (all coordinates)."""
    mq, _ = ravel_pytree(q.mu)
    mz, _ = ravel_pytree(z.mu)
    if mq.shape != mz.shape:
        raise ValueError(
            f"q and z must have the same parameters, got {mq.shape[0]} and {mz.shape[0]} coordinates"
        )
    return diag_gaussian_kl(
        mq, jax.nn.softplus(ravel_pytree(q.rho)[0]), mz, jax.nn.softplus(ravel_pytree(z.rho)[0])
    )
