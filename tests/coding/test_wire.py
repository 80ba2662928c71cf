"""Messages as bytes (sidejax.coding.wire): the documented header, a round trip through real coders, and
every refusal (another magic, another stream format, truncated, padded, set bits past the length)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.coding import (
    HEADER_BYTES,
    STREAM_FORMAT,
    KLMSConfig,
    Message,
    check_stream_format,
    klms_coder,
    message_from_bytes,
    message_to_bytes,
    withhold,
)
from sidejax.distributions import Bernoulli
from sidejax.keys import client_keys, round_key, run_keys


def test_the_header_is_magic_format_and_length_then_the_stream_bytes():
    m = Message(jnp.array([0x12345678, 0x9, 0, 0], jnp.uint32), jnp.int32(36))
    data = message_to_bytes(m)
    assert data[:3] == b"SJX" and data[3] == STREAM_FORMAT == 3
    assert int.from_bytes(data[4:8], "little") == 36
    assert data[HEADER_BYTES:] == bytes([0x78, 0x56, 0x34, 0x12, 0x09])  # ceil(36 / 8) = 5 bytes, LSB first
    back = message_from_bytes(data)
    assert int(back.num_bits) == 36
    np.testing.assert_array_equal(back.payload, [0x12345678, 0x9])
    empty = message_from_bytes(message_to_bytes(Message(jnp.zeros((0,), jnp.uint32), jnp.int32(0))))
    assert int(empty.num_bits) == 0 and empty.payload.shape == (0,)


def test_a_klms_stream_decodes_the_same_after_the_wire():
    dim = 3000
    coder = klms_coder(KLMSConfig(log2_num_candidates=4))
    keys = client_keys(round_key(run_keys(0)[1], 0), 3)
    q = Bernoulli(jax.random.uniform(jax.random.key(1), (dim,), minval=0.1, maxval=0.9))
    p = Bernoulli(jnp.full((dim,), 0.5))
    state = coder.init(dim)
    message, _ = coder.encode(keys, q, p, state)
    data = message_to_bytes(message)
    assert len(data) == HEADER_BYTES + -(-int(message.num_bits) // 8)
    direct, ok = coder.decode(keys.shared, p, state, message)
    wired, ok_wired = coder.decode(keys.shared, p, state, message_from_bytes(data))
    assert bool(ok.valid) and bool(ok_wired.valid)
    np.testing.assert_array_equal(direct, wired)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d[:5], "not a sidejax stream"),
        (lambda d: b"XJS" + d[3:], "not a sidejax stream"),
        (lambda d: d[:3] + bytes([1]) + d[4:], "stream format 1: Threefry-2x32 candidates"),
        (lambda d: d[:3] + bytes([9]) + d[4:], "stream format 9: a format this version does not know"),
        (lambda d: d[:-1], "truncated or padded: its header says 36 bits"),
        (lambda d: d + b"\0", "truncated or padded"),
        (lambda d: d[:-1] + bytes([d[-1] | 0x80]), "set bits past its 36 bits"),
    ],
)
def test_bad_bytes_are_refused_by_name(mutate, match):
    data = message_to_bytes(Message(jnp.array([0x12345678, 0x9], jnp.uint32), jnp.int32(36)))
    with pytest.raises(ValueError, match=match):
        message_from_bytes(mutate(data), what="client 3's upload")
    with pytest.raises(ValueError, match="client 3's upload"):
        message_from_bytes(mutate(data), what="client 3's upload")


def test_a_withheld_message_has_no_bytes_and_other_formats_are_refused():
    with pytest.raises(ValueError, match="num_bits"):
        message_to_bytes(withhold(Message(jnp.zeros((2,), jnp.uint32), jnp.int32(3)), jnp.bool_(False)))
    check_stream_format(STREAM_FORMAT, "x")
    with pytest.raises(ValueError, match="the checkpoint in /tmp/c was written with stream format 1"):
        check_stream_format(1, "the checkpoint in /tmp/c")
    with pytest.raises(ValueError, match="stream format 2: counter-hash candidates with Threefry lattice"):
        check_stream_format(2, "client 0's upload")
