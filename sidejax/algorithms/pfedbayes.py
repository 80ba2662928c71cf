r"""pFedBayes and CoreSet-PFedBayes: personalized variational Bayesian FL (docs/papers/coreset_pfedbayes.md).

Every client ``i`` keeps a mean-field Gaussian **personal** posterior :math:`q^i = q_v`
(:class:`sidejax.bayes.MeanField`, ``σ = softplus(ρ)``) over the parameters of any model of the zoo; the
server holds the **global** posterior :math:`z = z_{v_z}`. Round ``t`` (docs/papers/coreset_pfedbayes.md#s2-5,
Alg. 1 as corrected there):

- **downlink**: the global ``(μ, ρ)`` as float32 (``2P`` floats);
- **client** (:func:`vi_track`, ``R`` iterations): draw a minibatch ``Λ``; take ``R_p`` optimizer steps on the
  personal objective (Eq. 9, with likelihood weights ``w_j``)

  .. math::

      \Omega(v) = -\frac{m}{b}\,\frac1{K}\sum_{j\in\Lambda}\sum_{k=1}^{K} w_j\,\ell_j(\mu + \sigma\odot g_k)
      + \zeta\,\mathrm{KL}(q_v\,\|\,z_{v_z}), \qquad g_k \sim \mathcal N(0, \epsilon^2 I),

  (``m`` = the number of points the minibatch is drawn from, uniformly; ``ℓ_j`` = log-likelihood of example
  ``j``), then one step of the **localized global** copy ``v_z`` (initialised from the server's) on
  :math:`\zeta\,\mathrm{KL}(q_v\|z_{v_z})`. The personal track and its optimizer state persist across
  rounds; the localized copy and its optimizer state restart from the server every round
  (docs/papers/coreset_pfedbayes.md#r-global-optimizer);
- **uplink**: the client's localized global ``(μ, ρ)`` (``2P`` floats with
  :func:`sidejax.coding.float32_coder`);
- **server**: :math:`v^{t+1} = (1-\beta)v^t + \frac{\beta}{S}\sum_i v_i` on ``(μ, ρ)`` (Alg. 1; ``β = 1``: the
  plain mean, the reference code's).

The three builders are three sets of role kernels over this one track trainer:

- :func:`pfedbayes`: the full-data track (``w = 1``, ``m = n``); the personal model is ``q``.
- :func:`pfedbayes_subset`: the RandomSubset baseline: the same track on a fixed uniformly random subset of
  ``subset_size`` points per client (drawn at the client's first round), with unit weights (the paper's) or
  weights ``n/k`` (``reweight=True``: the full data's likelihood mass).
- :func:`coreset_pfedbayes`: CoreSet-PFedBayes: the full-data track (for :math:`\hat q^i`, the projection's
  :math:`\hat\pi`) and a **coreset track** :math:`q_{v_w}` trained on the weighted coreset (Eq. 5 / Eq. 9 with
  ``w``: a minibatch drawn uniformly from ``supp(w)``, ``m = |supp(w)|``); after training, every
  ``coreset_every`` rounds, the weights are recomputed by A-IHT (:func:`sidejax.bayes.aiht`) from ``J``
  Monte-Carlo samples of :math:`\hat q^i` (:func:`sidejax.bayes.projected_potentials`); the uplink is the
  **coreset** track's localized global (docs/papers/coreset_pfedbayes.md#e10), and the personal model is
  :math:`\hat q_w` (docs/papers/coreset_pfedbayes.md#s2-6).

Deviations and resolutions (docs/papers/coreset_pfedbayes.md#s6), all documented here and in the settings:

- E1 (docs/papers/coreset_pfedbayes.md#e1): the client objective uses the global posterior ``z`` as the prior
  (Eq. 1 writes the prior ``π``).
- E4 (docs/papers/coreset_pfedbayes.md#e4): the weighted objective keeps ``w`` inside the sum (the paper's
  Eq. 9 drops it), sampled uniformly from the support with the unbiased scale ``|supp(w)|/b``.
- E5 (docs/papers/coreset_pfedbayes.md#e5): potentials are **log**-likelihoods, :math:`\hat\pi = \hat q^i`
  (the trained full-data posterior).
- E7 (docs/papers/coreset_pfedbayes.md#e7): the coreset starts as a uniformly random ``k``-subset with weights
  ``n/k`` (the paper's ``w = 0`` has no data term; ``CoresetSettings.init = "zeros"`` gives it).
- E8 (docs/papers/coreset_pfedbayes.md#e8): A-IHT runs on the quadratic ``‖y − Φw‖²`` only; ``KL(q̂_w ‖ q̂)``
  is logged as the diagnostic (``coreset_kl``); Prop. 1 is not implemented (not computable).
- E9 (docs/papers/coreset_pfedbayes.md#e9): A-IHT's exact line-search steps (no spurious factor 2);
  ``step_scale = 0.5`` is the reference code's.
- E6 (docs/papers/coreset_pfedbayes.md#e6): ``J`` defaults to ``max(100, 2k)`` (``J ≤ k`` lets A-IHT fit the
  ``J`` samples exactly with any mass); ``sum_to_n`` constrains ``Σw = n``; ``Σw`` and ``f/‖y‖²`` are logged.
- The reference code's quirks are settings, not defaults: ``eps_std = 0.001``, ``kl_scale_mode =
  "reference"`` (data term summed over the batch without ``n/b``, KL weight ``ζ/R``), ``step_scale = 0.5``.

Per-example log-likelihoods come from the library's loss contract: ``ℓ_j(θ) = −loss_fn(θ, {x_j, y_j})`` on a
one-example batch (vmapped), so ``loss_fn`` must be the mean **negative log-likelihood**
(:func:`sidejax.fl.classification_loss` is: softmax cross-entropy = ``−log p(y|x)``). Evaluation uses the
posterior means (``eval_params``: the global ``μ``; ``evaluation.personal``: every client's personal ``μ``).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.dense import receive_vector, vector_downlink
from sidejax.bayes.coresets import aiht, projected_potentials
from sidejax.bayes.variational import MeanField, init_mean_field, mean_field_kl, sample
from sidejax.coding.base import Coder, EmptyState, float32_coder, included
from sidejax.distributions import PointMass
from sidejax.fl.base import Algorithm, Batch, ClientInfo, Evaluation, RoundInfo, initial_round_state
from sidejax.fl.local import epoch_order
from sidejax.keys import (
    ORDER,
    POSTERIOR,
    PROJECTIONS,
    SUBSETS,
    ClientKeys,
    client_streams,
    draw_key,
    epoch_key,
    step_key,
    stream_key,
    track_key,
)
from sidejax.utils import check_count, keep_unless_none, masked_mean, stack_clients, tree_all_finite

__all__ = [
    "PFedBayesSettings",
    "CoresetSettings",
    "VITrack",
    "Coreset",
    "PFedBayesServer",
    "PFedBayesClient",
    "SubsetClient",
    "CoresetClient",
    "TrackInfo",
    "per_example_log_likelihood",
    "vi_track",
    "coreset_weights",
    "pfedbayes",
    "pfedbayes_subset",
    "coreset_pfedbayes",
]

KL_SCALE_MODES = ("eq9", "reference")


class PFedBayesSettings(NamedTuple):
    """The variational training of pFedBayes' clients (defaults: docs/papers/coreset_pfedbayes.md#s3-1 /
    docs/papers/coreset_pfedbayes.md#s7).

    Attributes:
      zeta: ``ζ``, the KL weight (a likelihood temperature: larger ``ζ`` pulls ``q`` to ``z``, i.e. *less*
        personalization; the paper's sentence says the opposite,
        docs/papers/coreset_pfedbayes.md#e2). 10.
      local_iters: ``R``, minibatch iterations per round (the reference code's ``local_epochs`` = 20).
      personal_steps: ``R_p``, personal optimizer steps on each minibatch (reference: 5).
      batch_size: ``b`` (100).
      mc_samples: ``K``, reparameterisation samples per step (1).
      eps_std: std of the reparameterisation noise ``g`` (1: Alg. 1; the reference code's 0.001 is a quirk).
      kl_scale_mode: ``"eq9"`` (Eq. 9: data term scaled by ``m/b``, KL weight ``ζ``) or ``"reference"`` (the
        reference code: data term summed over the batch, KL weight ``ζ/R``; Eq. 9 times ``b/n`` with
        ``ζ_eff = ζ n/(b R)``).
      personal_optimizer: the personal tracks' optimizer (``η₁``; the reference code's Adam, 1e-3).
      global_optimizer: the localized global copies' optimizer (``η₂``; Adam, 1e-3).
      beta: the server's mixing ``β`` in ``(0, 1]`` (1: the plain mean).
      init_weight_scale: std of the initial means (``μ⁰ ~ N(0, 0.1²)``, reference code).
      init_rho: the initial ``ρ`` (−3: ``σ₀ ≈ 0.0486``).
    """

    zeta: float = 10.0
    local_iters: int = 20
    personal_steps: int = 5
    batch_size: int = 100
    mc_samples: int = 1
    eps_std: float = 1.0
    kl_scale_mode: str = "eq9"
    personal_optimizer: optax.GradientTransformation = optax.adam(1e-3)
    global_optimizer: optax.GradientTransformation = optax.adam(1e-3)
    beta: float = 1.0
    init_weight_scale: float = 0.1
    init_rho: float = -3.0


class CoresetSettings(NamedTuple):
    """CoreSet-PFedBayes' coreset computation (docs/papers/coreset_pfedbayes.md#s2-3,
    docs/papers/coreset_pfedbayes.md#s7).

    Attributes:
      projection_samples: ``J``, posterior samples of the Monte-Carlo projection (``None``: ``max(100, 2k)``,
        docs/papers/coreset_pfedbayes.md#e6).
      every: recompute the weights in rounds ``t`` with ``t mod every = 0`` (1: every round, the paper's;
        larger values bound the cost of ``J × n`` forward passes per client).
      max_iter, tol: A-IHT's iteration cap and relative-change tolerance (300, 1e-5).
      step_scale: A-IHT's step (1: exact line search; 0.5: the reference code's half step).
      debias: A-IHT II (a de-bias step on the support after each projection).
      sum_to_n: constrain ``Σw = n`` (the client's number of examples), docs/papers/coreset_pfedbayes.md#e6.
      init: the first round's coreset: ``"random"`` (a uniform ``k``-subset with weights ``n/k``, [R]) or
        ``"zeros"`` (the paper's literal ``w = 0``: no data term until the first A-IHT).
    """

    projection_samples: int | None = None
    every: int = 1
    max_iter: int = 300
    tol: float = 1e-5
    step_scale: float = 1.0
    debias: bool = False
    sum_to_n: bool = False
    init: str = "random"


DEFAULT_SETTINGS = PFedBayesSettings()
DEFAULT_CORESET = CoresetSettings()


class VITrack(NamedTuple):
    """A persistent variational track of a client: its posterior and its optimizer state."""

    posterior: MeanField
    opt_state: object


class Coreset(NamedTuple):
    """A client's weighted coreset as ``k`` slots: ``positions [k]`` into its index row and ``weights [k]``
    (non-negative; the nonzero ones first). A slot with weight 0 is not in the coreset."""

    positions: jax.Array
    weights: jax.Array


class PFedBayesServer(NamedTuple):
    """Server state: the global posterior, the round counter every party knows, the coder's state."""

    posterior: MeanField
    round: jax.Array
    coder: object = EmptyState()


class PFedBayesClient(NamedTuple):
    """pFedBayes client: its personal track."""

    personal: VITrack


class SubsetClient(NamedTuple):
    """RandomSubset client: its personal track, its fixed subset and whether it has been drawn."""

    personal: VITrack
    subset: Coreset
    started: jax.Array


class CoresetClient(NamedTuple):
    """CoreSet-PFedBayes client: the full-data track (``q̂``), the coreset track (``q̂_w``, the personal
    model), the coreset and whether it has been initialised."""

    full: VITrack
    coreset_track: VITrack
    coreset: Coreset
    started: jax.Array


class TrackInfo(NamedTuple):
    """Diagnostics of one client's round: the mean personal loss, ``KL(q ‖ z)`` of the uploaded track after
    training, and (CoreSet-PFedBayes; zeros otherwise) ``KL(q̂_w ‖ q̂)``, the relative coreset objective
    ``f(w)/‖y‖²`` of the latest A-IHT, ``Σw``, ``|supp(w)|`` and A-IHT's iterations (0: not recomputed)."""

    kl_to_global: jax.Array
    coreset_kl: jax.Array = 0.0
    coreset_objective: jax.Array = 0.0
    coreset_mass: jax.Array = 0.0
    coreset_support: jax.Array = 0.0
    aiht_iterations: jax.Array = 0


def _check_settings(s: PFedBayesSettings) -> PFedBayesSettings:
    if not isinstance(s, PFedBayesSettings):
        raise ValueError(f"settings must be a PFedBayesSettings, got {type(s).__name__}")
    for name in ("local_iters", "personal_steps", "batch_size", "mc_samples"):
        check_count(getattr(s, name), f"settings.{name}")
    for name in ("zeta", "eps_std", "init_weight_scale"):
        value = getattr(s, name)
        if not (isinstance(value, numbers.Real) and 0 < value < float("inf")):
            raise ValueError(f"settings.{name} must be a finite number > 0, got {value!r}")
    if not (isinstance(s.beta, numbers.Real) and 0 < s.beta <= 1):
        raise ValueError(f"settings.beta must be in (0, 1], got {s.beta!r}")
    if s.kl_scale_mode not in KL_SCALE_MODES:
        raise ValueError(f"settings.kl_scale_mode must be one of {KL_SCALE_MODES}, got {s.kl_scale_mode!r}")
    return s


def per_example_log_likelihood(loss_fn: Callable) -> Callable:
    """``log_lik(params, x [b, ...], y [b], key) -> [b]``: ``ℓ_j = −loss_fn(params, example j, key)``,
    vmapped over the examples (``loss_fn`` must be the mean negative log-likelihood of its batch)."""

    def log_lik(params, x, y, key):
        def one(xj, yj):
            return -loss_fn(params, Batch(xj[None], yj[None], jnp.ones((1,), jnp.float32)), key)

        return jax.vmap(one)(x, y)

    return log_lik


def _uniform_slots(key, count, size: int, num: int):
    """``num`` slots drawn uniformly from the first ``count`` of ``size`` (without replacement when
    ``count >= num``, else with replacement)."""
    with_rep = jax.random.randint(draw_key(key, 1), (num,), 0, jnp.maximum(count, 1))
    if num > size:
        return with_rep
    without = epoch_order(draw_key(key, 0), count, size)[:num]
    return jnp.where(count >= num, without, with_rep)


def _full_data(data):
    """The full-data likelihood as a coreset: every valid position with weight 1."""
    size = data.indices.shape[0]
    valid = jnp.arange(size) < data.num_examples
    return Coreset(jnp.arange(size, dtype=jnp.int32), valid.astype(jnp.float32))


def _kl_weight(s: PFedBayesSettings) -> float:
    return s.zeta if s.kl_scale_mode == "eq9" else s.zeta / s.local_iters


def vi_track(
    settings: PFedBayesSettings,
    log_lik: Callable,
    key,
    track: VITrack,
    prior: MeanField,
    data,
    points: Coreset,
):
    """One round of a variational track (docs/papers/coreset_pfedbayes.md#s2-5 ``ClientUpdate``): ``R``
    iterations, each drawing a minibatch of ``b`` slots uniformly from the nonzero-weight slots of ``points``
    (``m`` of them), taking ``R_p`` steps of the personal optimizer on Eq. 9 (weighted) against the localized
    global copy, then one step of the copy on ``ζ·KL(q ‖ z)`` (scaled as ``kl_scale_mode`` says).

    Keys: iteration ``r`` uses ``step_key(epoch_key(key, 0), r)``: its ``ORDER`` stream draws the minibatch,
    ``draw_key(step, p·K + k)`` the noise of inner step ``p``, MC sample ``k``.

    Args:
      settings: :class:`PFedBayesSettings` (static).
      log_lik: :func:`per_example_log_likelihood` of the model.
      key: the track's key (:func:`sidejax.keys.track_key`).
      track: the personal posterior and its optimizer state.
      prior: the server's global posterior (the localized copy starts from it).
      data: the client's :class:`sidejax.fl.ClientData`.
      points: the weighted points (:class:`Coreset`; the full data: weight 1 at every valid position).

    Returns:
      ``(track, localized_global, mean_loss, finite)``.
    """
    s = settings
    kl_w = _kl_weight(s)
    size = points.weights.shape[0]
    count = jnp.sum(points.weights > 0)
    scale = count.astype(jnp.float32) / s.batch_size if s.kl_scale_mode == "eq9" else 1.0
    ekey = epoch_key(key, 0)

    def personal_loss(v, vz, x, y, w, skey, p):
        def one(k):
            theta = sample(draw_key(skey, p * s.mc_samples + k), v, s.eps_std)
            return jnp.sum(w * log_lik(theta, x, y, skey))

        data_term = jnp.mean(jax.vmap(one)(jnp.arange(s.mc_samples)))
        return -scale * data_term + kl_w * mean_field_kl(v, vz)

    grad_personal = jax.value_and_grad(personal_loss)
    grad_global = jax.grad(lambda vz, v: kl_w * mean_field_kl(v, vz))

    def iteration(carry, r):
        v, opt, vz, vz_opt = carry
        skey = step_key(ekey, r)
        slots = _uniform_slots(stream_key(skey, ORDER), count, size, s.batch_size)
        gidx = data.indices[points.positions[slots]]
        x, y, w = data.x[gidx], data.y[gidx], points.weights[slots]

        def inner(c, p):
            v, opt = c
            loss, g = grad_personal(v, vz, x, y, w, skey, p)
            updates, opt = s.personal_optimizer.update(g, opt, v)
            return (optax.apply_updates(v, updates), opt), loss

        (v, opt), losses = jax.lax.scan(inner, (v, opt), jnp.arange(s.personal_steps))
        gz = grad_global(vz, v)
        updates, vz_opt = s.global_optimizer.update(gz, vz_opt, vz)
        return (v, opt, optax.apply_updates(vz, updates), vz_opt), jnp.mean(losses)

    carry = (track.posterior, track.opt_state, prior, s.global_optimizer.init(prior))
    (v, opt, vz, _), losses = jax.lax.scan(iteration, carry, jnp.arange(s.local_iters))
    finite = jnp.all(jnp.isfinite(losses)) & tree_all_finite((v, vz))
    return VITrack(v, opt), vz, jnp.mean(losses), finite


def coreset_weights(
    settings: PFedBayesSettings,
    coreset: CoresetSettings,
    log_lik: Callable,
    key,
    posterior: MeanField,
    data,
    k: int,
):
    """A-IHT coreset weights of a client from ``J`` samples of ``posterior``
    (docs/papers/coreset_pfedbayes.md#s2-3, Prop. 2).

    ``L[s, j] = ℓ_j(θ_s)``, ``θ_s ~ posterior`` (sample ``s`` from ``draw_key(key, s)``; ``lax.map`` over the
    samples, all the client's examples at once), padding positions set to 0 (a zero column: never useful to
    A-IHT); ``(y, Φ) = projected_potentials(L)``; ``w = aiht(y, Φ, k)``.

    Returns:
      ``(Coreset of the k largest weights, nonzero first; AIHTResult; f(w)/‖y‖²)``.
    """
    size = data.indices.shape[0]
    num = coreset.projection_samples or max(100, 2 * k)
    valid = jnp.arange(size) < data.num_examples
    x, y = data.x[data.indices], data.y[data.indices]

    def row(sidx):
        theta = sample(draw_key(key, sidx), posterior, settings.eps_std)
        return jnp.where(valid, log_lik(theta, x, y, key), 0.0)

    ll = jax.lax.map(row, jnp.arange(num))
    target, phi = projected_potentials(ll)
    result = aiht(
        target,
        phi,
        k,
        max_iter=coreset.max_iter,
        tol=coreset.tol,
        step_scale=coreset.step_scale,
        debias=coreset.debias,
        sum_to=data.num_examples.astype(jnp.float32) if coreset.sum_to_n else None,
    )
    weights, positions = jax.lax.top_k(result.weights, k)
    rel = result.objective / jnp.maximum(jnp.dot(target, target), jnp.finfo(target.dtype).tiny)
    return Coreset(positions.astype(jnp.int32), weights.astype(jnp.float32)), result, rel


def _random_subset(key, data, k: int, reweight: bool) -> Coreset:
    """A uniformly random ``k``-subset of the client's valid positions (weights ``n/k`` or 1)."""
    positions = epoch_order(key, data.num_examples, data.indices.shape[0])[:k]
    valid = jnp.arange(k) < data.num_examples
    mass = data.num_examples.astype(jnp.float32) / k if reweight else 1.0
    return Coreset(positions, jnp.where(valid, mass, 0.0).astype(jnp.float32))


# ----------------------------------------------------------------------------------------------------------
# role kernels shared by the three builders
# ----------------------------------------------------------------------------------------------------------


def _flat(v: MeanField) -> jax.Array:
    """``[μ, ρ]`` as one vector (the messages' layout)."""
    return ravel_pytree(v)[0]


def _unflat(v: MeanField, flat: jax.Array) -> MeanField:
    return ravel_pytree(v)[1](flat)


def _server_init(settings: PFedBayesSettings, coder: Coder, key, params) -> PFedBayesServer:
    v0 = init_mean_field(
        stream_key(key, POSTERIOR), params, weight_scale=settings.init_weight_scale, rho=settings.init_rho
    )
    return PFedBayesServer(v0, jnp.int32(0), coder.init(2 * ravel_pytree(params)[0].shape[0]))


def _track0(settings: PFedBayesSettings, v0: MeanField) -> VITrack:
    return VITrack(v0, settings.personal_optimizer.init(v0))


def _broadcast(coder: Coder, key, server: PFedBayesServer, client_ids):
    del key, client_ids
    return server, vector_downlink(_flat(server.posterior), coder, server.coder)


def _receive(coder: Coder, dkey, keys, server: PFedBayesServer, client, message):
    del dkey, keys, client
    flat = _flat(server.posterior)
    received, _, cstate = receive_vector(message, flat.shape[0], coder, server.coder)
    return server._replace(posterior=_unflat(server.posterior, received), coder=cstate)


def _upload(coder: Coder, keys: ClientKeys, server: PFedBayesServer, localized: MeanField):
    streams = client_streams(keys.private)
    return coder.encode(
        ClientKeys(keys.shared, streams.sample),
        PointMass(_flat(localized)),
        PointMass(_flat(server.posterior)),
        server.coder,
    )


def _uploaded(
    coder: Coder, keys: ClientKeys, server, new_client, track: VITrack, vz: MeanField, loss, finite, **coreset
):
    """A client kernel's result ``(new client state, message, ClientInfo)``: the upload of the localized
    global ``vz`` (:func:`_upload`) and the round's :class:`TrackInfo`, ``KL(q ‖ z)`` of the uploaded
    ``track`` with CoreSet-PFedBayes' ``coreset`` diagnostics (zeros otherwise)."""
    message, cinfo = _upload(coder, keys, server, vz)
    extra = TrackInfo(kl_to_global=mean_field_kl(track.posterior, vz), **coreset)
    return new_client, message, ClientInfo(loss=loss, finite=finite, extra=extra, valid=cinfo.valid)


def _server_update(
    settings: PFedBayesSettings, coder: Coder, rkey, server, client_ids, shared, messages, weights
):
    del rkey, client_ids, weights  # Alg. 1: the uniform mean over the (included) participants
    flat = _flat(server.posterior)
    decoded, checks = jax.vmap(coder.decode, (0, None, None, 0))(
        shared, PointMass(flat), server.coder, messages
    )
    include = included(messages, checks.valid)
    cstate, _ = coder.update(server.coder, checks._replace(valid=include))
    new_flat = (1.0 - settings.beta) * flat + settings.beta * masked_mean(decoded, include)
    new = server._replace(posterior=_unflat(server.posterior, new_flat), round=server.round + 1, coder=cstate)
    new = keep_unless_none(include, new, server)  # with none included, the round counter is kept too
    info = {"global_change": jnp.linalg.norm(_flat(new.posterior) - flat)}
    return new, info, checks.errors


def _metrics(info: RoundInfo) -> dict:
    extra = info.clients.extra
    out = {
        "kl_to_global": jnp.mean(extra.kl_to_global, axis=-1),
        "uplink_floats": jnp.sum(info.uplink_bits, axis=-1) / 32.0,
        "global_change": info.server["global_change"],
    }
    return out


def _coreset_metrics(info: RoundInfo) -> dict:
    extra = info.clients.extra
    return {
        **_metrics(info),
        "coreset_kl": jnp.mean(extra.coreset_kl, axis=-1),
        "coreset_objective": jnp.nanmean(extra.coreset_objective, axis=-1),
        "coreset_mass": jnp.mean(extra.coreset_mass, axis=-1),
        "coreset_support": jnp.mean(extra.coreset_support, axis=-1),
        "aiht_iterations": jnp.mean(extra.aiht_iterations.astype(jnp.float32), axis=-1),
    }


def _common(settings, coder):
    settings = _check_settings(settings)
    coder = float32_coder() if coder is None else coder
    if not isinstance(coder, Coder):
        raise ValueError(f"coder must be a sidejax.coding.Coder, got {type(coder).__name__}")
    return settings, coder


def _eval_global(state):
    return state.server.posterior.mu


def _algorithm(loss_fn, settings, coder, clients_per_round, *, init, client_update, metrics, personal):
    """The shared downlink, server and evaluation kernels around a builder's own ``init`` and client, after
    the checks every builder shares (:func:`_common`).

    ``init = (f, *args)`` and ``client_update = (g, *args)`` name a builder's kernels and its own leading
    arguments: ``f(settings, coder, *args, key, params, num_clients)`` and
    ``g(settings, coder, log_lik, *args, keys, server, client, data)`` with the checked ``settings`` and
    ``coder`` and ``log_lik = per_example_log_likelihood(loss_fn)``."""
    settings, coder = _common(settings, coder)
    log_lik = per_example_log_likelihood(loss_fn)
    (init_fn, *init_args), (client_fn, *client_args) = init, client_update
    return Algorithm(
        init=functools.partial(init_fn, settings, coder, *init_args),
        broadcast=functools.partial(_broadcast, coder),
        receive=functools.partial(_receive, coder),
        client_update=functools.partial(client_fn, settings, coder, log_lik, *client_args),
        server_update=functools.partial(_server_update, settings, coder),
        evaluation=Evaluation(_eval_global, personal=personal),
        clients_per_round=clients_per_round,
        metrics=metrics,
    )


# ----------------------------------------------------------------------------------------------------------
# pFedBayes
# ----------------------------------------------------------------------------------------------------------


def _pfb_init(settings, coder, key, params, num_clients):
    server = _server_init(settings, coder, key, params)
    clients = stack_clients(PFedBayesClient(_track0(settings, server.posterior)), num_clients)
    return initial_round_state(server, clients, num_clients)


def _pfb_client(settings, coder, log_lik, keys, server, client: PFedBayesClient, data):
    tkey = track_key(client_streams(keys.private).train, 0)
    track, vz, loss, finite = vi_track(
        settings, log_lik, tkey, client.personal, server.posterior, data, _full_data(data)
    )
    return _uploaded(coder, keys, server, PFedBayesClient(track), track, vz, loss, finite)


def pfedbayes(
    loss_fn: Callable,
    *,
    clients_per_round: int,
    settings: PFedBayesSettings = DEFAULT_SETTINGS,
    coder: Coder | None = None,
) -> Algorithm:
    """pFedBayes (Zhang et al. 2022; docs/papers/coreset_pfedbayes.md#s2-2, the full-data track of Alg. 1).

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> scalar`` mean negative log-likelihood of the model.
      clients_per_round: participants per round (the paper: all 10).
      settings: :class:`PFedBayesSettings`.
      coder: the uplink coder of the localized global ``(μ, ρ)`` (default float32: ``64 P`` bits).

    Returns:
      An :class:`sidejax.fl.Algorithm` whose ``evaluation.personal`` is every client's personal posterior
      mean.
    """
    return _algorithm(
        loss_fn,
        settings,
        coder,
        clients_per_round,
        init=(_pfb_init,),
        client_update=(_pfb_client,),
        metrics=_metrics,
        personal=lambda state: state.clients.personal.posterior.mu,
    )


# ----------------------------------------------------------------------------------------------------------
# RandomSubset
# ----------------------------------------------------------------------------------------------------------


def _empty_coreset(k: int) -> Coreset:
    return Coreset(jnp.zeros((k,), jnp.int32), jnp.zeros((k,), jnp.float32))


def _subset_init(settings, coder, k, key, params, num_clients):
    server = _server_init(settings, coder, key, params)
    client = SubsetClient(_track0(settings, server.posterior), _empty_coreset(k), jnp.asarray(False))
    return initial_round_state(server, stack_clients(client, num_clients), num_clients)


def _check_k(k: int, data, name: str) -> None:
    size = data.indices.shape[0]
    if k > size:
        raise ValueError(
            f"{name}={k} exceeds the number of points a client holds (its padded index row has {size}); "
            f"choose {name} <= {size}"
        )


def _subset_client(settings, coder, log_lik, k, reweight, keys, server, client: SubsetClient, data):
    _check_k(k, data, "subset_size")
    fresh = _random_subset(stream_key(keys.private, SUBSETS), data, k, reweight)
    subset = jax.tree.map(lambda a, b: jnp.where(client.started, a, b), client.subset, fresh)
    tkey = track_key(client_streams(keys.private).train, 0)
    track, vz, loss, finite = vi_track(
        settings, log_lik, tkey, client.personal, server.posterior, data, subset
    )
    new = SubsetClient(track, subset, jnp.asarray(True))
    return _uploaded(coder, keys, server, new, track, vz, loss, finite)


def pfedbayes_subset(
    loss_fn: Callable,
    *,
    clients_per_round: int,
    subset_size: int,
    reweight: bool = False,
    settings: PFedBayesSettings = DEFAULT_SETTINGS,
    coder: Coder | None = None,
) -> Algorithm:
    """The RandomSubset baseline (docs/papers/coreset_pfedbayes.md#baselines): pFedBayes on a fixed uniformly
    random subset of ``subset_size`` points per client, drawn from the client's ``SUBSETS`` stream in its
    first round and kept. ``reweight=False``: unit weights (scale ``k/b``, the paper's); ``True``: weights
    ``n/k``.

    Raises:
      ValueError: ``subset_size`` not an integer >= 1 (here), or larger than a client's data (when traced).
    """
    k = check_count(subset_size, "subset_size")
    return _algorithm(
        loss_fn,
        settings,
        coder,
        clients_per_round,
        init=(_subset_init, k),
        client_update=(_subset_client, k, bool(reweight)),
        metrics=_metrics,
        personal=lambda state: state.clients.personal.posterior.mu,
    )


# ----------------------------------------------------------------------------------------------------------
# CoreSet-PFedBayes
# ----------------------------------------------------------------------------------------------------------


def _coreset_init(settings, coder, k, key, params, num_clients):
    server = _server_init(settings, coder, key, params)
    track = _track0(settings, server.posterior)
    client = CoresetClient(track, track, _empty_coreset(k), jnp.asarray(False))
    return initial_round_state(server, stack_clients(client, num_clients), num_clients)


def _coreset_client(
    settings, coder, log_lik, cs: CoresetSettings, k, keys, server, client: CoresetClient, data
):
    _check_k(k, data, "coreset_size")
    train = client_streams(keys.private).train
    # the first round's coreset (docs/papers/coreset_pfedbayes.md#e7): a random k-subset with weights n/k, or
    # the paper's w = 0
    if cs.init == "random":
        fresh = _random_subset(stream_key(keys.private, SUBSETS), data, k, reweight=True)
    else:
        fresh = _empty_coreset(k)
    coreset = jax.tree.map(lambda a, b: jnp.where(client.started, a, b), client.coreset, fresh)
    # the full-data track: q̂ (π̂ of the projection)
    full, _, _, finite_full = vi_track(
        settings, log_lik, track_key(train, 0), client.full, server.posterior, data, _full_data(data)
    )
    # the coreset track on the current weights: q̂_w and the coreset-localized global (the upload)
    ctrack, vz, loss, finite = vi_track(
        settings, log_lik, track_key(train, 1), client.coreset_track, server.posterior, data, coreset
    )

    # new weights by A-IHT from samples of q̂ (every cs.every rounds; the round is known to every party, so
    # the branch is a real conditional under vmap)
    def recompute(_):
        new, result, rel = coreset_weights(
            settings, cs, log_lik, stream_key(keys.private, PROJECTIONS), full.posterior, data, k
        )
        return new, rel, result.iterations

    def keep(_):
        return coreset, jnp.float32(jnp.nan), jnp.int32(0)

    refresh = (server.round % cs.every) == 0
    new_coreset, rel, iters = jax.lax.cond(refresh, recompute, keep, None)
    new = CoresetClient(full, ctrack, new_coreset, jnp.asarray(True))
    finite = finite & finite_full & jnp.all(jnp.isfinite(new_coreset.weights))
    diagnostics = dict(
        coreset_kl=mean_field_kl(ctrack.posterior, full.posterior),
        coreset_objective=rel,
        coreset_mass=jnp.sum(new_coreset.weights),
        coreset_support=jnp.sum(new_coreset.weights > 0).astype(jnp.float32),
        aiht_iterations=iters,
    )
    return _uploaded(coder, keys, server, new, ctrack, vz, loss, finite, **diagnostics)


def coreset_pfedbayes(
    loss_fn: Callable,
    *,
    clients_per_round: int,
    coreset_size: int,
    settings: PFedBayesSettings = DEFAULT_SETTINGS,
    coreset: CoresetSettings = DEFAULT_CORESET,
    coder: Coder | None = None,
) -> Algorithm:
    """CoreSet-PFedBayes (Alg. 1 as corrected in docs/papers/coreset_pfedbayes.md#s2-5; module docstring).

    Args:
      loss_fn: the model's mean negative log-likelihood ``loss_fn(params, batch, key)``.
      clients_per_round: participants per round (the paper: all 10).
      coreset_size: ``k = n_k``, the coreset size (static; the paper's fractions 50/30/15/10% of ``n``).
      settings: :class:`PFedBayesSettings` of both tracks.
      coreset: :class:`CoresetSettings`.
      coder: the uplink coder of the coreset track's localized global (default float32).

    Returns:
      An :class:`sidejax.fl.Algorithm`; its ``evaluation.personal`` gives the coreset tracks' means (``q̂_w``,
      the paper's personal model, docs/papers/coreset_pfedbayes.md#s2-6); the algorithm's metrics log
      ``KL(q̂_w ‖ q̂)``, ``f/‖y‖²`` (NaN in a round without A-IHT), ``Σw``, ``|supp w|`` and A-IHT's
      iterations.

    Raises:
      ValueError: ``coreset_size`` not an integer >= 1 (here) or larger than a client's data (when traced),
        bad settings.
    """
    k = check_count(coreset_size, "coreset_size")
    if not isinstance(coreset, CoresetSettings):
        raise ValueError(f"coreset must be a CoresetSettings, got {type(coreset).__name__}")
    check_count(coreset.every, "coreset.every")
    check_count(coreset.max_iter, "coreset.max_iter")
    if (
        coreset.projection_samples is not None
        and check_count(coreset.projection_samples, "coreset.projection_samples", 2) <= k
    ):
        raise ValueError(
            f"coreset.projection_samples={coreset.projection_samples} must exceed coreset_size={k}: with "
            f"J <= k A-IHT fits the J samples exactly with weights of any total mass "
            f"(docs/papers/coreset_pfedbayes.md#e6); use None for max(100, 2k)"
        )
    if coreset.init not in ("random", "zeros"):
        raise ValueError(f"coreset.init must be 'random' or 'zeros', got {coreset.init!r}")
    return _algorithm(
        loss_fn,
        settings,
        coder,
        clients_per_round,
        init=(_coreset_init, k),
        client_update=(_coreset_client, coreset, k),
        metrics=_coreset_metrics,
        personal=lambda state: state.clients.coreset_track.posterior.mu,
    )
