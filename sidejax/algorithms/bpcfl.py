r"""BPC-FL: one-shot Bayesian federated learning with function-space pseudocoresets (d'Hondt, Pechenizkiy,
Peharz; docs/papers/bpcfl.md), on the round engine.

One round (the only one: the method is one-shot, paper Alg. 1 / docs/papers/bpcfl.md#a1):

1. **Downlink.** Nothing is sent (0 bits): the shared initialisation seeds of the expert trajectories come
   from the round's downlink key, which every party derives (``stream_key(downlink_key, EXPERTS)``;
   trajectory ``j`` starts from ``init_fn(draw_key(., j))`` on *every* client, docs/papers/bpcfl.md#a0).
2. **Clients** (all of them, in parallel). Client ``m`` pretrains ``J`` MAP trajectories on
   ``mean NLL + (λ/2)‖θ‖²`` (docs/papers/bpcfl.md#a0 and docs/papers/bpcfl.md#s8-6), initialises
   ``C_m = (Z_m, ŷ_m)`` (docs/papers/bpcfl.md#a3: ``Z ~ N(X̄_m, σ_z² I)``, labels cycled by frequency or
   ``mean(y)`` for regression), learns it by BPC-fKL (docs/papers/bpcfl.md#a2:
   ``num_updates`` SGD steps along ``E_D[∇_C ℓ̄] − E_C[∇_C ℓ̄]``, **sign corrected** against the paper's
   eq. (14) and Alg. 2 line 10; no gradient through the inner chain), and sends ``(Z_m, ŷ_m, n_m)`` once
   through the coder (:func:`sidejax.coding.pseudocoreset_coder`: a real stream, whose length is the
   reported rate).
3. **Server.** It decodes every stream, concatenates the pseudocoresets with weights ``w_m = M n_m / N``
   taken from the *decoded* counts (docs/papers/bpcfl.md#a4), and runs the downstream inference
   (docs/papers/bpcfl.md#a5) on

   .. math:: \log \tilde p(\theta\mid C) = -\tfrac{\lambda}{2}\|\theta\|^2
      + \beta \sum_m w_m \sum_k \log p(\hat y_{mk}\mid f(z_{mk},\theta)),

   (the likelihood summed over the coreset, explicit scale ``β``: docs/papers/bpcfl.md#s8-7) with an
   :class:`Inference`: :func:`map_inference` (SGD / Adam MAP, one "sample"), :func:`hmc_inference` (full-batch
   HMC through blackjax) or :func:`sgld_inference` (an addition beyond the paper). The samples are the server
   state; ``eval_params`` returns them with a leading sample axis (``evaluation.ensemble``: the Bayesian
   predictive ``(1/S) Σ_s p(y | f(x, θ_s))``).

Resolutions applied (docs/papers/bpcfl.md#s8): the inner chain and the pretraining descend the mean-reduced
NLL plus the prior's ``λ/2‖θ‖²`` (docs/papers/bpcfl.md#s8-6); one isotropic noise ``σ_ε`` for both terms
(docs/papers/bpcfl.md#s8-2); the start checkpoint ``r`` is at most ``max_start`` (default ``L_D``, the literal
"r ≤ L_D", docs/papers/bpcfl.md#s8-3), so only ``max_start + L_D`` pretraining steps are ever used and only
those are run (pitfall 3: memory, docs/papers/bpcfl.md#s9-3); ``B_w`` independent (trajectory, r) pairs per
update with ``S`` noise draws each (docs/papers/bpcfl.md#s8-4); concatenation, not a product of function-space
priors (docs/papers/bpcfl.md#s8-9).

Every party holds only what it could know: clients never see each other's data, and the server sees only
the decoded streams.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.pfedbayes import per_example_log_likelihood
from sidejax.bayes.inference import hmc, map_estimate, sgld
from sidejax.bayes.pseudocoresets import (
    Pseudocoreset,
    aggregate_pseudocoresets,
    coreset_logdensity,
    expert_trajectories,
    init_pseudocoreset,
    learn_pseudocoreset,
    trajectory_pairs,
)
from sidejax.coding.base import Coder, EmptyState, Message, empty_message, included
from sidejax.coding.pseudocoreset import pack_pseudocoreset, pseudocoreset_coder, unpack_pseudocoreset
from sidejax.distributions import PointMass
from sidejax.fl.base import (
    Algorithm,
    Batch,
    ClientData,
    ClientInfo,
    Evaluation,
    RoundState,
    initial_round_state,
)
from sidejax.keys import EXPERTS, PSEUDOCORESET, SERVER, ClientKeys, client_streams, draw_key, stream_key
from sidejax.types import Params, PRNGKey
from sidejax.utils import check_count, keep_unless_none, tree_all_finite

__all__ = [
    "BPCFLSettings",
    "Inference",
    "InferenceResult",
    "map_inference",
    "hmc_inference",
    "sgld_inference",
    "BPCFLServer",
    "BPCFLReceived",
    "BPCFLClientInfo",
    "BPCFLServerInfo",
    "check_settings",
    "coreset_posterior",
    "check_client_sizes",
    "uplink_floats",
    "bpcfl_init",
    "bpcfl_broadcast",
    "bpcfl_receive",
    "bpcfl_client_update",
    "bpcfl_server_update",
    "bpcfl",
]


class BPCFLSettings(NamedTuple):
    """BPC-FL's client hyperparameters (docs/papers/bpcfl.md#table-2; names as there,
    docs/papers/bpcfl.md#s8-18 for ``num_updates``).

    Attributes:
      num_points: ``K``, pseudo-points per client.
      num_classes: ``C`` (classification: fixed, frequency-cycled labels) or ``None`` (regression: labels
        initialised at ``mean(y)`` and learned with ``step_size_labels``).
      prior_precision: ``λ`` of ``p0 = N(0, λ⁻¹ I)`` (pretraining, inner chain, server posterior).
      init_std: ``σ_z``, the std of the initial pseudo-inputs around the client's mean input.
      num_updates: ``K_upd``, BPC-fKL updates.
      step_size_inputs: ``ψ_x`` (SGD on ``Z``).
      step_size_labels: ``ψ_y`` (SGD on ``ŷ``; 0 for classification).
      pairs_per_update: ``B_w``, (trajectory, start) pairs per update ("weight mc samples per update").
      num_noise: ``S``, noise draws per pair.
      noise_std: ``σ_ε``.
      num_trajectories: ``J``, expert trajectories per client (shared initialisations).
      pretrain_steps: ``T_pre`` (an upper bound: only ``max_start + L_D`` steps are run, the rest is never
        used).
      save_interval: optimizer steps between checkpoints (5).
      pretrain_batch_size: real-data minibatch of pretraining (``None``: full batch, masked).
      pretrain_optimizer: Optax optimizer of pretraining (docs/papers/bpcfl.md#s8-6: the "mcmc sampler" with
        lr 1e-2).
      chain_optimizer: the inner chain's optimizer (the "mcmc sampler" with step ``η``; a fresh state at
        every start).
      data_chain_length: ``L_D`` in optimizer steps (a multiple of ``save_interval``).
      coreset_chain_length: ``L_C``.
      max_start: the latest start checkpoint ``r`` in steps (``None``: ``L_D``, the literal reading).
      likelihood_scale: ``β`` of the server posterior.
      trajectories_per_step: trajectories pretrained at once (``None``: all, vmapped; a number bounds the
        memory of the pretraining, ``lax.map``).
    """

    num_points: int
    num_classes: int | None
    prior_precision: float
    init_std: float
    num_updates: int
    step_size_inputs: float
    step_size_labels: float
    pairs_per_update: int
    num_noise: int
    noise_std: float
    num_trajectories: int
    pretrain_steps: int
    pretrain_batch_size: int | None
    pretrain_optimizer: optax.GradientTransformation
    chain_optimizer: optax.GradientTransformation
    data_chain_length: int
    coreset_chain_length: int
    save_interval: int = 5
    max_start: int | None = None
    likelihood_scale: float = 1.0
    trajectories_per_step: int | None = None

    @property
    def start_limit(self) -> int:
        """The latest start checkpoint in optimizer steps (``max_start``, default ``L_D``)."""
        return self.data_chain_length if self.max_start is None else self.max_start

    @property
    def steps_used(self) -> int:
        """Pretraining steps actually run: ``max_start + L_D`` (the later checkpoints are never drawn)."""
        return self.start_limit + self.data_chain_length


def _real(value, name: str, *, low: float = 0.0, strict: bool = True) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):
        raise ValueError(
            f"settings.{name} must be a finite number {'>' if strict else '>='} {low}, got {value!r}"
        )
    return float(value)


def check_settings(settings: BPCFLSettings) -> BPCFLSettings:
    """Validates :class:`BPCFLSettings`, naming the field at fault (``r + L_D <= T_pre``,
    docs/papers/bpcfl.md#t10)."""
    s = settings
    counts = (
        "num_points",
        "num_updates",
        "pairs_per_update",
        "num_noise",
        "num_trajectories",
        "pretrain_steps",
    )
    for name in (*counts, "save_interval"):
        check_count(getattr(s, name), f"settings.{name}", 1)
    check_count(s.coreset_chain_length, "settings.coreset_chain_length", 0)
    check_count(s.data_chain_length, "settings.data_chain_length", 0)
    if s.num_classes is not None:
        check_count(s.num_classes, "settings.num_classes", 2)
    if s.pretrain_batch_size is not None:
        check_count(s.pretrain_batch_size, "settings.pretrain_batch_size", 1)
    if s.trajectories_per_step is not None:
        check_count(s.trajectories_per_step, "settings.trajectories_per_step", 1)
    _real(s.prior_precision, "prior_precision")
    _real(s.init_std, "init_std")
    _real(s.likelihood_scale, "likelihood_scale")
    _real(s.step_size_inputs, "step_size_inputs", strict=False)
    _real(s.step_size_labels, "step_size_labels", strict=False)
    _real(s.noise_std, "noise_std", strict=False)
    if s.num_classes is not None and s.step_size_labels != 0:
        raise ValueError(
            "settings.step_size_labels must be 0 for classification: the labels are fixed, frequency-cycled "
            "class ids (docs/papers/bpcfl.md#a3; psi_y = 0 in every classification experiment)"
        )
    start = check_count(s.start_limit, "settings.max_start", 0)
    for name, value in (("data_chain_length", s.data_chain_length), ("max_start", start)):
        if value % s.save_interval:
            raise ValueError(
                f"settings.{name}={value} must be a multiple of settings.save_interval={s.save_interval}: "
                f"the samples are stored checkpoints"
            )
    if s.steps_used > s.pretrain_steps:
        raise ValueError(
            f"settings.max_start + settings.data_chain_length = {start} + {s.data_chain_length} exceeds "
            f"settings.pretrain_steps={s.pretrain_steps} (docs/papers/bpcfl.md#t10: r + L_D <= T_pre); lower "
            f"max_start or pretrain longer"
        )
    return s


def check_client_sizes(num_points: int, num_examples) -> None:
    """Host-side check of a federation before a run: every client needs at least ``num_points`` (``K``)
    examples (a pseudocoreset larger than the client's data is refused) and there must be at least one
    client.

    Raises:
      ValueError: naming the clients at fault.
    """
    n = np.asarray(num_examples).reshape(-1)
    if n.size == 0:
        raise ValueError("BPC-FL needs at least one client with data; got zero clients")
    small = np.flatnonzero(n < num_points)
    if small.size:
        raise ValueError(
            f"num_points={num_points} (the pseudocoreset size K) exceeds the data of "
            f"client(s) {small[:10].tolist()} (with {n[small[:10]].tolist()} examples): a pseudocoreset must "
            f"be smaller than its client's data; lower num_points"
        )


def uplink_floats(settings: BPCFLSettings, input_dim: int, *, one_hot: bool = False) -> int:
    """The paper's communication convention (docs/papers/bpcfl.md#a8), per client: ``K·D + K·d_ŷ + 1``
    "floats" (``d_ŷ = 1`` for integer labels or regression, ``C`` for one-hot labels; ``+1`` for ``n_m``). A
    formula, reported beside the measured stream length (``RoundInfo.uplink_bits``), never instead of it."""
    d_y = settings.num_classes if (one_hot and settings.num_classes is not None) else 1
    return settings.num_points * (input_dim + d_y) + 1


# --- downstream inference (docs/papers/bpcfl.md#a5) ---------------------------------------------------------


class InferenceResult(NamedTuple):
    """``samples`` (leading ``[S]`` axis), ``finite``, HMC's ``num_divergent`` and mean ``acceptance`` (0 and
    NaN for the other samplers)."""

    samples: Any
    finite: jax.Array
    num_divergent: jax.Array
    acceptance: jax.Array


class Inference(NamedTuple):
    """A downstream inference on ``log p̃(θ | C)``: ``run(key, logdensity_fn, init_position) ->
    InferenceResult`` with ``num_samples`` samples (static), and a ``name`` for tables."""

    run: Callable[[PRNGKey, Callable, Params], InferenceResult]
    num_samples: int
    name: str


def map_inference(optimizer: optax.GradientTransformation, num_steps: int, *, name: str = "map") -> Inference:
    """Full-batch MAP by ``num_steps`` Optax steps (docs/papers/bpcfl.md#a5: BPC-FL + SGD, ``sgd(2e-2)``
    × 500 on moons; + Adam, ``adam(1e-2)`` × 300 on regression); one "sample", the MAP estimate."""
    num_steps = check_count(num_steps, "num_steps", 1)

    def run(key, logdensity_fn, init_position):
        del key
        out = map_estimate(logdensity_fn, init_position, optimizer=optimizer, num_steps=num_steps)
        samples = jax.tree.map(lambda a: a[None], out.position)
        return InferenceResult(samples, out.finite, jnp.int32(0), jnp.float32(jnp.nan))

    return Inference(run, 1, name)


def hmc_inference(
    *,
    step_size: float,
    num_integration_steps: int,
    inverse_mass_matrix: float,
    num_burnin: int,
    num_samples: int,
    mode: str = "consecutive",
    start: Inference | None = None,
) -> Inference:
    """Full-batch HMC through blackjax (docs/papers/bpcfl.md#a5, docs/papers/bpcfl.md#table-7: moons
    ``ε = 2e-3``, ``L = 30``, ``M⁻¹ = 100·I``, 40 burn-in steps, 50 samples), ``mode`` ``"consecutive"``
    (burn-in, then consecutive states) or ``"chains"`` (independent chains, final states;
    docs/papers/bpcfl.md#s8-10). ``start``: an optional MAP inference whose estimate is the chain's start (the
    option of docs/papers/bpcfl.md#s8-10 for EMNIST); otherwise the network initialisation. Divergent
    transitions are counted in the result (``num_divergent``; the driver reports them)."""
    check_count(num_samples, "num_samples", 1)

    def run(key, logdensity_fn, init_position):
        if start is not None:
            pos = start.run(draw_key(key, 1), logdensity_fn, init_position).samples
            init_position = jax.tree.map(lambda a: a[0], pos)
        out = hmc(
            draw_key(key, 0),
            logdensity_fn,
            init_position,
            step_size=step_size,
            num_integration_steps=num_integration_steps,
            inverse_mass_matrix=inverse_mass_matrix,
            num_burnin=num_burnin,
            num_samples=num_samples,
            mode=mode,
        )
        return InferenceResult(
            out.samples, tree_all_finite(out.samples), out.num_divergent, jnp.mean(out.acceptance_rate)
        )

    return Inference(run, int(num_samples), "hmc")


def sgld_inference(*, step_size: float, num_burnin: int, num_samples: int, thinning: int = 1) -> Inference:
    """Full-batch SGLD (an addition beyond the paper; :func:`sidejax.bayes.sgld`)."""
    check_count(num_samples, "num_samples", 1)

    def run(key, logdensity_fn, init_position):
        out = sgld(
            key,
            logdensity_fn,
            init_position,
            step_size=step_size,
            num_burnin=num_burnin,
            num_samples=num_samples,
            thinning=thinning,
        )
        return InferenceResult(out.samples, out.finite, jnp.int32(0), jnp.float32(jnp.nan))

    return Inference(run, int(num_samples), "sgld")


# --- states and kernels -----------------------------------------------------------------------------------


class BPCFLServer(NamedTuple):
    """The server state: ``params`` (the network initialisation, the downstream chain's start), the
    aggregated ``coreset`` (``[M K, ...]``) and its per-point ``weights`` (zeros before the round), and the
    posterior ``samples`` (leading ``[S]`` axis; copies of ``params`` before the round)."""

    params: Params
    coreset: Pseudocoreset
    weights: jax.Array
    samples: Params


class BPCFLReceived(NamedTuple):
    """What a client takes from the (empty) downlink: the shared key of the expert initialisations."""

    expert_key: PRNGKey


class BPCFLClientInfo(NamedTuple):
    """Per client: the BPC-fKL surrogate ``J`` at the first and last update, the last gradient norm."""

    surrogate_first: jax.Array
    surrogate_last: jax.Array
    grad_norm_last: jax.Array


class BPCFLServerInfo(NamedTuple):
    """The downstream inference's ``finite``, ``num_divergent`` and ``acceptance``."""

    finite: jax.Array
    num_divergent: jax.Array
    acceptance: jax.Array


def _sq_norm(params) -> jax.Array:
    flat, _ = ravel_pytree(params)
    return jnp.dot(flat, flat)


def _label_dtype(settings: BPCFLSettings):
    return jnp.float32 if settings.num_classes is None else jnp.int32


def bpcfl_init(
    settings: BPCFLSettings,
    inference: Inference,
    input_shape,
    clients_per_round: int,
    key,
    params,
    num_clients,
) -> RoundState:
    """The server state before the round (coreset zeros, samples = copies of ``params``).

    Raises:
      ValueError: ``clients_per_round != num_clients`` (the method is one-shot: every client uploads once).
    """
    if clients_per_round != num_clients:
        raise ValueError(
            f"BPC-FL is one-shot: every client uploads its pseudocoreset in the one round, so "
            f"clients_per_round ({clients_per_round}) must equal num_clients ({num_clients})"
        )
    del key
    total = num_clients * settings.num_points
    coreset = Pseudocoreset(
        jnp.zeros((total, *input_shape), jnp.float32), jnp.zeros((total,), _label_dtype(settings))
    )
    samples = jax.tree.map(lambda a: jnp.repeat(a[None], inference.num_samples, axis=0), params)
    server = BPCFLServer(params, coreset, jnp.zeros((total,), jnp.float32), samples)
    return initial_round_state(server, EmptyState(), num_clients)


def bpcfl_broadcast(key, server: BPCFLServer, client_ids) -> tuple[BPCFLServer, Message]:
    """Nothing is sent (docs/papers/bpcfl.md#a8: downlink 0 floats; the shared seeds come from the common
    key)."""
    del key, client_ids
    return server, empty_message()


def bpcfl_receive(dkey, keys, server, cstate, message) -> BPCFLReceived:
    """The shared key of the expert initialisations, ``stream_key(downlink_key, EXPERTS)``."""
    del keys, server, cstate, message
    return BPCFLReceived(stream_key(dkey, EXPERTS))


def bpcfl_client_update(
    loss_fn: Callable,
    init_fn: Callable,
    settings: BPCFLSettings,
    coder: Coder,
    keys: ClientKeys,
    received: BPCFLReceived,
    state,
    data: ClientData,
):
    """Client ``m``: expert trajectories (docs/papers/bpcfl.md#a0), pseudocoreset init
    (docs/papers/bpcfl.md#a3) and BPC-fKL (docs/papers/bpcfl.md#a2), then the upload of ``(Z_m, ŷ_m, n_m)``.
    ``loss_fn(params, Batch, key)`` is the mean NLL of a masked batch (the loss contract); the prior's
    ``λ/2‖θ‖²`` is added here."""
    s = settings
    max_examples = data.indices.shape[0]
    if s.num_points > max_examples:
        raise ValueError(
            f"settings.num_points={s.num_points} (the pseudocoreset size K) exceeds every client's data (at "
            f"most {max_examples} examples): lower num_points"
        )
    x = data.x[data.indices].astype(jnp.float32)
    y = data.y[data.indices]
    valid = jnp.arange(max_examples) < data.num_examples
    train, _ = client_streams(keys.private)
    loss_key = stream_key(train, EXPERTS)  # handed to loss_fn (unused by deterministic models)
    lam = s.prior_precision

    def pretrain_loss(params, xb, yb):
        mask = valid.astype(jnp.float32) if s.pretrain_batch_size is None else jnp.ones(xb.shape[0])
        return loss_fn(params, Batch(xb, yb, mask), loss_key) + 0.5 * lam * _sq_norm(params)

    trajectories = expert_trajectories(
        init_fn,
        pretrain_loss,
        received.expert_key,
        stream_key(train, EXPERTS),
        x,
        y,
        valid,
        num_trajectories=s.num_trajectories,
        num_steps=s.steps_used if s.steps_used > 0 else s.save_interval,
        save_interval=s.save_interval,
        batch_size=s.pretrain_batch_size,
        optimizer=s.pretrain_optimizer,
        trajectories_per_step=s.trajectories_per_step,
    )
    pairs = trajectory_pairs(
        trajectories,
        data_offset=s.data_chain_length,
        save_interval=s.save_interval,
        num_pairs=s.pairs_per_update,
    )
    pc_key = stream_key(train, PSEUDOCORESET)
    coreset = init_pseudocoreset(
        draw_key(pc_key, 0), x, y, valid, s.num_points, init_std=s.init_std, num_classes=s.num_classes
    )
    ones = jnp.ones((s.num_points,), jnp.float32)

    def coreset_loss(c, params):  # ℓ̄(C, θ) + λ/2‖θ‖² (the prior term does not depend on C)
        return loss_fn(params, Batch(c.inputs, c.labels, ones), loss_key) + 0.5 * lam * _sq_norm(params)

    coreset, info = learn_pseudocoreset(
        coreset_loss,
        coreset,
        draw_key(pc_key, 1),
        sample_pairs=pairs,
        num_updates=s.num_updates,
        optimizer=s.chain_optimizer,
        chain_length=s.coreset_chain_length,
        step_size_inputs=s.step_size_inputs,
        step_size_labels=s.step_size_labels,
        noise_std=s.noise_std,
        num_noise=s.num_noise,
    )
    q = PointMass(pack_pseudocoreset(coreset.inputs, coreset.labels, data.num_examples))
    message, cinfo = coder.encode(keys, q, None, coder.init(q.value.shape[0]))
    finite = tree_all_finite((coreset.inputs, info.surrogate))
    extra = BPCFLClientInfo(info.surrogate[0], info.surrogate[-1], info.grad_norm[-1])
    return state, message, ClientInfo(jnp.mean(info.surrogate), finite, extra, cinfo.valid)


def coreset_posterior(loss_fn: Callable, settings: BPCFLSettings, coreset: Pseudocoreset, weights, key):
    """The server's ``log p̃(θ | C)`` (docs/papers/bpcfl.md#a4) of an aggregated pseudocoreset: per-point
    log-likelihoods from the loss contract (``−loss_fn`` on one-point batches, ``key`` handed to it), weighted
    by ``weights``, scaled by ``settings.likelihood_scale``, plus the prior
    ``N(0, settings.prior_precision⁻¹ I)``. What :func:`bpcfl_server_update` runs its inference on, and what a
    caller re-running another inference on a server state's ``coreset`` / ``weights`` should use."""
    log_lik = per_example_log_likelihood(loss_fn)
    return coreset_logdensity(
        lambda params, zs, ys: log_lik(params, zs, ys, key),
        coreset,
        weights,
        prior_precision=settings.prior_precision,
        likelihood_scale=settings.likelihood_scale,
    )


def bpcfl_server_update(
    loss_fn: Callable,
    settings: BPCFLSettings,
    inference: Inference,
    coder: Coder,
    input_shape,
    round_key,
    server: BPCFLServer,
    client_ids,
    shared_keys,
    messages: Message,
    weights,
):
    """Decode every upload, aggregate the included ones (:func:`sidejax.coding.included`) with
    ``w_m = M n_m / N`` from the decoded counts (docs/papers/bpcfl.md#a4; excluded clients' points weigh 0,
    ``M`` and ``N`` count the included clients alone; with none included the state is kept), run the
    downstream inference on ``log p̃(θ | C)`` (docs/papers/bpcfl.md#a5) with ``stream_key(round_key,
    SERVER)``."""
    del client_ids, weights  # the server uses the counts it received, not the engine's bookkeeping
    k = settings.num_points
    dim = k * (math.prod(input_shape) + 1) + 1
    p = PointMass(jnp.zeros((dim,), jnp.float32))
    values, decoded = jax.vmap(coder.decode, (0, None, None, 0))(shared_keys, p, coder.init(dim), messages)
    classes = settings.num_classes is not None
    inputs, labels, counts = jax.vmap(
        lambda v: unpack_pseudocoreset(v, k, tuple(input_shape), classes=classes)
    )(values)
    include = included(messages, decoded.valid)
    coreset, point_weights = aggregate_pseudocoresets(Pseudocoreset(inputs, labels), counts, include)
    loss_key = stream_key(round_key, SERVER)
    logdensity = coreset_posterior(loss_fn, settings, coreset, point_weights, loss_key)
    out = inference.run(draw_key(loss_key, 0), logdensity, server.params)
    new = keep_unless_none(include, BPCFLServer(server.params, coreset, point_weights, out.samples), server)
    info = BPCFLServerInfo(out.finite, out.num_divergent, out.acceptance)
    return new, info, decoded.errors


def _eval_params(state: RoundState):
    return state.server.samples


def _metrics(info) -> dict:
    extra = info.clients.extra
    return {
        "coreset_surrogate_first": jnp.mean(extra.surrogate_first, axis=-1),
        "coreset_surrogate_last": jnp.mean(extra.surrogate_last, axis=-1),
        "hmc_divergent": info.server.num_divergent,
        "hmc_acceptance": info.server.acceptance,
    }


def bpcfl(
    loss_fn: Callable,
    init_fn: Callable,
    *,
    input_shape: tuple[int, ...],
    num_clients: int,
    settings: BPCFLSettings,
    inference: Inference,
    coder: Coder | None = None,
) -> Algorithm:
    """BPC-FL (docs/papers/bpcfl.md#a1) as an :class:`sidejax.fl.Algorithm`: run it for **one** round with
    every client participating (``clients_per_round = num_clients``); ``eval_params`` gives the posterior
    samples.

    Args:
      loss_fn: ``loss_fn(params, Batch, key)``, the masked mean NLL (``sidejax.fl.classification_loss``, or
        a Gaussian NLL for regression).
      init_fn: ``init_fn(key) -> params``, the network initialisation (shared seeds: every client calls it
        with the same keys).
      input_shape: one example's input shape (the receiver knows the shapes).
      num_clients: ``M``.
      settings: :class:`BPCFLSettings`.
      inference: :func:`map_inference`, :func:`hmc_inference` or :func:`sgld_inference`.
      coder: the uplink coder (default :func:`sidejax.coding.pseudocoreset_coder` for the settings).

    Raises:
      ValueError: bad settings (naming the field), ``num_clients < 1``.
    """
    settings = check_settings(settings)
    num_clients = check_count(num_clients, "num_clients", 1)
    input_shape = tuple(int(d) for d in input_shape)
    if coder is None:
        coder = pseudocoreset_coder(settings.num_points, settings.num_classes)
    return Algorithm(
        init=functools.partial(bpcfl_init, settings, inference, input_shape, num_clients),
        broadcast=bpcfl_broadcast,
        receive=bpcfl_receive,
        client_update=functools.partial(bpcfl_client_update, loss_fn, init_fn, settings, coder),
        server_update=functools.partial(
            bpcfl_server_update, loss_fn, settings, inference, coder, input_shape
        ),
        evaluation=Evaluation(_eval_params, ensemble=True),
        clients_per_round=num_clients,
        metrics=_metrics,
    )
