r"""Forward-KL Bayesian pseudocoresets: the gradient estimator of BPC-fKL (docs/papers/bpcfl.md#eq-14,
Algorithm A2, docs/papers/bpcfl.md#a2; Kim et al. 2022), the building block of BPC-FL's clients.

A pseudocoreset ``C`` (learnable pseudo-inputs ``Z`` and labels ``ŷ``, any pytree) defines the posterior
``π_C(θ) ∝ p0(θ) exp(−ℓ(C, θ))`` with the coreset loss ``ℓ`` (a negative log-likelihood). The forward KL to
the data posterior ``π_D`` has the gradient (**sign corrected**: the paper's eq. (14) is written with
``log p`` and is the negative of the gradient it then descends, docs/papers/bpcfl.md#s3)

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
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from sidejax.keys import ORDER, draw_key, stream_key
from sidejax.utils import check_count, is_concrete

__all__ = [
    "FKLGradient",
    "Pseudocoreset",
    "inner_chain",
    "fkl_surrogate",
    "fkl_gradient",
    "cycled_labels",
    "init_pseudocoreset",
    "aggregate_pseudocoresets",
    "coreset_logdensity",
    "LearnInfo",
    "learn_pseudocoreset",
    "trajectory_pairs",
    "expert_trajectories",
]


class FKLGradient(NamedTuple):
    """The output of :func:`fkl_gradient`: ``grad`` (a pytree like the coreset), ``surrogate`` (``J``) and
    ``theta_coreset`` (the inner chains' end points, ``[B, ...]``)."""

    grad: object
    surrogate: jax.Array
    theta_coreset: object


def inner_chain(
    loss_fn: Callable, coreset, theta_start, optimizer: optax.GradientTransformation, num_steps: int
):
    """``num_steps`` optimizer steps on ``θ ↦ loss_fn(coreset, θ)`` from ``theta_start`` (a fresh optimizer
    state; no noise injected, docs/papers/bpcfl.md#a2), in ``lax.scan``; the result is ``stop_gradient``-ed,
    so no gradient flows from it back to ``coreset``."""
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
    num_noise = check_count(num_noise, "num_noise", 1)
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
    """The BPC-fKL gradient estimate (docs/papers/bpcfl.md#a2, one update): run the inner chains from
    ``theta_start`` (``[B, ...]``, vmapped), then ``grad(fkl_surrogate)`` at the fixed end points.

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
    chain_length = check_count(chain_length, "chain_length", 0)
    if not (isinstance(noise_std, numbers.Real) and 0 <= noise_std < float("inf")):
        raise ValueError(f"noise_std must be a finite number >= 0, got {noise_std!r}")
    theta_c = jax.vmap(lambda th: inner_chain(loss_fn, coreset, th, optimizer, chain_length))(theta_start)
    value, grad = jax.value_and_grad(  # allow_int: integer labels (classification) get float0 zeros
        lambda c: fkl_surrogate(
            loss_fn, c, theta_data, theta_c, key, noise_std=float(noise_std), num_noise=num_noise
        ),
        allow_int=True,
    )(coreset)
    return FKLGradient(grad, value, theta_c)


class Pseudocoreset(NamedTuple):
    """A pseudocoreset: ``inputs [K, ...]`` (learnable pseudo-inputs ``Z``) and ``labels [K]`` (``ŷ``: fixed
    int labels for classification, learnable floats for regression)."""

    inputs: jax.Array
    labels: jax.Array


def cycled_labels(y: jax.Array, valid: jax.Array, num_classes: int, num_points: int) -> jax.Array:
    """docs/papers/bpcfl.md#a3: the client's labels present in its data, by descending frequency (ties:
    ascending label id), cycled to ``num_points`` (counts ``{3: 10, 1: 5, 7: 2}``, ``K = 7`` →
    ``[3, 1, 7, 3, 1, 7, 3]``). Jittable (``num_classes``, ``num_points`` static); ``valid`` masks padding."""
    counts = jnp.zeros((num_classes,), jnp.int32).at[y].add(valid.astype(jnp.int32))
    # descending count, then ascending id: sort by -count (stable argsort keeps ids ascending among ties)
    order = jnp.argsort(-counts, stable=True)
    present = jnp.maximum(jnp.sum(counts > 0), 1)
    return order[jnp.arange(num_points) % present].astype(jnp.int32)


def init_pseudocoreset(
    key,
    x: jax.Array,
    y: jax.Array,
    valid: jax.Array,
    num_points: int,
    *,
    init_std: float,
    num_classes: int | None,
) -> Pseudocoreset:
    """docs/papers/bpcfl.md#a3: pseudo-inputs ``z ~ N(X̄, σ_z² I)`` (``X̄`` the element-wise mean of the
    client's valid inputs, ``σ_z = init_std``), labels by :func:`cycled_labels` (classification,
    ``num_classes`` given) or ``mean(y)`` for every point (regression, ``num_classes=None``). Jittable and
    vmappable over clients."""
    num_points = check_count(num_points, "num_points", 1)
    if not (isinstance(init_std, numbers.Real) and 0 < init_std < float("inf")):
        raise ValueError(f"init_std must be a finite number > 0, got {init_std!r}")
    w = valid.astype(x.dtype)
    denom = jnp.maximum(jnp.sum(w), 1.0)
    xbar = jnp.tensordot(w, x, axes=(0, 0)) / denom
    z = xbar + init_std * jax.random.normal(key, (num_points, *x.shape[1:]), x.dtype)
    if num_classes is None:
        labels = jnp.full((num_points,), jnp.sum(w * y.astype(x.dtype)) / denom, x.dtype)
    else:
        labels = cycled_labels(y, valid, check_count(num_classes, "num_classes", 1), num_points)
    return Pseudocoreset(z, labels)


def aggregate_pseudocoresets(
    coresets: Pseudocoreset, num_examples, include=None
) -> tuple[Pseudocoreset, jax.Array]:
    """docs/papers/bpcfl.md#a4: the server's concatenation of ``M`` clients' pseudocoresets (leading
    ``[M, K]`` axes) with per-point weights ``w_m = M n_m / N`` (mean weight 1: equal ``n_m`` is plain
    concatenation).

    ``include`` (bool ``[M]``, all by default) marks the clients that count: the others' points get weight 0
    and are zeroed (a NaN point would poison the weighted sum), and ``M``, ``N`` are of the included
    clients alone, ``w_m = |I| n_m / N_I``: the weights of the aggregate without the excluded clients.

    Returns ``(Pseudocoreset [M K, ...], weights [M K])``.

    Raises:
      ValueError: no clients, or a concrete ``num_examples`` that is not positive.
    """
    n = jnp.asarray(num_examples)
    if n.ndim != 1 or n.shape[0] == 0:
        raise ValueError(f"num_examples must be [M] with M >= 1 clients, got shape {n.shape}")
    if coresets.inputs.shape[0] != n.shape[0]:
        raise ValueError(
            f"coresets hold {coresets.inputs.shape[0]} clients but num_examples has {n.shape[0]} entries"
        )
    if is_concrete(n) and not np.all(np.asarray(n) > 0):
        raise ValueError(f"num_examples must be > 0 for every client, got {np.asarray(n).tolist()}")
    m, k = coresets.inputs.shape[:2]
    if include is None:
        weights = m * n.astype(jnp.float32) / jnp.sum(n).astype(jnp.float32)
    else:
        include = jnp.asarray(include, bool)
        n = jnp.where(include, n, 0)
        coresets = jax.tree.map(
            lambda a: jnp.where(include.reshape((m,) + (1,) * (a.ndim - 1)), a, 0), coresets
        )
        weights = (
            jnp.sum(include).astype(jnp.float32) * n.astype(jnp.float32) / jnp.sum(n).astype(jnp.float32)
        )
    flat = Pseudocoreset(
        coresets.inputs.reshape(m * k, *coresets.inputs.shape[2:]), coresets.labels.reshape(m * k)
    )
    return flat, jnp.repeat(weights, k)


def coreset_logdensity(
    log_likelihood: Callable,
    coreset: Pseudocoreset,
    weights: jax.Array,
    *,
    prior_precision: float,
    likelihood_scale: float = 1.0,
) -> Callable:
    """``log p̃(θ | C) = −(λ/2)‖θ‖² + β Σ_i w_i log p(ŷ_i | f(z_i, θ))`` (docs/papers/bpcfl.md#s3,
    docs/papers/bpcfl.md#a4; ``β`` the explicit likelihood scale, docs/papers/bpcfl.md#s8-7), as a function of
    ``θ`` for :func:`sidejax.bayes.hmc` or a MAP optimizer.

    Args:
      log_likelihood: ``log_likelihood(θ, inputs [K, ...], labels [K]) -> [K]`` per-point log-likelihoods.
      coreset: the aggregated :class:`Pseudocoreset`.
      weights: ``[K]`` per-point weights (:func:`aggregate_pseudocoresets`).
      prior_precision: ``λ > 0``.
      likelihood_scale: ``β > 0``.
    """
    for name, value in (("prior_precision", prior_precision), ("likelihood_scale", likelihood_scale)):
        if not (isinstance(value, numbers.Real) and 0 < value < float("inf")):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    def logdensity(theta):
        flat, _ = ravel_pytree(theta)
        ll = log_likelihood(theta, coreset.inputs, coreset.labels)
        return -0.5 * prior_precision * jnp.dot(flat, flat) + likelihood_scale * jnp.sum(weights * ll)

    return logdensity


class LearnInfo(NamedTuple):
    """Per-update diagnostics of :func:`learn_pseudocoreset`: the surrogate ``J`` and the gradient norm."""

    surrogate: jax.Array
    grad_norm: jax.Array


def trajectory_pairs(trajectories, *, data_offset: int, save_interval: int, num_pairs: int) -> Callable:
    """The BPC-fKL sampler of sample pairs from stored expert trajectories (docs/papers/bpcfl.md#a2,
    lines "τ ~ U(𝒯)",
    "r ~ U{0, 5, …}"): ``trajectories`` is a pytree with leading axes ``[J, T]`` (``J`` trajectories of ``T``
    checkpoints, ``save_interval`` optimizer steps apart); pair ``b`` draws a trajectory and a checkpoint
    ``r`` with ``r + data_offset`` inside it and returns ``θ_D = τ[r + data_offset/save_interval]``,
    ``θ_start = τ[r]``. ``data_offset = L_D`` in optimizer steps, a multiple of ``save_interval``.

    Returns ``sample_pairs(key, coreset) -> (theta_data [B], theta_start [B])`` for
    :func:`learn_pseudocoreset`.

    Raises:
      ValueError: ``L_D`` not a multiple of the save interval, or longer than the trajectories
        (docs/papers/bpcfl.md#t10: ``r + L_D <= T_pre``).
    """
    save_interval = check_count(save_interval, "save_interval", 1)
    data_offset = check_count(data_offset, "data_offset", 0)
    num_pairs = check_count(num_pairs, "num_pairs", 1)
    if data_offset % save_interval:
        raise ValueError(
            f"data_offset={data_offset} (L_D) must be a multiple of save_interval={save_interval}: θ_D is a "
            f"stored checkpoint"
        )
    leaf = jax.tree.leaves(trajectories)[0]
    num_traj, num_ckpt = leaf.shape[:2]
    shift = data_offset // save_interval
    if shift >= num_ckpt:
        raise ValueError(
            f"data_offset={data_offset} (L_D) reaches past the trajectories' {num_ckpt} checkpoints "
            f"({(num_ckpt - 1) * save_interval} optimizer steps): lower it or pretrain longer"
        )

    def sample_pairs(key, coreset):
        del coreset
        j = jax.random.randint(draw_key(key, 0), (num_pairs,), 0, num_traj)
        r = jax.random.randint(draw_key(key, 1), (num_pairs,), 0, num_ckpt - shift)
        data = jax.tree.map(lambda a: a[j, r + shift], trajectories)
        start = jax.tree.map(lambda a: a[j, r], trajectories)
        return data, start

    return sample_pairs


def learn_pseudocoreset(
    loss_fn: Callable,
    coreset,
    key,
    *,
    sample_pairs: Callable,
    num_updates: int,
    optimizer: optax.GradientTransformation,
    chain_length: int,
    step_size_inputs: float,
    step_size_labels: float = 0.0,
    noise_std: float = 0.0,
    num_noise: int = 1,
):
    """BPC-fKL (docs/papers/bpcfl.md#a2): ``num_updates`` SGD steps on the pseudocoreset along
    :func:`fkl_gradient`, in ``lax.scan``. Update ``u`` draws its pairs with
    ``sample_pairs(draw_key(key, 2u), coreset)`` and its noise from ``draw_key(key, 2u + 1)``; inputs move by
    ``step_size_inputs`` (``ψ_x``), labels by ``step_size_labels`` (``ψ_y``; 0 keeps them, as for
    classification: integer labels are never moved).

    Args:
      loss_fn: ``loss_fn(coreset, θ)`` (:func:`fkl_gradient`).
      coreset: a :class:`Pseudocoreset` (or any pytree with ``inputs`` and ``labels``).
      key: the learner's key.
      sample_pairs: ``(key, coreset) -> (theta_data [B], theta_start [B])``, e.g. :func:`trajectory_pairs`.
      num_updates: ``K_upd``.
      optimizer: the inner chain's optimizer (:func:`fkl_gradient`).
      chain_length: the inner chain's length (:func:`fkl_gradient`).
      noise_std: the noise's standard deviation (:func:`fkl_gradient`).
      num_noise: the number of noise draws (:func:`fkl_gradient`).
      step_size_inputs: ``ψ_x >= 0`` (0: the inputs stay fixed).
      step_size_labels: ``ψ_y >= 0`` (0: the labels stay fixed).

    Returns:
      ``(coreset, LearnInfo [num_updates])``.
    """
    num_updates = check_count(num_updates, "num_updates", 1)
    if not (isinstance(step_size_inputs, numbers.Real) and 0 <= step_size_inputs < float("inf")):
        raise ValueError(f"step_size_inputs must be a finite number >= 0, got {step_size_inputs!r}")
    if not (isinstance(step_size_labels, numbers.Real) and 0 <= step_size_labels < float("inf")):
        raise ValueError(f"step_size_labels must be a finite number >= 0, got {step_size_labels!r}")
    move_labels = step_size_labels > 0 and jnp.issubdtype(coreset.labels.dtype, jnp.floating)

    def update(c, u):
        theta_data, theta_start = sample_pairs(draw_key(key, 2 * u), c)
        out = fkl_gradient(
            loss_fn,
            c,
            theta_data,
            theta_start,
            draw_key(key, 2 * u + 1),
            optimizer=optimizer,
            chain_length=chain_length,
            noise_std=noise_std,
            num_noise=num_noise,
        )
        g = out.grad
        inputs = c.inputs - step_size_inputs * g.inputs if step_size_inputs > 0 else c.inputs
        labels = c.labels - step_size_labels * g.labels if move_labels else c.labels
        norm = jnp.sqrt(
            sum(jnp.sum(jnp.square(a)) for a in jax.tree.leaves(g) if jnp.issubdtype(a.dtype, jnp.floating))
        )
        return c._replace(inputs=inputs, labels=labels), LearnInfo(out.surrogate, norm)

    return jax.lax.scan(update, coreset, jnp.arange(num_updates))


def expert_trajectories(
    init_fn: Callable,
    loss_fn: Callable,
    shared_key,
    client_key,
    x: jax.Array,
    y: jax.Array,
    valid: jax.Array,
    *,
    num_trajectories: int,
    num_steps: int,
    save_interval: int,
    batch_size: int | None,
    optimizer: optax.GradientTransformation,
    trajectories_per_step: int | None = None,
):
    """docs/papers/bpcfl.md#a0: ``J`` MAP-optimisation trajectories on a client's data, checkpoints every
    ``save_interval`` steps (``num_steps / save_interval + 1`` of them, the start included), the approximate
    samples of ``π_D`` that :func:`trajectory_pairs` draws from.

    Trajectory ``j`` starts from ``init_fn(draw_key(shared_key, j))``: **identical** on every client (the
    paper shares the initialisation seeds); its minibatches (``batch_size`` examples drawn uniformly from the
    client's valid examples, with replacement) come from ``stream_key(draw_key(client_key, j), ORDER)``, the
    client's own; ``batch_size=None`` takes full-batch steps on the valid examples (deterministic).
    Memory: ``lax.map`` over trajectories, ``trajectories_per_step`` at a time (``None``: all at once,
    vmapped); only the checkpoints are kept.

    Args:
      init_fn: ``init_fn(key) -> params``.
      loss_fn: ``loss_fn(params, x [b, ...], y [b]) -> scalar`` (mean NLL plus the prior's ``λ/2‖θ‖²``).
      shared_key: the key every client shares (initialisations).
      client_key: this client's key (minibatch orders).
      x: the client's padded inputs.
      y: the client's padded labels.
      valid: the validity mask of the padded examples.
      num_trajectories: ``J``.
      num_steps: ``T_pre``.
      save_interval: the steps between two saved checkpoints of a trajectory (5).
      batch_size: ``b`` (``None``: full batch over ``x, y``, which must then hold only valid examples).
      optimizer: the pretraining optimizer.
      trajectories_per_step: trajectories computed at once.

    Returns:
      The checkpoints, a pytree like the params with leading axes ``[J, num_steps / save_interval + 1]``.

    Raises:
      ValueError: ``num_steps`` not a multiple of ``save_interval``, or a count below 1.
    """
    num_trajectories = check_count(num_trajectories, "num_trajectories", 1)
    num_steps = check_count(num_steps, "num_steps", 1)
    save_interval = check_count(save_interval, "save_interval", 1)
    batch_size = None if batch_size is None else check_count(batch_size, "batch_size", 1)
    if num_steps % save_interval:
        raise ValueError(f"num_steps={num_steps} must be a multiple of save_interval={save_interval}")
    per_step = trajectories_per_step
    if per_step is not None:
        per_step = check_count(per_step, "trajectories_per_step", 1)
    num_valid = jnp.maximum(jnp.sum(valid > 0), 1)
    positions = jnp.argsort(jnp.where(valid > 0, 0, 1), stable=True)  # valid examples first
    grad = jax.grad(loss_fn)

    def trajectory(j):
        params = init_fn(draw_key(shared_key, j))
        order = stream_key(draw_key(client_key, j), ORDER)

        def block(carry, blk):
            def step(c, t):
                p, st = c
                if batch_size is None:  # full batch: the valid examples (the caller passes unpadded data)
                    g = grad(p, x, y)
                else:
                    pos = jax.random.randint(draw_key(order, t), (batch_size,), 0, num_valid)
                    idx = positions[pos]
                    g = grad(p, x[idx], y[idx])
                updates, st = optimizer.update(g, st, p)
                return (optax.apply_updates(p, updates), st), None

            carry, _ = jax.lax.scan(step, carry, blk * save_interval + jnp.arange(save_interval))
            return carry, carry[0]

        _, saved = jax.lax.scan(
            block, (params, optimizer.init(params)), jnp.arange(num_steps // save_interval)
        )
        return jax.tree.map(lambda a0, a: jnp.concatenate([a0[None], a]), params, saved)

    ids = jnp.arange(num_trajectories)
    if per_step is None:
        return jax.vmap(trajectory)(ids)
    return jax.lax.map(trajectory, ids, batch_size=per_step)
