r"""CEPAM (Algorithm 1): FedAvg whose uplink is a privacy mechanism, with per-client noise levels.

Round ``t`` (docs/papers/cepam.md#s2-6):

- **downlink**: the global model :math:`W_t` as float32 (every client decodes it);
- **client** ``k``: :math:`\tau` single-sample SGD steps from :math:`W_t` (eq. (3) with the *current* iterate,
  docs/papers/cepam.md#s6-18), each on an example drawn uniformly **with replacement** from the client's data
  (the sampling Theorem 7's privacy amplification assumes), with the client's optimizer (SGD with momentum 0.9
  in the paper); the update :math:`X^k = W^k - W_t` is sent with ``coder`` against the side information
  :class:`sidejax.coding.lattice.NoisePrior` ``(W_t, level_k)``;
- **server**: decodes every message with the client's shared key and level, and takes
  :math:`W_{t+\tau} = W_t + \frac{1}{|S_t|}\sum_k \hat X^k` (eq. (19), :math:`p_k = 1/K`).

The mechanism is the coder (a new mechanism is a new coder, not a flag here):

- CEPAM: ``clip_update(lrsuq_coder(lattice, GaussianNoise(σ) | LaplaceNoise(b)), gamma=γ)``;
- FL: :func:`sidejax.coding.float32_coder`; FL+SDQ: :func:`sidejax.coding.lattice.sdq_coder`;
- FL+Gaussian / FL+Laplace: ``clip_update(additive_noise_coder(noise), gamma=γ)``; FL+Gaussian+SDQ:
  ``clip_update(additive_noise_coder(noise, sdq_coder(...)), gamma=γ)``.

**Privacy adaptability** (docs/papers/cepam.md#s2-12): ``noise_levels[k]`` is client ``k``'s own ``σ_k`` (or
``b_k``), agreed with the server at initialisation: the client holds it in its state, the server in its own,
and both build ``NoisePrior(W_t, level_k)`` from it, so the noise of each client follows its own choice. With
``noise_levels=None`` every client uses the coder's level. The accountant for these settings is
:mod:`sidejax.privacy` (per round; ``sqrt(Σσ_k²)/K`` for unequal levels).

**Optimizer state**: with ``persistent_optimizer=True`` (the reference code [R], docs/papers/cepam.md#s3) each
client keeps its optimizer state (the momentum buffer) across rounds, its weights overwritten by the global
model each round; with ``False`` it starts afresh every round.

Deviation (documented, docs/papers/cepam.md#s3): the paper halves the learning rate when the validation
accuracy plateaus for 10 rounds; this builder uses the optimizer as given (pass an Optax schedule to change
the rate over the client's steps). The paper's theory (η_t = ζ/(t+α), plain SGD) does not cover either
(docs/papers/cepam.md#s6-16).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.dense import receive_vector, vector_downlink
from sidejax.coding.base import Coder, EmptyState, Message, included
from sidejax.coding.lattice import NoisePrior
from sidejax.distributions import PointMass
from sidejax.fl.base import Algorithm, Batch, ClientInfo, Evaluation, RoundInfo, initial_round_state
from sidejax.keys import ORDER, ClientKeys, client_streams, epoch_key, step_key, stream_key
from sidejax.types import Params
from sidejax.utils import check_count, keep_unless_none, masked_mean, stack_clients, tree_all_finite

__all__ = [
    "CepamServer",
    "CepamClient",
    "CepamClientExtra",
    "CepamServerInfo",
    "sampled_sgd",
    "cepam",
]


class CepamServer(NamedTuple):
    """Server state: the global model, every client's agreed noise level, the coder's protocol state."""

    params: Params
    levels: jax.Array
    coder: object = EmptyState()


class CepamClient(NamedTuple):
    """A client's state: its optimizer state (kept across rounds when persistent) and its noise level."""

    opt_state: object
    level: jax.Array


class CepamClientExtra(NamedTuple):
    """Client diagnostics: the norm of the update ``||X^k||`` and the encoder's ideal rate (bits)."""

    update_norm: jax.Array
    ideal_bits: jax.Array


class CepamServerInfo(NamedTuple):
    """Server diagnostics: the norm of the round's model change."""

    update_norm: jax.Array


def sampled_sgd(
    loss_fn: Callable, optimizer: optax.GradientTransformation, *, num_steps: int, batch_size: int
):
    """``train(key, params, opt_state, data) -> (params, opt_state, loss, finite)``: ``num_steps`` optimizer
    steps, each on ``batch_size`` examples drawn uniformly **with replacement** from the client's valid
    examples (CEPAM's local sampling, docs/papers/cepam.md#s3 [REC]; Theorem 7's privacy amplification assumes
    it).

    Step ``s`` uses ``step_key(epoch_key(key, 0), s)``: its ``ORDER`` stream draws the indices and the key
    itself goes to ``loss_fn``. A ``lax.scan`` over steps; a client without examples does not move."""
    num_steps = check_count(num_steps, "num_steps")
    batch_size = check_count(batch_size, "batch_size")
    grad_fn = jax.value_and_grad(loss_fn)

    def train(key, params, opt_state, data):
        ekey = epoch_key(key, 0)
        has_data = data.num_examples > 0

        def step(carry, s):
            params, opt_state, loss_sum, finite = carry
            skey = step_key(ekey, s)
            pos = jax.random.randint(
                stream_key(skey, ORDER), (batch_size,), 0, jnp.maximum(data.num_examples, 1)
            )
            gidx = data.indices[pos]
            batch = Batch(x=data.x[gidx], y=data.y[gidx], mask=jnp.full((batch_size,), has_data, jnp.float32))
            loss, grads = grad_fn(params, batch, skey)
            updates, new_opt = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(has_data, a, b), new, old)
            return (
                keep(new_params, params),
                keep(new_opt, opt_state),
                loss_sum + loss,
                finite & jnp.isfinite(loss),
            ), None

        carry = (params, opt_state, jnp.float32(0.0), jnp.asarray(True))
        (params, opt_state, loss_sum, finite), _ = jax.lax.scan(step, carry, jnp.arange(num_steps))
        return params, opt_state, loss_sum / num_steps, finite & tree_all_finite(params)

    return train


def _check_levels(noise_levels, num_clients: int) -> jax.Array:
    if noise_levels is None:  # unused: every client takes the coder's own level
        return jnp.zeros((num_clients,), jnp.float32)
    levels = np.asarray(noise_levels, np.float64)
    if levels.shape != (num_clients,):
        raise ValueError(
            f"noise_levels must have one level per client, shape ({num_clients},), got {levels.shape}"
        )
    if not np.all(np.isfinite(levels) & (levels > 0)):
        raise ValueError(
            f"noise_levels must be finite and > 0 (sigma or b of each client), got {levels.tolist()}"
        )
    return jnp.asarray(levels, jnp.float32)


def _prior(center, level, use_levels: bool):
    return NoisePrior(center, level) if use_levels else PointMass(center)


def _init(optimizer, coder, persistent, noise_levels, key, params, num_clients):
    del key
    flat = ravel_pytree(params)[0]
    levels = _check_levels(noise_levels, num_clients)
    opt = optimizer.init(params) if persistent else EmptyState()
    clients = CepamClient(stack_clients(opt, num_clients), levels)
    return initial_round_state(CepamServer(params, levels, coder.init(flat.shape[0])), clients, num_clients)


def _broadcast(coder: Coder, key, server: CepamServer, client_ids) -> tuple[CepamServer, Message]:
    del key, client_ids
    return server, vector_downlink(ravel_pytree(server.params)[0], coder, server.coder)


def _receive(coder: Coder, dkey, keys, server: CepamServer, client: CepamClient, message: Message):
    del dkey, keys, client
    flat, unravel = ravel_pytree(server.params)
    received, _, cstate = receive_vector(message, flat.shape[0], coder, server.coder)
    return server._replace(params=unravel(received), coder=cstate)


def _client_update(train, optimizer, coder, persistent, use_levels, keys: ClientKeys, server, client, data):
    streams = client_streams(keys.private)
    opt_state = client.opt_state if persistent else optimizer.init(server.params)
    params, opt_state, loss, finite = train(streams.train, server.params, opt_state, data)
    center = ravel_pytree(server.params)[0]
    local = ravel_pytree(params)[0]
    message, info = coder.encode(
        ClientKeys(keys.shared, streams.sample),
        PointMass(local),
        _prior(center, client.level, use_levels),
        server.coder,
    )
    new_client = client._replace(opt_state=opt_state if persistent else client.opt_state)
    extra = CepamClientExtra(jnp.linalg.norm(local - center), jnp.asarray(info.ideal_bits, jnp.float32))
    return new_client, message, ClientInfo(loss=loss, finite=finite, extra=extra, valid=info.valid)


def _server_update(coder, use_levels, rkey, server: CepamServer, client_ids, shared_keys, messages, weights):
    del rkey, weights  # eq. (19): p_k = 1/K over the (included) participants
    flat, unravel = ravel_pytree(server.params)
    priors = _prior(flat, server.levels[client_ids], use_levels)
    axes = NoisePrior(None, 0) if use_levels else None
    decoded, checks = jax.vmap(coder.decode, (0, axes, None, 0))(shared_keys, priors, server.coder, messages)
    include = included(messages, checks.valid)
    cstate, _ = coder.update(server.coder, checks._replace(valid=include))
    new = keep_unless_none(
        include, server._replace(params=unravel(masked_mean(decoded, include)), coder=cstate), server
    )
    info = CepamServerInfo(jnp.linalg.norm(ravel_pytree(new.params)[0] - flat))
    return new, info, checks.errors


def _metrics(info: RoundInfo) -> dict:
    extra = info.clients.extra
    return {
        "client_update_norm": jnp.mean(extra.update_norm, axis=-1),
        "uplink_ideal_bits": jnp.mean(extra.ideal_bits, axis=-1),
    }


def cepam(
    loss_fn: Callable,
    *,
    clients_per_round: int,
    coder: Coder,
    optimizer: optax.GradientTransformation | None = None,
    local_steps: int = 15,
    batch_size: int = 1,
    noise_levels=None,
    persistent_optimizer: bool = True,
) -> Algorithm:
    """Builds CEPAM's FedAvg (Algorithm 1) around a mechanism ``coder`` (see the module docstring).

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> scalar`` (masked mean, :mod:`sidejax.fl.local`).
      clients_per_round: participants per round (the paper: all 30).
      coder: the uplink mechanism; it encodes the point mass at the local model against ``p`` = the global
        model (a :class:`~sidejax.coding.lattice.NoisePrior` with the client's level when ``noise_levels``
        is given) and decodes to the noisy local model.
      optimizer: the clients' optimizer (default ``optax.sgd(0.01, momentum=0.9)``, the paper's).
      local_steps: ``τ``, single-sample steps per round (the paper: 15).
      batch_size: examples per step (the paper: 1).
      noise_levels: optional ``[num_clients]`` levels ``σ_k`` / ``b_k`` > 0, one per client (privacy
        adaptability); checked at ``init``.
      persistent_optimizer: keep each client's optimizer state across rounds ([R]'s behaviour).

    Returns:
      An :class:`sidejax.fl.Algorithm`.
    """
    optimizer = optax.sgd(0.01, momentum=0.9) if optimizer is None else optimizer
    if not isinstance(coder, Coder):
        raise ValueError(f"coder must be a sidejax.coding.Coder, got {type(coder).__name__}")
    use_levels = noise_levels is not None
    train = sampled_sgd(loss_fn, optimizer, num_steps=local_steps, batch_size=batch_size)
    return Algorithm(
        init=functools.partial(_init, optimizer, coder, bool(persistent_optimizer), noise_levels),
        broadcast=functools.partial(_broadcast, coder),
        receive=functools.partial(_receive, coder),
        client_update=functools.partial(
            _client_update, train, optimizer, coder, bool(persistent_optimizer), use_levels
        ),
        server_update=functools.partial(_server_update, coder, use_levels),
        evaluation=Evaluation(lambda state: state.server.params),
        clients_per_round=clients_per_round,
        metrics=_metrics,
    )
