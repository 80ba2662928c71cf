"""Code lengths (sidejax.bits): the ideal enumerative length of a mask against the exact binomial."""

from __future__ import annotations

import math

import jax.numpy as jnp

from sidejax.bits import enumerative_mask_bits


def test_enumerative_mask_bits_matches_exact_binomial():
    for d, k in [(50, 0), (50, 7), (200, 100), (1000, 13)]:
        mask = jnp.zeros(d).at[:k].set(1.0)
        exact = math.ceil(math.log2(d + 1)) + (
            math.ceil(math.log2(math.comb(d, k))) if k not in (0, d) else 0
        )
        assert abs(float(enumerative_mask_bits(mask)) - exact) <= 1, (d, k)
