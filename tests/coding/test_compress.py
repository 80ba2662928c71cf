"""The scaled-sign coder (sidejax.coding.compress): the stream's layout bit for bit against numpy, sign(0) =
+1, and the decoder's checks. The contract itself is checked with every coder in test_coders.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.coding import ERR_INPUT, ERR_LENGTH, ERR_PARSE, scaled_sign_bits, scaled_sign_coder
from sidejax.distributions import PointMass
from sidejax.keys import client_keys, round_key

DIM = 77  # not a multiple of 32
CODER = scaled_sign_coder()
ENCODE = jax.jit(CODER.encode)
DECODE = jax.jit(CODER.decode)


def _vector():
    v = np.random.default_rng(0).standard_normal(DIM).astype(np.float32)
    v[[3, 40]] = 0.0  # sign(0) = +1
    v[41] = -0.0  # a negative zero is not < 0: +1 as well
    return v


def test_stream_layout_is_the_scale_word_then_one_bit_per_sign():
    v = _vector()
    keys = client_keys(round_key(jax.random.key(0), 0), 1)
    message, info = CODER.encode(keys, PointMass(jnp.asarray(v)), PointMass(jnp.zeros(DIM)), CODER.init(DIM))
    assert bool(info.valid) and np.isnan(float(info.ideal_bits))
    assert float(message.num_bits) == scaled_sign_bits(DIM) == 32 + DIM
    words = np.asarray(message.payload)
    assert words.shape == (1 + -(-DIM // 32),)
    # word 0: the float32 bit pattern of ||v||_1 / d (summed in float32 by XLA: compared to float64 within
    # the float32 rounding of a 77-term sum)
    scale = words[:1].view(np.float32)[0]
    np.testing.assert_allclose(scale, np.abs(v.astype(np.float64)).sum() / DIM, rtol=DIM * 2**-24)
    # then bit i (LSB first) is 1 exactly where v_i < 0
    bits = np.unpackbits(words[1:].view(np.uint8), bitorder="little")
    np.testing.assert_array_equal(bits[:DIM], (v < 0).astype(np.uint8))
    assert not bits[DIM:].any()
    # decoding gives scale * sign(v), with sign(0) = sign(-0) = +1, exactly
    out, check = DECODE(keys.shared, PointMass(jnp.zeros(DIM)), CODER.init(DIM), message)
    assert int(check.errors) == 0
    np.testing.assert_array_equal(np.asarray(out), np.where(v < 0, -scale, scale))
    assert np.asarray(out)[[3, 40, 41]].tolist() == [scale] * 3


def test_keys_are_not_used():
    v = jnp.asarray(_vector())
    p = PointMass(jnp.zeros(DIM))
    a, _ = ENCODE(client_keys(round_key(jax.random.key(0), 0), 1), PointMass(v), p, CODER.init(DIM))
    b, _ = ENCODE(client_keys(round_key(jax.random.key(5), 3), 2), PointMass(v), p, CODER.init(DIM))
    np.testing.assert_array_equal(np.asarray(a.payload), np.asarray(b.payload))
    assert float(a.num_bits) == float(b.num_bits)


def test_decoder_flags_malformed_streams():
    v = jnp.asarray(_vector())
    keys = client_keys(round_key(jax.random.key(0), 0), 1)
    p = PointMass(jnp.zeros(DIM))
    message, _ = ENCODE(keys, PointMass(v), p, CODER.init(DIM))
    words = np.asarray(message.payload).copy()
    for bad_scale, err in ((-1.0, ERR_INPUT), (np.nan, ERR_INPUT), (np.inf, ERR_INPUT)):
        w = words.copy()
        w[0] = np.float32(bad_scale).view(np.uint32)
        _, check = DECODE(keys.shared, p, CODER.init(DIM), message._replace(payload=jnp.asarray(w)))
        assert int(check.errors) == err and not bool(check.valid)
    # a message of another dimension (the receiver expects DIM): the lengths do not add up
    _, check = DECODE(keys.shared, PointMass(jnp.zeros(DIM + 1)), CODER.init(DIM), message)
    assert int(check.errors) & ERR_PARSE
    # a truncated payload
    short = message._replace(payload=message.payload[:-1])
    _, check = CODER.decode(keys.shared, p, CODER.init(DIM), short)
    assert int(check.errors) & ERR_LENGTH


def test_non_finite_input_is_reported_invalid():
    v = jnp.asarray(_vector()).at[5].set(jnp.nan)
    keys = client_keys(round_key(jax.random.key(0), 0), 1)
    # inside jit (a concrete NaN is refused by PointMass itself)
    _, info = jax.jit(lambda v: CODER.encode(keys, PointMass(v), PointMass(jnp.zeros(DIM)), CODER.init(DIM)))(
        v
    )
    assert not bool(info.valid)
