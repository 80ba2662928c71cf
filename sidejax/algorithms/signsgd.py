"""SignSGD, stochastic SignSGD and SignSGD-KLMS (KLMS paper Alg. 11, eq. 6;
docs/papers/klms.md#s4-5).

From the local model change :math:`v = w^{(t,c)} - w^{(t-1)}`:

- **SignSGD** (``stochastic=False``) sends :math:`\\mathrm{sign}(v_i)` (0 maps to +1);
- **stochastic SignSGD** (eq. 6) sends :math:`\\hat v_i \\in \\{\\pm1\\}` with
  :math:`P(+1) = \\sigma(v_i / M)`, so :math:`E[\\hat v_i] = 2\\sigma(v_i/M) - 1` has the sign of
  :math:`v_i`. The paper leaves ``M`` open; the reference code uses :math:`M = \\max_{j}|v_j| / 20` over a
  block. Here the maximum is over the coordinate's *tensor* ([R]: adaptive blocks are computed from ``q``,
  so ``q`` cannot depend on them), with ``temperature = 20``;

  both send 1 bit per coordinate (``coder=fixed_width_coder((-1.0, 1.0))``): the packed signs, exactly
  ``d`` bits;
- **SignSGD-KLMS** (``coder=klms_coder(config)``) sends a KLMS sample of the stochastic-sign law ``q``
  against the fixed side information
  :math:`p = \\mathrm{Uniform}\\{-1, +1\\}` (:mod:`sidejax.coding.klms`), per-coordinate KL
  :math:`1 - H_b(\\sigma(v_i/M))` bits.

Server (sign corrected, docs/papers/klms.md#s8-4):
:math:`w^{(t)} = w^{(t-1)} + \\eta_S \\frac1C \\sum_c \\hat v^{(c)}`.
Downlink: :math:`w` as float32, plus the protocol bits.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from sidejax.algorithms.dense import DenseMethod, dense_algorithm
from sidejax.algorithms.qsgd import local_change, mean_step
from sidejax.coding.base import Coder
from sidejax.coding.sample import fixed_width_coder
from sidejax.distributions import Sign
from sidejax.fl.base import Algorithm
from sidejax.fl.local import LocalTraining
from sidejax.layout import FlatLayout, tensor_max_abs

__all__ = ["stochastic_sign_probs", "sign_law", "signsgd"]


def stochastic_sign_probs(v: jax.Array, layout: FlatLayout, temperature: float = 20.0) -> Sign:
    """Eq. (6): :math:`P(+1) = \\sigma(\\text{temperature} \\cdot v_i / \\max_{j \\in l(i)} |v_j|)`."""
    m = tensor_max_abs(v, layout)[jnp.asarray(layout.tensor_ids)]
    return Sign(jax.nn.sigmoid(temperature * v / jnp.where(m > 0, m, 1.0)))


def sign_law(v: jax.Array, layout: FlatLayout, *, stochastic: bool, temperature: float) -> Sign:
    """The law of the sent signs: eq. (6) if ``stochastic``, else the point mass on
    :math:`\\mathrm{sign}(v_i)` (0 maps to +1) as a :class:`Sign` with probabilities in {0, 1}."""
    if stochastic:
        return stochastic_sign_probs(v, layout, temperature)
    return Sign(jnp.where(v >= 0, 1.0, 0.0))


def signsgd(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    clients_per_round: int,
    server_lr: float = 1e-3,
    stochastic: bool = True,
    temperature: float = 20.0,
    coder: Coder | None = None,
) -> Algorithm:
    """Builds (stochastic) SignSGD (``coder=None``: 1 bit per sign) or SignSGD-KLMS
    (``coder=klms_coder(config)``; the side information is the fixed
    :math:`p = \\mathrm{Uniform}\\{-1, +1\\}`).

    Args:
      loss_fn: the model's ``loss_fn(params, batch, key)``.
      local: the clients' training (:class:`sidejax.fl.LocalTraining`; [C]: SGD 0.01).
      clients_per_round: participants per round.
      server_lr: :math:`\\eta_S` ([C]: 2e-4 SignSGD, 2e-3 SignSGD-KLMS).
      stochastic: stochastic (eq. 6) or deterministic signs.
      temperature: the 20 in :math:`M = \\max|v| / 20`.
      coder: the signs' coder (default ``fixed_width_coder((-1.0, 1.0))``).
    """
    if not server_lr > 0:
        raise ValueError(f"server_lr must be > 0, got {server_lr}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    coder = fixed_width_coder((-1.0, 1.0)) if coder is None else coder
    trainer = local.trainer(loss_fn)
    method = DenseMethod(
        direction=local_change(trainer),
        law=lambda v, layout: sign_law(v, layout, stochastic=stochastic, temperature=temperature),
        prior=lambda state, layout: Sign(jnp.full((layout.dim,), 0.5, jnp.float32)),
        reconstruct=lambda samples, layout: samples,
        server_step=mean_step(server_lr),
    )
    return dense_algorithm(method, coder, clients_per_round=clients_per_round)
