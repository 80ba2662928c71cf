"""The toy distributed-mean experiment of the KLMS paper, App. F.1 (spec ``klms.md`` §4.8).

Client ``n`` of ``N`` holds :math:`q^{(n)} = N(\\mu^{(n)}, 1)`; all share :math:`p = N(0, 1)`. Each client
sends one importance-sampling index (a single block of one coordinate, ``K`` candidates drawn from ``p``
with its own shared key) and the server estimates :math:`\\hat\\mu = \\frac1N \\sum_n x^{(n)}` from the
regenerated candidates. The paper sets :math:`K = e^{KL + r}` with overhead ``r`` nats; K must be a power
of two here (fixed-length indices), so :func:`log2_candidates_for_overhead` rounds up (spec §8 #21).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sidejax.blocks import fixed_blocks
from sidejax.coding.importance import importance_decode, importance_encode
from sidejax.distributions import DiagGaussian
from sidejax.keys import client_keys

__all__ = ["log2_candidates_for_overhead", "distributed_mean"]


def log2_candidates_for_overhead(kl_nats: float, overhead_nats: float) -> int:
    """Smallest ``b`` with :math:`2^b \\ge e^{KL + r}` (KL and r in nats)."""
    return max(0, math.ceil((kl_nats + overhead_nats) / math.log(2.0) - 1e-12))


def distributed_mean(key, mu: jax.Array, log2_num_candidates: int, num_runs: int) -> jax.Array:
    """``num_runs`` independent estimates :math:`\\hat\\mu` (float32 ``[num_runs]``).

    Run ``r`` uses round key ``fold_in(key, r)`` and client ``n`` its keys :func:`sidejax.keys.client_keys`
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
        rkey = jax.random.fold_in(key, r)
        ids = jnp.arange(mu.shape[0])
        return jnp.mean(jax.vmap(one_client, (None, 0, 0))(rkey, ids, mu))

    return jax.vmap(one_run)(jnp.arange(num_runs))
