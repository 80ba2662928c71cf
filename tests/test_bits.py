"""Code lengths (sidejax.bits): the ideal enumerative length of a mask against the exact binomial."""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest

from sidejax.bits import enumerative_mask_bits


def test_enumerative_mask_bits_matches_exact_binomial():
    for d, k in [(50, 0), (50, 7), (200, 100), (1000, 13)]:
        mask = jnp.zeros(d).at[:k].set(1.0)
        exact = math.ceil(math.log2(d + 1)) + (
            math.ceil(math.log2(math.comb(d, k))) if k not in (0, d) else 0
        )
        assert abs(float(enumerative_mask_bits(mask)) - exact) <= 1, (d, k)


def test_message_lengths_are_exact_past_two_to_the_24_bits():
    """A float32 vector of 600,000 coordinates (19.2 M bits, past float32's exact integers at 2**24) followed
    by one protocol bit: the joined length counts that bit, and the receiver cuts it out exactly, inside and
    outside jit. With float32 lengths the bit was lost (19,200,001 rounds to 19,200,000), so a FedPM-KLMS
    client at CONV6 size read the server's update flag as 0 and encoded a round the server did not expect."""
    import jax
    import numpy as np

    from sidejax.bits import BITS_DTYPE, MAX_MESSAGE_BITS, as_bits, payload_bits
    from sidejax.coding import Message, concat_messages, encode_float32, split_message

    dim = 600_000
    flag = Message(jnp.ones(1, jnp.uint32), jnp.asarray(1, BITS_DTYPE))

    def round_trip(x):
        joined = concat_messages(encode_float32(x), flag)
        vector, bit = split_message(joined, (32 * dim,))
        return joined.num_bits, bit.num_bits, bit.payload[0], vector.payload

    x = jnp.linspace(-1.0, 1.0, dim, dtype=jnp.float32)
    for fn in (round_trip, jax.jit(round_trip)):
        total, bit_len, bit, words = fn(x)
        assert int(total) == 32 * dim + 1 and total.dtype == BITS_DTYPE
        assert int(bit_len) == 1 and int(bit) == 1
        np.testing.assert_array_equal(np.asarray(words)[:dim].view(np.float32), np.asarray(x))
    assert int(payload_bits(jnp.zeros(2**20, jnp.uint32))) == 2**25
    # a float length counts as the whole number it holds; any other float is no length (-1)
    assert [int(as_bits(v)) for v in (7, 7.0, jnp.float32(19_200_000), 10.5, -3.0)] == [
        7,
        7,
        19_200_000,
        -1,
        -1,
    ]
    with pytest.raises(ValueError, match="longer than a message can be"):
        payload_bits(jax.ShapeDtypeStruct((MAX_MESSAGE_BITS // 32 + 1,), jnp.uint32))
