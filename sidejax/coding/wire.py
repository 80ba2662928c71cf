"""A message as bytes: the small header every serialised sidejax stream carries, and the format check.

Inside a program a :class:`sidejax.coding.Message` is ``uint32`` words and a length in bits. Where it leaves
the program (a file, a socket, a federated-learning framework's message) it is the bytes
:func:`message_to_bytes` writes::

    offset  size  field
    0       3     magic b"SJX"
    3       1     stream format (uint8): how the sender's coder generated what the receiver regenerates
    4       4     num_bits (uint32, little-endian): the message's length in bits
    8       n     the stream: n = ceil(num_bits / 8) bytes, the words' little-endian bytes cut to n
                  (bit i of the stream is bit i % 8 of byte i // 8; bits past num_bits are zero)

The header is 8 bytes of framing, not part of the coded message: bit counts everywhere in sidejax are
``num_bits``, and a transport that already frames its payloads with a length may count the header as its
own overhead. :func:`message_from_bytes` is the inverse, and refuses, naming the problem, a buffer that is
not a sidejax stream, is truncated or padded, holds set bits past ``num_bits``, or comes from another stream
format: a stream encoded with format 1 (Threefry candidates) would decode, silently, to another sample
under this version (:mod:`sidejax.coding.counter`), so it is refused rather than decoded.
:func:`check_stream_format` is the same refusal for other records that depend on the format (the
experiment driver's checkpoints).
"""

from __future__ import annotations

import struct

import jax.numpy as jnp
import numpy as np

from sidejax.bits import MAX_MESSAGE_BITS, as_bits
from sidejax.coding.base import Message, sent_message
from sidejax.coding.counter import STREAM_FORMAT, STREAM_FORMATS

__all__ = [
    "WIRE_MAGIC",
    "HEADER_BYTES",
    "message_to_bytes",
    "message_from_bytes",
    "check_stream_format",
]

WIRE_MAGIC = b"SJX"
_HEADER = struct.Struct("<3sBI")
HEADER_BYTES = _HEADER.size


def check_stream_format(found, what: str) -> None:
    """``ValueError`` naming ``what`` unless ``found`` is this version's :data:`STREAM_FORMAT`; the message
    says which generator the other format used and what to do."""
    if found == STREAM_FORMAT:
        return
    known = STREAM_FORMATS.get(found, "a format this version does not know (a newer sidejax?)")
    raise ValueError(
        f"{what} was written with stream format {found!r}: {known}. This sidejax reads and writes stream "
        f"format {STREAM_FORMAT} ({STREAM_FORMATS[STREAM_FORMAT]}), whose shared randomness differs, so "
        f"decoding it would give other samples without any error. Encode it again with this version, or read "
        f"it with the version that wrote it"
    )


def message_to_bytes(message: Message) -> bytes:
    """The bytes of ``message`` on the wire (header + stream; see the module docstring). Host side: needs a
    concrete message; raises ``ValueError`` for a withheld message (no stream to send) or a buffer that
    breaks the :class:`Message` contract (:func:`sidejax.coding.sent_message`)."""
    sent = sent_message(message)
    num_bits = int(sent.num_bits)
    words = np.asarray(sent.payload, np.uint32).reshape(-1)
    stream = words.astype("<u4").tobytes()[: -(-num_bits // 8)]
    return _HEADER.pack(WIRE_MAGIC, STREAM_FORMAT, num_bits) + stream


def message_from_bytes(data: bytes, *, what: str = "message") -> Message:
    """The :class:`Message` that :func:`message_to_bytes` wrote (payload: the ``ceil(num_bits / 32)``
    words sent). Raises ``ValueError`` naming ``what`` for anything else: another magic, another stream
    format (:func:`check_stream_format`), a length that disagrees with ``num_bits``, or set bits past it."""
    data = bytes(data)
    if len(data) < HEADER_BYTES or data[:3] != WIRE_MAGIC:
        raise ValueError(
            f"{what} is not a sidejax stream: it should start with the {HEADER_BYTES}-byte header "
            f"b'SJX', format, num_bits (got {len(data)} bytes starting {data[:8]!r})"
        )
    _, fmt, num_bits = _HEADER.unpack_from(data)
    check_stream_format(fmt, what)
    stream = data[HEADER_BYTES:]
    if num_bits > MAX_MESSAGE_BITS or len(stream) != -(-num_bits // 8):
        raise ValueError(
            f"{what} is truncated or padded: its header says {num_bits} bits ({-(-num_bits // 8)} bytes), "
            f"but {len(stream)} bytes follow it"
        )
    if num_bits % 8 and stream[-1] >> (num_bits % 8):
        raise ValueError(f"{what} has set bits past its {num_bits} bits: a corrupted stream")
    padded = stream + bytes(-len(stream) % 4)
    words = np.frombuffer(padded, "<u4").astype(np.uint32)
    return Message(payload=jnp.asarray(words), num_bits=as_bits(num_bits))
