"""Fixed-width bit packing and the CRC-32 (sidejax.coding.bitstream)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.coding.bitstream import pack_fixed, unpack_fixed


@pytest.mark.parametrize("width", [1, 3, 8, 13, 32])
def test_bit_packing_round_trip(width):
    v = np.random.default_rng(width).integers(0, 2**width, 77, dtype=np.uint64).astype(np.uint32)
    words = pack_fixed(jnp.asarray(v), width)
    assert words.shape == (-(-77 * width // 32),)
    assert np.array_equal(unpack_fixed(words, 77, width), v)


def test_crc32_matches_zlib():
    """The vectorised CRC-32 equals zlib.crc32 on the same little-endian bytes, for every prefix length."""
    import zlib

    from sidejax.coding.bitstream import crc32_words

    w = np.random.default_rng(5).integers(0, 2**32, 40, dtype=np.uint64).astype(np.uint32)
    f = jax.jit(crc32_words)
    got = [int(f(jnp.asarray(w), n)) for n in (0, 1, 2, 3, 7, 31, 40)]
    want = [zlib.crc32(w[:n].astype("<u4").tobytes()) for n in (0, 1, 2, 3, 7, 31, 40)]
    assert got == want
    assert int(crc32_words(jnp.asarray(w[:5]))) == zlib.crc32(w[:5].astype("<u4").tobytes())  # eager, all
