"""FedPM (Isik et al., ICLR 2023) and FedPM-KLMS (KLMS paper Alg. 1, 2 and 9;
docs/papers/klms.md#s4-1).

The network weights are frozen random signed constants :math:`w \\in \\{\\pm c_l\\}^d`
(:math:`c_l = e \\sqrt{1/\\mathrm{fan\\_in}_l}`, biases included, [C] "ME_init"); what is learned is a
probability mask :math:`\\theta \\in [0.01, 0.99]^d` and the model is :math:`m \\odot w` with
:math:`m \\sim \\mathrm{Bern}(\\theta)`.

Round ``t`` (Alg. 1):

1. the client starts its scores at :math:`s = \\mathrm{logit}(\\theta^{(t-1)})` and trains them with its
   optimizer ([C] Adam, lr 0.1). Each step samples :math:`m \\sim \\mathrm{Bern}(\\sigma(s))` and
   backpropagates through the sample with FedPM's estimator (``"fedpm"``: :math:`\\partial/\\partial p
   = p \\cdot g`, [C]) or the straight-through identity (``"ste"``);
2. it sends one mask sample :math:`m^{(c)} \\sim \\mathrm{Bern}(\\phi)`, :math:`\\phi = \\sigma(s)`:

   - **FedPM** (``coder=mask_coder()``): the mask itself, as Golomb-coded run lengths
     (:func:`sidejax.coding.lossless.mask_encode`), a real stream close to the arithmetic-code cost FedPM
     reports. Beside the stream's length the ideal two-part enumerative length
     (:func:`sidejax.bits.enumerative_mask_bits`, ``ideal_bits``) and FedPM's own formula
     :math:`d H_b(k/d) + \\log_2 d` (``paper_bits``, from the decoded masks) are logged, labelled as such.
   - **FedPM-KLMS** (Alg. 9, ``coder=klms_coder(config)``): the KLMS message of
     :math:`q = \\mathrm{Bern}(\\phi)` against the side
     information :math:`p = \\mathrm{Bern}(\\theta^{(t-1)})` (:mod:`sidejax.coding.klms`), about
     :math:`D_{KL}(q \\| p)` bits instead of about :math:`d` bits;
3. the server clips every received mask to {0.01, 0.99} ([C]) and runs BayesAgg (Alg. 2) with
   :math:`\\lambda_0 = 1`: :math:`\\alpha \\mathrel{+}= \\sum_c m^{(c)}`, :math:`\\beta \\mathrel{+}= C -
   \\sum_c m^{(c)}`, :math:`\\theta = (\\alpha - 1)/(\\alpha + \\beta - 2)` (the paper prints
   :math:`\\alpha^{(t-1)}` in the numerator, a typo corrected in docs/papers/klms.md#s8-3). With
   ``reset_priors=True`` ([C] default) the priors are reset every round, so :math:`\\theta` is the mean of the
   clipped masks.

Evaluation uses one mask :math:`m = 1[u < \\theta]` with uniforms ``u`` fixed at initialisation (so the
evaluated network is a deterministic function of the server state), or ``eval_mask="threshold"``
(:math:`\\theta > 1/2`, FedPM's ``pruned_ths``).

Downlink: :math:`\\theta` as float32 (32 bits per parameter; the frozen weights are a seed, 0 bits), then the
coder's protocol stream, in one message that every client decodes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.dense import coder_metrics, receive_vector, vector_downlink
from sidejax.bits import binary_entropy_bits
from sidejax.coding.base import (
    Coder,
    EmptyState,
    Message,
    included,
)
from sidejax.coding.sample import mask_coder
from sidejax.distributions import Bernoulli
from sidejax.fl.base import Algorithm, ClientInfo, Evaluation, RoundState, initial_round_state
from sidejax.fl.local import LocalTraining
from sidejax.keys import EVAL, LOSS, MASK, SCORES, ClientKeys, client_streams, leaf_key, stream_key
from sidejax.layout import flat_layout
from sidejax.types import Params
from sidejax.utils import keep_unless_none, masked_sum

__all__ = [
    "MASK_CLIP",
    "ESTIMATORS",
    "FedPMState",
    "FedPMClientExtra",
    "FedPMServerInfo",
    "signed_constant_init",
    "bernoulli_mask",
    "bayes_agg",
    "masked_network",
    "mask_model_init",
    "train_mask",
    "fedpm_init",
    "fedpm_broadcast",
    "fedpm_receive",
    "fedpm_client_update",
    "fedpm_server_update",
    "fedpm_eval_params",
    "fedpm_metrics",
    "fedpm",
]

MASK_CLIP = 0.01
ESTIMATORS = ("fedpm", "ste")


class FedPMState(NamedTuple):
    """Server state.

    Attributes:
      weights: the frozen signed-constant network (regenerated from the seed on every machine).
      theta: float32 ``[d]`` global probability mask, in [0.01, 0.99].
      alpha, beta: float32 ``[d]`` Beta-posterior parameters of BayesAgg.
      eval_uniforms: float32 ``[d]``: fixed uniforms of the evaluation mask.
      coder: the coder's protocol state (``EmptyState()`` for stateless coders).
    """

    weights: Params
    theta: jax.Array
    alpha: jax.Array
    beta: jax.Array
    eval_uniforms: jax.Array
    coder: Any


class FedPMClientExtra(NamedTuple):
    """Per-client diagnostics: ``kl_bits`` is :math:`\\sum_j D_{KL}(\\phi_j\\|\\theta_j)` in bits (the ideal
    KLMS rate, reported for every coder); ``ideal_bits`` the coder's ideal rate (NaN if none); ``coder`` its
    info."""

    kl_bits: jax.Array
    ideal_bits: jax.Array
    coder: Any


class FedPMServerInfo(NamedTuple):
    """``theta_mean``: mean of the new global mask; ``paper_bits``: FedPM's formula
    :math:`d H_b(k/d) + \\log_2 d` for each decoded mask ``[clients]`` (an accounting formula, not a stream);
    ``coder``: the coder's protocol diagnostics."""

    theta_mean: jax.Array
    paper_bits: jax.Array
    coder: Any


def signed_constant_init(key, params: Params) -> Params:
    """FedPM's frozen "ME_init" network [C]: every weight and bias is :math:`\\pm c`, sign Bernoulli(1/2),
    :math:`c = e \\sqrt{1/\\mathrm{fan\\_in}}`. Leaf ``l`` (pytree-leaf order) draws its signs from
    :func:`sidejax.keys.leaf_key` ``(key, l)``, a family under the tag ``SIGNS``, so no leaf shares a key with
    the initial scores (``SCORES``) or the evaluation uniforms (``EVAL``) that :func:`fedpm`'s ``init``
    derives from the same key.

    ``fan_in`` is the product of a kernel's shape without its last (output) axis: ``in_features`` for a
    Dense kernel ``[in, out]``, ``kh * kw * in_channels`` for a Conv kernel ``[kh, kw, in, out]``. A bias
    (or any other leaf) uses the fan-in of the ``kernel`` in the same module; a leaf without a sibling
    kernel (e.g. a normalisation scale) uses its own size.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    fan_by_module = {}
    for path, leaf in leaves:
        if getattr(path[-1], "key", None) == "kernel":
            fan_by_module[tuple(str(p) for p in path[:-1])] = int(math.prod(leaf.shape[:-1]))
    out = []
    for i, (path, leaf) in enumerate(leaves):
        fan_in = fan_by_module.get(tuple(str(p) for p in path[:-1]), int(max(1, leaf.size)))
        c = math.e * math.sqrt(1.0 / fan_in)
        sign = jax.random.rademacher(leaf_key(key, i), leaf.shape, jnp.float32)
        out.append(c * sign)
    return jax.tree_util.tree_unflatten(treedef, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def bernoulli_mask(probs: jax.Array, uniforms: jax.Array, estimator: str = "fedpm") -> jax.Array:
    """``1[uniforms < probs]`` with FedPM's gradient estimator w.r.t. ``probs``.

    ``"fedpm"`` ([C], the faithful default, docs/papers/klms.md#s8-35): the backward pass returns
    ``probs * g``; ``"ste"``: the straight-through identity ``g``.
    """
    return (uniforms < probs).astype(probs.dtype)


def _mask_fwd(probs, uniforms, estimator):
    return bernoulli_mask(probs, uniforms, estimator), probs


def _mask_bwd(estimator, probs, g):
    gp = probs * g if estimator == "fedpm" else g
    return gp, None


bernoulli_mask.defvjp(_mask_fwd, _mask_bwd)


def masked_network(weights: Params, mask: jax.Array) -> Params:
    """The network :math:`m \\odot w_{init}` for a flat 0/1 mask ``mask`` (float ``[d]``) over ``weights``."""
    _, unravel = ravel_pytree(weights)
    return jax.tree.map(lambda w, m: w * m, weights, unravel(mask))


def bayes_agg(alpha, beta, masks: jax.Array, *, reset: bool, lambda0: float = 1.0, include=None):
    """BayesAgg (Alg. 2, typo fixed): clipped masks ``masks[C, d]`` in {0.01, 0.99} update Beta counts;
    returns ``(alpha, beta, theta)`` with :math:`\\theta = (\\alpha - 1)/(\\alpha + \\beta - 2)`. Only the
    ``include``-d masks count (all by default; :func:`sidejax.coding.included`)."""
    if reset:
        alpha = jnp.full_like(alpha, lambda0)
        beta = jnp.full_like(beta, lambda0)
    if include is None:
        agg, num = jnp.sum(masks, axis=0), masks.shape[0]
    else:
        agg, num = masked_sum(masks, include), jnp.sum(include).astype(masks.dtype)
    alpha = alpha + agg
    beta = beta + num - agg
    theta = (alpha - 1.0) / (alpha + beta - 2.0)
    return alpha, beta, theta


def mask_model_init(key, params: Params) -> tuple[Params, jax.Array, jax.Array]:
    """The shared start of every mask method (FedPM, BICompFL): ``(weights, theta, eval_uniforms)``, the
    frozen signed-constant network, :math:`\\theta = \\sigma(s)` for mask scores :math:`s \\sim N(0, 1)`
    [C] clipped like every later :math:`\\theta`, and the evaluation-mask uniforms (keys: ``SIGNS``,
    ``SCORES``, ``EVAL`` under ``key``)."""
    weights = signed_constant_init(key, params)
    dim = flat_layout(params).dim
    scores = jax.random.normal(stream_key(key, SCORES), (dim,))
    theta = jnp.clip(jax.nn.sigmoid(scores), MASK_CLIP, 1 - MASK_CLIP)
    return weights, theta, jax.random.uniform(stream_key(key, EVAL), (dim,))


def fedpm_init(coder: Coder, key, params: Params, num_clients: int) -> RoundState:
    """The initial state: :func:`mask_model_init`, BayesAgg's Beta counts and the coder's state."""
    weights, theta, u = mask_model_init(key, params)
    ones = jnp.ones_like(theta)
    state = FedPMState(weights, theta, ones, ones, u, coder.init(theta.shape[0]))
    return initial_round_state(state, EmptyState(), num_clients)


def fedpm_broadcast(coder: Coder, key, server: FedPMState, client_ids) -> tuple[FedPMState, Message]:
    """The downlink: :math:`\\theta` as float32, then the coder's protocol stream (the weights are a seed);
    the server state is unchanged."""
    del key, client_ids
    return server, vector_downlink(server.theta, coder, server.coder)


def fedpm_receive(coder: Coder, dkey, keys, server: FedPMState, cstate, message: Message) -> FedPMState:
    """The clients' decoding of :func:`fedpm_broadcast`."""
    del dkey, keys, cstate
    theta, _, cstate = receive_vector(message, server.theta.shape[0], coder, server.coder)
    return server._replace(theta=theta, coder=cstate)


def train_mask(
    loss_fn: Callable, local: LocalTraining, estimator: str, weights: Params, theta, train_key, data
) -> tuple[jax.Array, Any]:
    """FedPM's local training of a probability mask (KLMS Alg. 1 step 1; BICompFL Alg. 1).

    The scores start at :math:`s^{(0)} = \\mathrm{logit}(\\theta)` and are trained with ``local`` (its
    optimizer and schedule; [C] Adam, lr 0.1, fresh state every round). Each step samples one mask
    :math:`m \\sim \\mathrm{Bern}(\\sigma(s))` per minibatch (uniforms from the step key's ``MASK`` stream)
    and
    backpropagates through it with ``estimator`` (:func:`bernoulli_mask`).

    Returns:
      ``(phi, local_info)``: the trained keep-probabilities :math:`\\phi = \\sigma(s^{(L)})` (flat ``[d]``)
      and
      the trainer's :class:`sidejax.fl.LocalInfo`.
    """
    _, unravel = ravel_pytree(weights)
    scores0 = unravel(jnp.log(theta) - jnp.log1p(-theta))

    def score_loss(scores, batch, key):
        u = unravel(jax.random.uniform(stream_key(key, MASK), theta.shape))
        net = jax.tree.map(
            lambda w, s, v: w * bernoulli_mask(jax.nn.sigmoid(s), v, estimator), weights, scores, u
        )
        return loss_fn(net, batch, stream_key(key, LOSS))

    scores, linfo = local.trainer(score_loss)(train_key, scores0, data)
    return jax.nn.sigmoid(ravel_pytree(scores)[0]), linfo


def fedpm_client_update(
    loss_fn: Callable,
    local: LocalTraining,
    coder: Coder,
    estimator: str,
    keys: ClientKeys,
    server,
    state,
    data,
):
    """One client (Alg. 1, steps 1-2): train the mask scores from :math:`\\mathrm{logit}(\\theta)`, then send
    one sample of :math:`q = \\mathrm{Bern}(\\phi)` against :math:`p = \\mathrm{Bern}(\\theta)` with
    ``coder``."""
    theta = server.theta
    train_key, sample_key = client_streams(keys.private)
    phi, linfo = train_mask(loss_fn, local, estimator, server.weights, theta, train_key, data)
    q, p = Bernoulli(phi), Bernoulli(theta)
    message, cinfo = coder.encode(ClientKeys(keys.shared, sample_key), q, p, server.coder)
    finite = linfo.finite & jnp.all(jnp.isfinite(phi))
    extra = FedPMClientExtra(
        kl_bits=jnp.sum(q.kl_bits(p)), ideal_bits=jnp.asarray(cinfo.ideal_bits, jnp.float32), coder=cinfo
    )
    return state, message, ClientInfo(loss=linfo.loss, finite=finite, extra=extra, valid=cinfo.valid)


def fedpm_server_update(
    coder: Coder, reset_priors: bool, rkey, server: FedPMState, client_ids, shared_keys, messages, weights
):
    """The server (Alg. 1, step 3): decode every mask with the participant's shared key, clip to
    {0.01, 0.99}, BayesAgg over the included participants (:func:`sidejax.coding.included`); the coder's
    protocol step. With none included the state is kept."""
    del rkey, client_ids, weights  # unweighted 1/C aggregation [P]
    prior = Bernoulli(server.theta)
    masks, decoded = jax.vmap(coder.decode, (0, None, None, 0))(shared_keys, prior, server.coder, messages)
    include = included(messages, decoded.valid)
    cstate, cinfo = coder.update(server.coder, decoded._replace(valid=include))
    clipped = jnp.where(masks > 0.5, 1.0 - MASK_CLIP, MASK_CLIP)
    alpha, beta, theta = bayes_agg(server.alpha, server.beta, clipped, reset=reset_priors, include=include)
    new = keep_unless_none(
        include, server._replace(theta=theta, alpha=alpha, beta=beta, coder=cstate), server
    )
    theta = new.theta
    d = masks.shape[1]
    paper = d * binary_entropy_bits(jnp.sum(masks > 0.5, axis=1) / d) + math.log2(d)
    info = FedPMServerInfo(theta_mean=jnp.mean(theta), paper_bits=paper.astype(jnp.float32), coder=cinfo)
    return new, info, decoded.errors


def fedpm_eval_params(eval_mask: str, state: RoundState) -> Params:
    """The evaluated network: one mask with the fixed uniforms (``"sample"``) or :math:`\\theta > 1/2`."""
    server = state.server
    if eval_mask == "threshold":
        m = (server.theta > 0.5).astype(jnp.float32)
    else:
        m = (server.eval_uniforms < server.theta).astype(jnp.float32)
    return masked_network(server.weights, m)


def fedpm_metrics(info) -> dict:
    """The coder's ideal rate and the KL(q||p) in bits, mean per participant."""
    return {**coder_metrics(info), "kl_bits": jnp.mean(info.clients.extra.kl_bits, axis=-1)}


def fedpm(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    clients_per_round: int,
    coder: Coder | None = None,
    estimator: str = "fedpm",
    reset_priors: bool = True,
    eval_mask: str = "sample",
) -> Algorithm:
    """Builds FedPM (``coder=None``: :func:`sidejax.coding.mask_coder`) or FedPM-KLMS
    (``coder=klms_coder(config)``) from the module's kernels.

    Args:
      loss_fn: the model's ``loss_fn(params, batch, key)``; it is applied to :math:`m \\odot w`.
      local: the training of the mask scores (:class:`sidejax.fl.LocalTraining`; [C]: ``optax.adam(0.1)``).
      clients_per_round: participants per round.
      coder: the mask's coder, ``q = Bern(phi)`` against ``p = Bern(theta)`` ([C] FedPM-KLMS:
        ``klms_coder(KLMSConfig(log2_num_candidates=2, max_block_size=256))``).
      estimator: ``"fedpm"`` or ``"ste"`` (see :func:`bernoulli_mask`).
      reset_priors: reset BayesAgg's Beta priors every round ([C]).
      eval_mask: ``"sample"`` (one fixed-uniform sample of the mask) or ``"threshold"``
        (:math:`\\theta > 1/2`).

    Returns:
      An :class:`sidejax.fl.Algorithm` whose ``eval_params`` is the masked network.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if eval_mask not in ("sample", "threshold"):
        raise ValueError(f"eval_mask must be 'sample' or 'threshold', got {eval_mask!r}")
    coder = mask_coder() if coder is None else coder
    if not isinstance(coder, Coder):
        raise TypeError(f"coder must be a sidejax.coding.Coder, got {type(coder).__name__}")
    return Algorithm(
        init=functools.partial(fedpm_init, coder),
        broadcast=functools.partial(fedpm_broadcast, coder),
        receive=functools.partial(fedpm_receive, coder),
        client_update=functools.partial(fedpm_client_update, loss_fn, local, coder, estimator),
        server_update=functools.partial(fedpm_server_update, coder, reset_priors),
        evaluation=Evaluation(functools.partial(fedpm_eval_params, eval_mask)),
        clients_per_round=clients_per_round,
        metrics=fedpm_metrics,
    )
