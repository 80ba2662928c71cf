"""The envelope a sidejax message travels in between processes: a 36-byte header, then the message's bytes.

Inside a program a message is a :class:`sidejax.coding.Message` (``uint32`` words and a length in bits).
Between the server and a client running in another process (:mod:`sidejax.flower`) it is these bytes::

    offset  size  field
    0       3     magic b"SJF"
    3       1     envelope version (uint8, :data:`ENVELOPE_VERSION`)
    4       1     kind: 1 downlink, 2 uplink, 3 withheld uplink (no stream follows: the client's encoder input
                  was invalid or its result not finite, which the engine also withholds), 4 round notice (no
                  stream: the round a client is not a participant of, when the downlink is one message per
                  participant, so that it keeps its view of the server state current)
    5       3     reserved (zero)
    8       4     round index (uint32, little-endian, as every field below)
    12      4     client id: the recipient of a downlink (0xFFFFFFFF: every client), the sender of an uplink
    16      4     capacity words: the static buffer the receiver's program holds the stream in
    20      4     error bits: on an uplink, the sender's errors decoding the round's downlink
                  (:func:`sidejax.coding.stream_errors` reads them)
    24      4     CRC-32 of the message bytes that follow (zlib's): a stream corrupted in transit is caught
                  here, since most coded streams decode to *some* sample whatever their bits
    28      8     configuration fingerprint (:func:`config_fingerprint`): a party of another configuration or
                  seed is refused at its first message
    36      m     the message: :func:`sidejax.coding.wire.message_to_bytes`, its own 8-byte header (b"SJX",
                  stream format, num_bits) then ceil(num_bits / 8) bytes

So a message of ``num_bits`` bits is ``44 + ceil(num_bits / 8)`` bytes here (:data:`OVERHEAD_BYTES` + the
stream), and ``36`` for a withheld uplink or a round notice. The bit counts sidejax reports are
``num_bits``; the 44 bytes are framing, reported beside them, and the transport adds its own (the tables of
``docs/deploying.md`` set both beside the stream).
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from typing import NamedTuple

import numpy as np

from sidejax.coding.base import Message
from sidejax.coding.wire import HEADER_BYTES, message_from_bytes, message_to_bytes

__all__ = [
    "ENVELOPE_MAGIC",
    "ENVELOPE_VERSION",
    "ENVELOPE_BYTES",
    "OVERHEAD_BYTES",
    "DOWNLINK",
    "UPLINK",
    "WITHHELD",
    "NOTICE",
    "EVERY_CLIENT",
    "Envelope",
    "EnvelopeError",
    "config_fingerprint",
    "seal",
    "open_envelope",
]

ENVELOPE_MAGIC = b"SJF"
ENVELOPE_VERSION = 1
_HEADER = struct.Struct("<3sBB3xIIIII8s")
ENVELOPE_BYTES = _HEADER.size  # 36
#: Bytes around a stream of ceil(num_bits / 8) bytes: the envelope's header and the stream's own.
OVERHEAD_BYTES = ENVELOPE_BYTES + HEADER_BYTES  # 44
DOWNLINK, UPLINK, WITHHELD, NOTICE = 1, 2, 3, 4
EVERY_CLIENT = 0xFFFFFFFF
_KINDS = {DOWNLINK: "downlink", UPLINK: "uplink", WITHHELD: "withheld uplink", NOTICE: "round notice"}
_EMPTY = (WITHHELD, NOTICE)


class EnvelopeError(ValueError):
    """An envelope that cannot be accepted: not a sidejax envelope, another version or configuration, another
    round or party than expected, or bytes corrupted in transit (``corrupt`` True: the CRC does not match)."""

    def __init__(self, text: str, *, corrupt: bool = False):
        super().__init__(text)
        self.corrupt = corrupt


class Envelope(NamedTuple):
    """An opened envelope: its header fields and, unless ``kind`` is ``WITHHELD`` or ``NOTICE``, the message
    (payload padded with zero words to ``capacity_words``, the receiving program's static buffer)."""

    kind: int
    round_index: int
    client_id: int
    capacity_words: int
    error_bits: int
    fingerprint: bytes
    message: Message | None
    stream_bytes: int


def config_fingerprint(config) -> bytes:
    """8 bytes that tell two configurations apart: the first bytes of the SHA-256 of ``config`` as canonical
    JSON (sorted keys, no spaces; anything JSON cannot write is written with ``repr``). Both ends compute
    it from the run's configuration, seed included."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).digest()[:8]


def seal(
    kind: int,
    message: Message | None,
    *,
    round_index: int,
    client_id: int,
    fingerprint: bytes,
    error_bits: int = 0,
) -> bytes:
    """The envelope of ``message`` (host side; ``None`` with ``kind`` ``WITHHELD`` or ``NOTICE``).
    ``message`` may be a capacity buffer: its words past ``num_bits`` are cut
    (:func:`sidejax.coding.sent_message`)."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be DOWNLINK, UPLINK, WITHHELD or NOTICE, got {kind!r}")
    if len(fingerprint) != 8:
        raise ValueError(f"fingerprint must be 8 bytes (config_fingerprint), got {len(fingerprint)}")
    if kind in _EMPTY:
        body, capacity = b"", 0
    else:
        if message is None:
            raise ValueError(f"a {_KINDS[kind]} envelope needs a message")
        body = message_to_bytes(message)
        capacity = int(np.asarray(message.payload).reshape(-1).shape[0])
    header = _HEADER.pack(
        ENVELOPE_MAGIC,
        ENVELOPE_VERSION,
        kind,
        int(round_index),
        int(client_id) & 0xFFFFFFFF,
        capacity,
        int(error_bits) & 0xFFFFFFFF,
        zlib.crc32(body),
        fingerprint,
    )
    return header + body


def open_envelope(
    data: bytes,
    *,
    fingerprint: bytes,
    round_index: int | None = None,
    kinds: tuple[int, ...] = (DOWNLINK, UPLINK, WITHHELD, NOTICE),
    what: str = "envelope",
) -> Envelope:
    """The :class:`Envelope` in ``data``, checked: raises :class:`EnvelopeError` naming ``what`` for bytes
    that are not a sidejax envelope, another envelope version, another configuration (``fingerprint``),
    another round (when ``round_index`` is given), another kind than ``kinds``, or a CRC mismatch
    (``corrupt=True``), and ``ValueError`` from :func:`sidejax.coding.wire.message_from_bytes` for a stream
    whose own header is wrong."""
    data = bytes(data)
    if len(data) < ENVELOPE_BYTES or data[:3] != ENVELOPE_MAGIC:
        raise EnvelopeError(
            f"{what} is not a sidejax envelope ({len(data)} bytes starting {data[:8]!r}; expected b'SJF'): "
            "is the other end a sidejax.flower app?"
        )
    _, version, kind, rnd, cid, capacity, errors, crc, fp = _HEADER.unpack_from(data)
    if version != ENVELOPE_VERSION:
        raise EnvelopeError(
            f"{what} has envelope version {version}, this sidejax reads version {ENVELOPE_VERSION}: run the "
            "same sidejax version at both ends"
        )
    if fp != fingerprint:
        raise EnvelopeError(
            f"{what} comes from a party with another configuration or seed (fingerprint {fp.hex()}, this "
            f"party's {fingerprint.hex()}): start every party from the same run configuration"
        )
    if kind not in kinds:
        want = ", ".join(_KINDS.get(k, str(k)) for k in kinds)
        raise EnvelopeError(f"{what} is a {_KINDS.get(kind, f'kind {kind}')} envelope, expected {want}")
    if round_index is not None and rnd != round_index:
        raise EnvelopeError(f"{what} is for round {rnd}, expected round {round_index}")
    body = data[ENVELOPE_BYTES:]
    if zlib.crc32(body) != crc:
        raise EnvelopeError(f"{what}: its bytes were corrupted in transit (CRC-32 mismatch)", corrupt=True)
    message = None
    if kind not in _EMPTY:
        message = message_from_bytes(body, what=what)
        words = np.asarray(message.payload, np.uint32)
        if words.shape[0] > capacity:
            raise EnvelopeError(f"{what} holds {words.shape[0]} words, more than its capacity {capacity}")
        message = Message(np.pad(words, (0, capacity - words.shape[0])), message.num_bits)
    return Envelope(kind, rnd, cid, capacity, errors, fp, message, len(body) - HEADER_BYTES if body else 0)
