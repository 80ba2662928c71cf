"""The toy distributed-mean experiment of the KLMS paper, App. F.1 (docs/papers/klms.md#s4-8).

Client ``n`` of ``N`` holds :math:`q^{(n)} = N(\\mu^{(n)}, 1)`; all share :math:`p = N(0, 1)`. Each client
sends one importance-sampling index (a single block of one coordinate, ``K`` candidates drawn from ``p``
with its own shared key) and the server estimates :math:`\\hat\\mu = \\frac1N \\sum_n x^{(n)}` from the
regenerated candidates. The paper sets :math:`K = e^{KL + r}` with overhead ``r`` nats; K must be a power
of two here (fixed-length indices), so :func:`log2_candidates_for_overhead` rounds up
(docs/papers/klms.md#s8-21).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.blocks import fixed_blocks
from sidejax.coding.importance import importance_decode, importance_encode
from sidejax.distributions import DiagGaussian
from sidejax.keys import client_keys, round_key

__all__ = [
    "log2_candidates_for_overhead",
    "distributed_mean",
    "theorem41_epsilon",
    "gaussian_log_ratio_tail",
]


def log2_candidates_for_overhead(kl_nats: float, overhead_nats: float) -> int:
    """Smallest ``b`` with :math:`2^b \\ge e^{KL + r}` (KL and r in nats)."""
    return max(0, math.ceil((kl_nats + overhead_nats) / math.log(2.0) - 1e-12))


def theorem41_epsilon(tail_probs, overhead_nats: float) -> float:
    """The :math:`\\epsilon` of the paper's Thm 4.1 (= Thm C.2; docs/papers/klms.md#s3-1).

    .. math::
        \\epsilon = \\Big(e^{-N r / 4} + 2 \\sqrt{\\textstyle\\prod_n
        P\\big(\\log\\rho_n(X^{(n)}) > L^{(n)} + r/2\\big)}\\Big)^{1/2},

    with :math:`K^{(n)} = e^{L^{(n)} + r}` candidates for client ``n`` (:math:`L^{(n)}` its KL in nats).
    The theorem states that the self-normalised estimate :math:`J_K(f)` realised by KLMS is within
    :math:`2\\|f\\|_q \\epsilon / (1 - \\epsilon)` of :math:`E_q f` except with probability
    :math:`2\\epsilon`.

    Caveat (docs/papers/klms.md#s8-20): the proof rests on an unproven assumption (the paper's eq. 15), and
    the factor :math:`e^{-Nr/4}` shrinks exponentially in ``N``, faster than averaging independent clients
    can. Use the bound as a heuristic. Measured on the Gaussian toy (:math:`\\mu = 0.8`, ``r = 6``,
    ``K = 1024``, 4000 runs, ``f(x) = x``): with ``N = 1`` no run exceeded the threshold (the bound allows
    98%); with ``N = 10``, :math:`\\epsilon = 5.5 \\times 10^{-4}` promises a deviation below 9.5e-4 except
    with probability 1.1e-3, yet 96% of runs deviated more (the spread of :math:`\\bar J_K` is 0.018).

    Args:
      tail_probs: the ``N`` probabilities :math:`P(\\log\\rho_n > L^{(n)} + r/2)` under :math:`q^{(n)}`
        (e.g. from :func:`gaussian_log_ratio_tail`), each in [0, 1].
      overhead_nats: ``r >= 0``.

    Returns:
      :math:`\\epsilon` as a Python float (computed in float64, the product in log space).
    """
    tails = np.atleast_1d(np.asarray(tail_probs, np.float64))
    if tails.ndim != 1 or tails.size == 0:
        raise ValueError(f"tail_probs must be a non-empty 1-D array, got shape {tails.shape}")
    if not np.all((tails >= 0) & (tails <= 1)):
        raise ValueError(f"tail_probs must lie in [0, 1], got {tails}")
    if not overhead_nats >= 0:
        raise ValueError(f"overhead_nats must be >= 0, got {overhead_nats}")
    n = tails.size
    with np.errstate(divide="ignore"):
        sqrt_prod = float(np.exp(0.5 * np.sum(np.log(tails))))
    return math.sqrt(math.exp(-n * overhead_nats / 4) + 2 * sqrt_prod)


def gaussian_log_ratio_tail(mu: float, overhead_nats: float) -> float:
    """:math:`P(\\log\\rho(X) > KL + r/2)` for :math:`q = N(\\mu, 1)`, :math:`p = N(0, 1)`, X ~ q.

    :math:`\\log\\rho(X) = \\mu X - \\mu^2/2 \\sim N(\\mu^2/2, \\mu^2)` and :math:`KL = \\mu^2/2`
    nats, so the probability is :math:`1 - \\Phi(r / (2|\\mu|))` (docs/papers/klms.md#s7-12).
    """
    if mu == 0:
        return 0.0
    return 0.5 * math.erfc(overhead_nats / (2 * abs(mu)) / math.sqrt(2.0))


def distributed_mean(key, mu: jax.Array, log2_num_candidates: int, num_runs: int) -> jax.Array:
    """``num_runs`` independent estimates :math:`\\hat\\mu` (float32 ``[num_runs]``).

    Run ``r`` uses round key ``round_key(key, r)`` and client ``n`` its keys :func:`sidejax.keys.client_keys`
    (distinct shared keys per client, as Thm C.1 requires). Vectorised over runs and clients.

    Args:
      key: base key.
      mu: float ``[N]`` client means.
      log2_num_candidates: ``log2 K`` (static).
      num_runs: number of independent repetitions (static).
    """
    blocks = fixed_blocks(1, 1)
    prior = DiagGaussian(jnp.zeros(1), jnp.ones(1))

    def one_client(rkey, n, m):
        keys = client_keys(rkey, n)
        q = DiagGaussian(jnp.reshape(m, (1,)), jnp.ones(1))
        idx, _ = importance_encode(
            keys.shared, keys.private, q, prior, blocks, log2_num_candidates=log2_num_candidates
        )
        return importance_decode(keys.shared, prior, blocks, idx)[0]

    def one_run(r):
        rkey = round_key(key, r)
        ids = jnp.arange(mu.shape[0])
        return jnp.mean(jax.vmap(one_client, (None, 0, 0))(rkey, ids, mu))

    return jax.vmap(one_run)(jnp.arange(num_runs))
