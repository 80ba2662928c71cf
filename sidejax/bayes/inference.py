r"""Posterior sampling with blackjax: full-batch HMC (BPC-FL's downstream inference, docs/papers/bpcfl.md#a5)
and SGLD (an addition beyond the paper).

Both take an unnormalised log-density ``logdensity_fn(position) -> scalar`` over any pytree ``position``
(a network's parameters) and an explicit key; step ``i`` draws from ``draw_key(key, i)``
(:mod:`sidejax.keys`), so the same key gives the same samples, and the chains run in one ``lax.scan`` under
``jit``.

**HMC** (Neal 2011; blackjax's ``hmc`` kernel, velocity Verlet): potential ``U = −log p̃``, momentum
``p ~ N(0, M)`` with the **inverse** mass matrix ``M⁻¹ = diag(c)`` given as ``inverse_mass_matrix`` (a
scalar ``c`` for ``c·I``, the paper's "diag(c)", docs/papers/bpcfl.md#hmc-inverse-mass, or one value per
coordinate of the flattened position), ``L = num_integration_steps`` leapfrog steps of size ``ε``, then a
Metropolis-Hastings accept. Schedule (docs/papers/bpcfl.md#s8-10): ``mode="consecutive"`` (default) runs
``num_burnin`` steps and keeps the next ``num_samples`` states of one chain; ``mode="chains"`` runs
``num_samples`` independent chains of ``num_burnin`` steps from the same start and keeps each chain's final
state. A transition whose energy error exceeds ``divergence_threshold`` is **divergent**: the result counts
them, the same inside ``jit`` and outside it, and the host-side :func:`check_divergences` warns
(:class:`DivergenceWarning`) when there are any, with what to lower.

**SGLD** (Welling & Teh 2011; blackjax's ``sgld``): ``θ ← θ + (ε/2)∇log p̃(θ) + N(0, ε·T)`` with temperature
``T``, no accept step (so a bias of order ``ε``); with ``data`` and ``batch_size`` the gradient is the
unbiased minibatch estimate ``∇log p0 + (N/b) Σ_batch ∇log p(x_i | θ)`` from
``logdensity_fn(position, batch)`` = ``log p0(θ) + (N/b)``-scaled batch likelihood, which the caller
writes (see :func:`sgld`).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from sidejax.keys import ORDER, draw_key, stream_key
from sidejax.utils import check_count, tree_all_finite

__all__ = [
    "DivergenceWarning",
    "HMCResult",
    "SGLDResult",
    "MAPResult",
    "hmc",
    "check_divergences",
    "sgld",
    "map_estimate",
]

HMC_MODES = ("consecutive", "chains")


class DivergenceWarning(RuntimeWarning):
    """HMC transitions diverged (energy error above the threshold): the step size is too large."""


class HMCResult(NamedTuple):
    """The output of :func:`hmc`.

    Attributes:
      samples: the kept positions, a pytree like the initial position with a leading ``[num_samples]`` axis.
      acceptance_rate: ``[num_transitions]``, the MH acceptance probability of every transition (all chains).
      divergent: ``[num_transitions]`` bool, the divergent transitions.
      num_divergent: int32 scalar.
      energy_error: ``[num_transitions]``, ``H(proposal) − H(start)`` of every transition (``O(ε²)``).
    """

    samples: object
    acceptance_rate: jax.Array
    divergent: jax.Array
    num_divergent: jax.Array
    energy_error: jax.Array


class SGLDResult(NamedTuple):
    """The output of :func:`sgld`: ``samples`` (leading ``[num_samples]`` axis) and ``finite`` (False if a
    position became NaN/inf)."""

    samples: object
    finite: jax.Array


def _positive(value, name: str) -> float:
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < float("inf")):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _inverse_mass(inverse_mass_matrix, dim: int) -> jax.Array:
    imm = np.asarray(inverse_mass_matrix, np.float64)
    if imm.ndim == 0:
        imm = np.full((dim,), float(imm))
    if imm.shape != (dim,):
        raise ValueError(
            f"inverse_mass_matrix must be a scalar c (for c*I) or a vector of the {dim} flattened "
            f"coordinates of the position (a diagonal), got shape {imm.shape}"
        )
    if not np.all(np.isfinite(imm) & (imm > 0)):
        raise ValueError("inverse_mass_matrix must be finite and > 0 (the diagonal of M^-1)")
    return jnp.asarray(imm, jnp.float32)


def hmc(
    key,
    logdensity_fn: Callable,
    init_position,
    *,
    step_size: float,
    num_integration_steps: int,
    inverse_mass_matrix,
    num_burnin: int,
    num_samples: int,
    mode: str = "consecutive",
    divergence_threshold: float = 1000.0,
) -> HMCResult:
    """Full-batch HMC from ``init_position`` (module docstring; the paper's settings,
    docs/papers/bpcfl.md#table-7: moons ``ε = 2e-3, L = 30, M⁻¹ = 100·I``, 40 steps, 50 samples).

    Args:
      key: the sampler's key (step ``i`` of chain ``c`` uses ``draw_key(draw_key(key, c), i)``).
      logdensity_fn: ``log p̃(θ)`` of a position (any pytree), differentiable.
      init_position: the start (e.g. the network's init or the SGD-MAP solution).
      step_size: ``ε > 0``.
      num_integration_steps: ``L >= 1``.
      inverse_mass_matrix: ``c > 0`` (for ``c·I``) or the diagonal of ``M⁻¹`` over the flattened position.
      num_burnin: transitions before the first kept sample (``>= 0``; ``>= 1`` in ``"chains"`` mode).
      num_samples: samples kept (``>= 1``).
      mode: ``"consecutive"`` or ``"chains"``.
      divergence_threshold: energy error above which a transition is divergent.

    Returns:
      :class:`HMCResult`, which counts the divergent transitions (``num_divergent``); :func:`hmc` itself
      never warns, inside ``jit`` or outside it: a host caller passes the result to
      :func:`check_divergences`.

    Raises:
      ValueError: a bad argument, naming it.
    """
    step_size = _positive(step_size, "step_size")
    num_integration_steps = check_count(num_integration_steps, "num_integration_steps", 1)
    num_samples = check_count(num_samples, "num_samples", 1)
    num_burnin = check_count(num_burnin, "num_burnin", 1 if mode == "chains" else 0)
    divergence_threshold = _positive(divergence_threshold, "divergence_threshold")
    if mode not in HMC_MODES:
        raise ValueError(f"mode must be one of {HMC_MODES}, got {mode!r}")
    flat, _ = ravel_pytree(init_position)
    imm = _inverse_mass(inverse_mass_matrix, flat.shape[0])
    import blackjax  # (imported here: importing blackjax starts JAX's backend, which jax.distributed forbids)

    kernel = blackjax.hmc(
        logdensity_fn,
        step_size=step_size,
        inverse_mass_matrix=imm,
        num_integration_steps=num_integration_steps,
        divergence_threshold=divergence_threshold,
    )

    def chain(ckey, num_steps):
        def one(state, i):
            new, info = kernel.step(draw_key(ckey, i), state)
            momentum = ravel_pytree(info.momentum)[0]
            start_energy = -state.logdensity + 0.5 * jnp.sum(imm * momentum**2)
            energy_error = info.energy - start_energy
            return new, (new.position, info.acceptance_rate, info.is_divergent, energy_error)

        return jax.lax.scan(one, kernel.init(init_position), jnp.arange(num_steps))

    def run(key):
        if mode == "consecutive":
            _, (pos, acc, div, err) = chain(draw_key(key, 0), num_burnin + num_samples)
            samples = jax.tree.map(lambda a: a[num_burnin:], pos)
            return samples, acc, div, err
        final, (_, acc, div, err) = jax.vmap(lambda c: chain(draw_key(key, c), num_burnin))(
            jnp.arange(num_samples)
        )
        return final.position, acc.reshape(-1), div.reshape(-1), err.reshape(-1)

    samples, acc, div, err = jax.jit(run)(key)
    return HMCResult(samples, acc, div, jnp.sum(div).astype(jnp.int32), err)


def check_divergences(result):
    """Host side: warns :class:`DivergenceWarning` when ``result`` (an :class:`HMCResult`, or any result
    with a ``num_divergent`` count, e.g. :class:`sidejax.algorithms.bpcfl.InferenceResult`) counted
    divergent transitions, naming the count (of the total when ``result.divergent`` is there) and what to
    lower. Returns ``result``. Needs a concrete result (call it outside ``jit``)."""
    n = int(result.num_divergent)
    if n > 0:
        divergent = getattr(result, "divergent", None)
        of = f" of {int(np.size(divergent))}" if divergent is not None else ""
        warnings.warn(
            f"HMC: {n}{of} transitions diverged (energy error above divergence_threshold); their proposals "
            "were rejected and the samples are unreliable: lower step_size or the inverse_mass_matrix",
            DivergenceWarning,
            stacklevel=2,
        )
    return result


def sgld(
    key,
    logdensity_fn: Callable,
    init_position,
    *,
    step_size: float,
    num_burnin: int,
    num_samples: int,
    thinning: int = 1,
    temperature: float = 1.0,
    data=None,
    batch_size: int | None = None,
) -> SGLDResult:
    """SGLD from ``init_position`` (module docstring): ``num_burnin`` steps, then ``num_samples`` samples
    ``thinning`` steps apart.

    Args:
      key: step ``i`` uses ``draw_key(key, i)`` (its ``ORDER`` stream draws the minibatch).
      logdensity_fn: ``log p̃(θ)`` (full batch, ``data=None``) or ``log p̃(θ, batch)``: the caller's unbiased
        estimate of ``log p̃(θ)`` from a minibatch (``log p0(θ) + (N/b) Σ_batch log p(x | θ)``).
      init_position: the start.
      step_size: ``ε > 0``.
      num_burnin: the schedule's burn-in steps.
      num_samples: the number of samples kept.
      thinning: steps between two kept samples.
      temperature: ``T > 0`` (1: the posterior).
      data: optional pytree of arrays with a leading examples axis, sampled ``batch_size`` at a time
        (uniformly without replacement within a step).
      batch_size: the minibatch size (with ``data``).

    Returns:
      :class:`SGLDResult`.
    """
    step_size = _positive(step_size, "step_size")
    temperature = _positive(temperature, "temperature")
    num_burnin = check_count(num_burnin, "num_burnin", 0)
    num_samples = check_count(num_samples, "num_samples", 1)
    thinning = check_count(thinning, "thinning", 1)
    if data is None:
        if batch_size is not None:
            raise ValueError("batch_size needs data (the examples to draw minibatches from)")
        grad_fn = jax.grad(lambda p, _: logdensity_fn(p))
    else:
        n = jax.tree.leaves(data)[0].shape[0]
        batch_size = check_count(batch_size, "batch_size", 1)
        if batch_size > n:
            raise ValueError(f"batch_size={batch_size} exceeds the {n} examples in data")
        grad_fn = jax.grad(logdensity_fn)
    import blackjax

    kernel = blackjax.sgld(grad_fn)
    total = num_burnin + num_samples * thinning

    def one(position, i):
        skey = draw_key(key, i)
        if data is None:
            batch = None
        else:
            idx = jax.random.permutation(stream_key(skey, ORDER), n)[:batch_size]
            batch = jax.tree.map(lambda a: a[idx], data)
        position = kernel.step(skey, position, batch, step_size, temperature)
        return position, position

    def run(key_unused):
        del key_unused
        _, positions = jax.lax.scan(one, init_position, jnp.arange(total))
        keep = num_burnin + thinning * jnp.arange(num_samples) + thinning - 1
        return jax.tree.map(lambda a: a[keep], positions)

    samples = jax.jit(run)(key)
    return SGLDResult(samples, tree_all_finite(samples))


class MAPResult(NamedTuple):
    """The output of :func:`map_estimate`: the final ``position``, the objective ``−log p̃`` at every step
    (``[num_steps]``) and ``finite``."""

    position: object
    objective: jax.Array
    finite: jax.Array


def map_estimate(
    logdensity_fn: Callable, init_position, *, optimizer: optax.GradientTransformation, num_steps: int
) -> MAPResult:
    """Full-batch MAP (docs/papers/bpcfl.md#a5: BPC-FL's SGD / Adam downstream inference, and the FedAvg warm
    start of docs/papers/bpcfl.md#a6): ``num_steps`` Optax steps on ``U = −logdensity_fn`` from
    ``init_position``, in ``lax.scan`` under ``jit``.

    Raises:
      ValueError: ``num_steps`` not an integer >= 1.
    """
    num_steps = check_count(num_steps, "num_steps", 1)
    value_and_grad = jax.value_and_grad(lambda p: -logdensity_fn(p))

    def run(position):
        def step(carry, _):
            p, state = carry
            u, g = value_and_grad(p)
            updates, state = optimizer.update(g, state, p)
            return (optax.apply_updates(p, updates), state), u

        (position, _), objective = jax.lax.scan(
            step, (position, optimizer.init(position)), None, length=num_steps
        )
        return MAPResult(position, objective, tree_all_finite((position, objective)))

    return jax.jit(run)(init_position)
