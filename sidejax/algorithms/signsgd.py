"""SignSGD, stochastic SignSGD and SignSGD-KLMS (KLMS paper Alg. 11, eq. 6; spec ``klms.md`` §4.5).

From the local model change :math:`v = w^{(t,c)} - w^{(t-1)}`:

- **SignSGD** (``stochastic=False``) sends :math:`\\mathrm{sign}(v_i)` (0 maps to +1);
- **stochastic SignSGD** (eq. 6) sends :math:`\\hat v_i \\in \\{\\pm1\\}` with
  :math:`P(+1) = \\sigma(v_i / M)`, so :math:`E[\\hat v_i] = 2\\sigma(v_i/M) - 1` has the sign of
  :math:`v_i`. The paper leaves ``M`` open; the reference code uses :math:`M = \\max_{j}|v_j| / 20` over a
  block. Here the maximum is over the coordinate's *tensor* ([R]: adaptive blocks are computed from ``q``,
  so ``q`` cannot depend on them), with ``temperature = 20``;

  both send 1 bit per coordinate: the packed signs, exactly ``d`` bits;
- **SignSGD-KLMS** sends a KLMS sample of the stochastic-sign law ``q`` against the fixed side information
  :math:`p = \\mathrm{Uniform}\\{-1, +1\\}` (:mod:`sidejax.klms`), per-coordinate KL
  :math:`1 - H_b(\\sigma(v_i/M))` bits.

Server (sign corrected, spec §8 #4): :math:`w^{(t)} = w^{(t-1)} + \\eta_S \\frac1C \\sum_c \\hat v^{(c)}`.
Downlink: :math:`w` as float32, plus the protocol bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.common import (
    FlatLayout,
    broadcast_params,
    client_streams,
    flat_layout,
    tensor_max_abs,
)
from sidejax.algorithms.qsgd import CompressedExtra, CompressedServerInfo
from sidejax.coding.base import Message
from sidejax.coding.bitstream import pack_fixed, unpack_fixed
from sidejax.distributions import Sign
from sidejax.fl.base import Algorithm, ClientInfo, EmptyState, RoundState, initial_round_state
from sidejax.fl.local import build_local_trainer
from sidejax.fl.rounds import build_round_step
from sidejax.keys import ClientKeys
from sidejax.klms import (
    KLMSConfig,
    KLMSState,
    klms_decode_clients,
    klms_encode,
    klms_init,
    klms_server_update,
)
from sidejax.types import Params

__all__ = ["SignSGDState", "stochastic_sign_probs", "signsgd"]


class SignSGDState(NamedTuple):
    """Server state: global ``params`` and the KLMS protocol state (``EmptyState()`` without KLMS)."""

    params: Params
    klms: KLMSState | EmptyState


def stochastic_sign_probs(v: jax.Array, layout: FlatLayout, temperature: float = 20.0) -> Sign:
    """Eq. (6): :math:`P(+1) = \\sigma(\\text{temperature} \\cdot v_i / \\max_{j \\in l(i)} |v_j|)`."""
    m = tensor_max_abs(v, layout)[jnp.asarray(layout.tensor_ids)]
    return Sign(jax.nn.sigmoid(temperature * v / jnp.where(m > 0, m, 1.0)))


def signsgd(
    loss_fn: Callable,
    client_optimizer: optax.GradientTransformation,
    *,
    clients_per_round: int,
    batch_size: int,
    local_epochs: int = 1,
    server_lr: float = 1e-3,
    stochastic: bool = True,
    temperature: float = 20.0,
    klms: KLMSConfig | None = None,
    client_strategy: str | None = None,
    map_batch_size: int | None = None,
) -> Algorithm:
    """Builds (stochastic) SignSGD, or SignSGD-KLMS when ``klms`` is given.

    Args:
      loss_fn: the model's ``loss_fn(params, batch, key)``.
      client_optimizer: local optimizer ([C]: SGD 0.01).
      clients_per_round, batch_size, local_epochs: federation and local training.
      server_lr: :math:`\\eta_S` ([C]: 2e-4 SignSGD, 2e-3 SignSGD-KLMS).
      stochastic: stochastic (eq. 6) or deterministic signs (vanilla only; KLMS is always stochastic).
      temperature: the 20 in :math:`M = \\max|v| / 20`.
      klms: KLMS settings (SignSGD-KLMS); ``None`` for SignSGD.
      client_strategy, map_batch_size: see :func:`sidejax.fl.build_round_step`.
    """
    if not server_lr > 0:
        raise ValueError(f"server_lr must be > 0, got {server_lr}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    trainer = build_local_trainer(loss_fn, client_optimizer, batch_size=batch_size, num_epochs=local_epochs)

    def init(key, params: Params, num_clients: int) -> RoundState:
        del key
        kstate = klms_init(flat_layout(params).dim, klms) if klms is not None else EmptyState()
        return initial_round_state(SignSGDState(params, kstate), EmptyState(), num_clients)

    def broadcast_fn(key, server: SignSGDState, client_ids):
        del key
        return broadcast_params(server, client_ids, klms)

    def client_update(keys: ClientKeys, server: SignSGDState, state, data):
        layout = flat_layout(server.params)
        train_key, sample_key = client_streams(keys.private)
        local, linfo = trainer(train_key, server.params, data)
        v = ravel_pytree(local)[0] - ravel_pytree(server.params)[0]
        q = stochastic_sign_probs(v, layout, temperature)
        if klms is None:
            signs = q.sample(sample_key) if stochastic else jnp.where(v >= 0, 1.0, -1.0)
            bits = (signs > 0).astype(jnp.uint32)
            words = pack_fixed(bits, 1)
            message = Message(payload=words, num_bits=jnp.float32(layout.dim))
            extra = CompressedExtra(jnp.float32(jnp.nan), EmptyState())
        else:
            p = Sign(jnp.full((layout.dim,), 0.5, jnp.float32))
            message, kinfo = klms_encode(ClientKeys(keys.shared, sample_key), q, p, server.klms, klms)
            extra = CompressedExtra(kinfo.kl_bits, kinfo)
        finite = linfo.finite & jnp.all(jnp.isfinite(v))
        return state, message, ClientInfo(loss=linfo.loss, finite=finite, extra=extra)

    def server_update(rkey, server: SignSGDState, client_ids, messages, weights):
        del weights
        flat, unravel = ravel_pytree(server.params)
        dim = flat.shape[0]
        if klms is None:
            vhat = jax.vmap(lambda w: 2.0 * unpack_fixed(w, dim, 1).astype(jnp.float32) - 1.0)(
                messages.payload
            )
            kstate, kinfo = server.klms, EmptyState()
        else:
            p = Sign(jnp.full((dim,), 0.5, jnp.float32))
            vhat, decoded = klms_decode_clients(rkey, client_ids, p, server.klms, messages, klms)
            kstate, kinfo = klms_server_update(server.klms, decoded, klms)
        step = server_lr * jnp.mean(vhat, axis=0)
        new = SignSGDState(unravel(flat + step), kstate)
        return new, CompressedServerInfo(update_norm=jnp.linalg.norm(step), klms=kinfo)

    round_step = build_round_step(
        broadcast_fn,
        client_update,
        server_update,
        clients_per_round=clients_per_round,
        client_strategy=client_strategy,
        map_batch_size=map_batch_size,
    )
    return Algorithm(init=init, round_step=round_step, eval_params=lambda server: server.params)
