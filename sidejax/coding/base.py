"""The Coder contract: transmit one sample of ``q`` using side information ``p`` that both ends know.

Every message in sidejax, uplink or downlink, compressed or not, is built by a :class:`Coder`:

- ``init(dim) -> state``: the coder's protocol state (e.g. the KLMS block partition); ``EmptyState()`` when
  the coder has none.
- ``encode(keys, q, p, state) -> (Message, info)``: the sender's side. ``keys`` is a
  :class:`sidejax.keys.ClientKeys`: ``keys.shared`` is known to both ends (candidates, dithers),
  ``keys.private`` only to the sender (the index choice, or the sample itself). ``info`` has a boolean
  ``valid`` field (False when ``q`` or ``p`` was invalid, so the stream is garbage) and ``ideal_bits``, an
  ideal rate for the message where one is defined (KLMS: :math:`D_{KL}(q \\| p)` in bits; NaN otherwise),
  reported beside ``num_bits`` and labelled ideal.
- ``decode(shared_key, p, state, message) -> (sample, decoded)``: the receiver's side. Its signature
  cannot see ``q`` or the private key: everything it learns is in the message. ``decoded`` has ``valid``
  and ``errors`` fields (an int32 bitmask of ``ERR_*``; :func:`stream_errors` turns it into sentences).
- ``update(state, decoded) -> (state, info)``: the protocol step on the server, with every participant's
  ``decoded`` stacked on axis 0 (identity when stateless). Only the entries whose ``decoded.valid`` is True
  count (with none, the state is kept): the server passes ``decoded._replace(valid=included(...))`` so that
  an excluded participant leaves no trace in the protocol either.
- A sender whose ``info.valid`` is False sends no stream: :func:`withhold` marks its message (length
  :data:`WITHHELD_BITS`, which every decoder rejects), and :func:`included` is the aggregation mask every
  server uses (the round engine withholds; :func:`sidejax.fl.build_round_step`).
- ``downlink(state) -> Message``: the protocol side information the receivers need for the next round
  (a real stream; 0 bits when stateless), and ``receive(state, message) -> state``: the client side of it.
- ``uses_prior``: whether ``decode`` depends on ``p``. When it does, ``p`` must be known to the receiver,
  so an algorithm whose ``p`` is built by the server (QSGD-KLMS's symbol frequencies) sends it downlink.
- What a caller may know before encoding anything (declared, static; the family contract test checks each
  against what ``encode`` does): ``capacity_words(dim)``, the words of the payload buffer ``encode`` returns
  inside jit for a ``dim``-coordinate input; ``deterministic``, whether the coder adds no randomness of its
  own; ``fixed_bits(dim)``, the one length of every message for ``dim`` coordinates, or ``None`` when the
  length depends on the values or the protocol state (:attr:`Coder.fixed_length`).
- ``live_prefix`` (:class:`LivePrefix`, or ``None``): whether the coder can code only the first ``live``
  coordinates of a static ``dim``-coordinate buffer, ``live`` a traced count (BICompFL's SplitDL codes one
  group of blocks of a group-sized buffer). ``live_prefix.init(dim, live)`` is the state to encode and
  decode with; the message costs what ``live`` coordinates cost. A coder that declares none codes every
  coordinate; :func:`check_live_prefix` is the refusal, naming the argument, for callers that need it.

A :class:`Message` holds the stream (``payload``: ``uint32`` words, LSB first) and its length in bits
(``num_bits``), computed from what was written. Every function here behaves the same inside ``jit`` and
outside it: ``encode`` returns the static ``capacity_words(dim)`` buffer (words past ``num_bits`` zero) and
``decode`` reports problems in its ``valid``/``errors`` flags. The host side of a transport does the rest at
its boundary, once: :func:`sent_message` cuts a message to the ``ceil(num_bits / 32)`` words that cross the
wire (what a driver serialises), and :func:`check_decoded` raises on a decoded stream's flags. Decoders
accept either form, the capacity buffer or exactly the words sent. Coders compose the way optax transforms
do: :func:`with_side_info` adds float32 side information (e.g. QSGD's norms) to any coder,
:func:`with_crc` an integrity check (a CRC-32 of the shared key, the prior and the stream) to any coder's
messages, and :func:`concat_messages` / :func:`split_message` join and cut streams at bit precision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.bits import as_bits, check_capacity_bits, payload_bits
from sidejax.coding.bitstream import crc32_words, mask_to_length, pack_fixed, trim_payload, unpack_fixed
from sidejax.distributions import dist_dim
from sidejax.types import Bits, PyTree

__all__ = [
    "Message",
    "EmptyState",
    "Coder",
    "StreamCheck",
    "LivePrefix",
    "check_live_prefix",
    "ERR_LENGTH",
    "ERR_PARTITION",
    "ERR_PARSE",
    "ERR_PRIOR",
    "ERR_CRC",
    "ERR_INPUT",
    "WITHHELD_BITS",
    "stream_errors",
    "failed_checks",
    "sent_message",
    "check_decoded",
    "withhold",
    "included",
    "empty_message",
    "concat_messages",
    "concat_after_float32",
    "split_message",
    "concat_stacked",
    "split_stacked",
    "stateless_coder",
    "configured_coder",
    "encode_float32",
    "decode_float32",
    "float32_coder",
    "with_side_info",
    "wrap_coder",
    "prior_fingerprint",
    "stream_crc",
    "CRCDecoded",
    "with_crc",
]


class Message(NamedTuple):
    """One encoded message.

    Attributes:
      payload: ``uint32`` words (LSB first). A coder returns its static-capacity buffer, inside ``jit`` and
        outside it alike: only the first ``ceil(num_bits / 32)`` words are sent, and every word (and bit)
        past ``num_bits`` is zero. :func:`sent_message` cuts it to the words sent.
      num_bits: int32 scalar (:data:`sidejax.bits.BITS_DTYPE`), the message's length in bits, computed from
        what was written: exact up to :data:`sidejax.bits.MAX_MESSAGE_BITS` (256 MiB).
    """

    payload: PyTree
    num_bits: Bits


class EmptyState(NamedTuple):
    """The state of a component that has none (a stateless coder, stateless clients)."""


# bits of a decoded stream's ``errors`` mask (shared by every coder)
ERR_LENGTH = 1
ERR_PARTITION = 2
ERR_PARSE = 4
ERR_PRIOR = 8
ERR_CRC = 16
ERR_INPUT = 32
#: The length of a withheld message (:func:`withhold`): no stream was sent, and no decoder's length check
#: accepts a negative length.
WITHHELD_BITS = -1
_ERROR_TEXT = {
    ERR_LENGTH: "the payload is shorter than num_bits claims, or holds set bits past num_bits "
    "(length mismatch: truncated or padded stream)",
    ERR_PARTITION: "the block lengths do not sum to dim (corrupted partition field)",
    ERR_PARSE: "the fields read do not add up to num_bits (corrupted or mis-sized stream)",
    ERR_PRIOR: "the prior p is not a valid distribution (NaN or out-of-range parameters)",
    ERR_CRC: "CRC-32 mismatch (corrupted bits, a stream encoded with another shared key, or a receiver whose "
    "prior differs from the sender's: the parties' priors are out of sync)",
    ERR_INPUT: "the decoded values are not what an encoder can produce (corrupted stream)",
}


def stream_errors(errors) -> list[str]:
    """Host side: the reasons encoded in a decoded stream's ``errors`` bitmask, as sentences."""
    code = int(errors)
    return [text for bit, text in _ERROR_TEXT.items() if code & bit]


_CHECK_BITS = {
    "length": ERR_LENGTH,
    "partition": ERR_PARTITION,
    "parse": ERR_PARSE,
    "prior": ERR_PRIOR,
    "crc": ERR_CRC,
    "input": ERR_INPUT,
}


def failed_checks(**passed) -> jax.Array:
    """A decoder's int32 ``errors`` bitmask from its checks: each keyword (``length``, ``partition``,
    ``parse``, ``prior``, ``crc``, ``input``) is a bool array that is True where that check passed, and
    the mask has the check's bit (:data:`ERR_LENGTH`, ..., :data:`ERR_INPUT`) set where it failed; the
    checks' shapes broadcast. ``failed_checks(length=ok_len, parse=ok_parse)`` is
    ``where(ok_len, 0, ERR_LENGTH) | where(ok_parse, 0, ERR_PARSE)``."""
    unknown = sorted(set(passed) - set(_CHECK_BITS))
    if unknown:
        raise ValueError(f"unknown checks {unknown}: the checks are {sorted(_CHECK_BITS)}")
    errors = jnp.int32(0)
    for check, ok in passed.items():
        errors = errors | jnp.where(ok, 0, _CHECK_BITS[check]).astype(jnp.int32)
    return errors


def sent_message(message: Message) -> Message:
    """Host side, the transport boundary: ``message`` as it crosses the wire, its payload cut to the
    ``ceil(num_bits / 32)`` words that are sent (:func:`sidejax.coding.trim_payload`). The one place where a
    capacity buffer becomes the exact words: drivers and tests that serialise a message call it, and every
    decoder takes its result as it takes the buffer.

    Raises ``ValueError`` (from :func:`sidejax.coding.trim_payload`) when the buffer is shorter than
    ``num_bits`` claims, holds set bits past ``num_bits`` (the contract: words and bits past the length
    are zero), or the length is not a whole number ``>= 0`` (a :func:`withhold` -held message sends no
    stream). Needs a concrete message (call it outside ``jit``)."""
    return Message(trim_payload(_words(message), message.num_bits), as_bits(message.num_bits))


def check_decoded(decoded, what: str = "stream"):
    """Host side, the receiving boundary: ``decoded`` if it reports a clean stream, else ``ValueError``
    naming ``what`` and the reasons (:func:`stream_errors`). ``decoded`` is a decoder's report (its
    ``valid`` and ``errors`` fields, one stream's or stacked over several) or an ``errors`` bitmask alone
    (e.g. :func:`sidejax.algorithms.bicompfl.decode_samples`'s). Decoders never raise on a stream's
    contents, inside ``jit`` or outside it; a host caller that wants an exception calls this. Needs a
    concrete report (outside ``jit``)."""
    errors = np.bitwise_or.reduce(
        np.asarray(getattr(decoded, "errors", decoded), np.int32).ravel(), initial=0
    )
    if not np.all(np.asarray(getattr(decoded, "valid", True))) or errors:
        reasons = stream_errors(errors) or ["the decoder flagged it"]
        raise ValueError(f"invalid {what}: " + "; ".join(reasons))
    return decoded


def withhold(messages: Message, send: jax.Array) -> Message:
    """``messages`` with every entry whose ``send`` is False *withheld*: its length becomes
    :data:`WITHHELD_BITS` (``-1``, "no stream"), its payload is kept as it was (a static buffer).

    This is how what an encoder knows is wrong reaches the receiver: a client whose encoder reported
    ``valid=False`` (or whose result is not finite) sends no stream, and the receiver reads that from the
    message itself (:func:`included`), whatever the coder. The round engine applies it to every uplink
    (:func:`sidejax.fl.build_round_step`); ``messages`` may be one message or stacked (``send`` then has
    the shape of ``num_bits``)."""
    bits = as_bits(messages.num_bits)
    return Message(
        messages.payload, jnp.where(jnp.asarray(send, bool), bits, WITHHELD_BITS).astype(bits.dtype)
    )


def included(messages: Message, decoded_valid: jax.Array) -> jax.Array:
    """The aggregation mask of a stacked uplink, the one rule every server applies: participant ``i`` is
    included iff its stream was sent (not :func:`withhold` -held) and its decoder reported it valid.
    ``bool[clients]``. An excluded participant contributes nothing to any aggregate (see
    :func:`sidejax.utils.masked_mean`)."""
    sent = as_bits(messages.num_bits) >= 0
    return sent & jnp.broadcast_to(jnp.asarray(decoded_valid, bool), sent.shape)


class StreamCheck(NamedTuple):
    """What a stateless decoder reports besides the sample: ``valid`` (``errors == 0``) and ``errors``."""

    valid: jax.Array
    errors: jax.Array


class LivePrefix(NamedTuple):
    """How a coder codes only a live prefix of its input (:attr:`Coder.live_prefix`).

    Attributes:
      init: ``init(dim, live) -> state``: the protocol state with which ``encode`` and ``decode`` code only
        the first ``live`` coordinates of a ``dim``-coordinate ``q`` / ``p`` (``dim`` static, ``live`` an
        int32 scalar that may be traced, ``1 <= live <= dim``). ``init(dim, dim)`` is ``Coder.init(dim)``.
        The message costs what ``live`` coordinates cost (``fixed_bits(live)`` for a fixed-length coder;
        ``frame`` reads it from the state), inside the buffer of ``capacity_words(dim)`` words. The decoded
        sample means nothing past ``live``: the coordinates there are padding, and a caller sets
        ``q = p`` on them (a coder may carry them in its last live block, where ``q = p`` adds nothing).
      block: the prefix is coded in whole blocks of ``block`` coordinates (``ceil(live / block)`` of them):
        cutting a vector into parts at multiples of ``block`` costs no bit more than coding it whole (what
        SplitDL's block-aligned groups rely on, docs/papers/bicompfl.md#s3-6).
    """

    init: Callable[[int, Any], Any]
    block: int


class Coder(NamedTuple):
    """A coder: pure functions only (see the module docstring for the contract). They behave the same
    inside ``jit`` and outside it: ``encode`` returns the ``capacity_words`` buffer and ``decode`` reports
    a bad stream in its flags, never by raising; the host-side boundary is :func:`sent_message` (the
    words that cross the wire) and :func:`check_decoded` (raise on a report's flags).

    Attributes:
      init: ``init(dim) -> state``.
      encode: ``encode(keys, q, p, state) -> (Message, info)``.
      decode: ``decode(shared_key, p, state, message) -> (sample, decoded)``.
      update: ``update(state, decoded_stacked) -> (state, info)``.
      downlink: ``downlink(state) -> Message`` (protocol side information for the receivers).
      receive: ``receive(state, message) -> state`` (the receivers' decoding of ``downlink``).
      uses_prior: whether ``decode`` depends on ``p`` (static).
      name: a short name for tables and errors.
      capacity_words: ``capacity_words(dim) -> int`` (static): the words of the payload buffer that
        ``encode`` returns, inside ``jit`` and outside it alike, for a ``dim``-coordinate input (``q``'s
        vector; for :func:`with_side_info`, the inner vector), i.e. the longest message it can write,
        rounded up to whole words plus any slack its buffers carry. Of it the
        ``ceil(num_bits / 32) <= capacity_words(dim)`` words are sent (the rest are zero; the host-side
        :func:`sent_message` cuts them at the transport boundary). Receivers size their buffers with it
        (e.g. :func:`split_stacked`'s ``capacity_words``) and decode either form.
      deterministic: the coder adds no randomness of its own: ``encode``'s message depends on the keys only
        through the sample it draws from ``q`` with ``keys.private`` (for a
        :class:`sidejax.distributions.PointMass`, not at all) and ``decode`` does not use ``shared_key``.
        So a point mass gives the same message and the same decoded vector under any keys (what an
        error-feedback compressor must be, :func:`sidejax.algorithms.compressed.check_compressor`). False
        for channel simulation (KLMS), dithered quantisation, private noise, and :func:`with_crc` (its
        checksum covers the shared key). Defaults to False, the safe answer.
      fixed_bits: ``fixed_bits(dim) -> int``, or ``None``: the length in bits of *every* message for a
        ``dim``-coordinate input, whatever the values, the keys and the protocol state (scaled sign:
        ``32 + dim``; float32: ``32 dim``; Fixed-KLMS: ``ceil(dim / b) log2 K``). ``None`` when the length
        depends on any of them (variable-length codes, adaptive blocks, KLMS-Avg's size field).
      frame: ``frame(state, words, bit_offset) -> num_bits``, or ``None``: the length of the message that
        starts at bit ``bit_offset`` of ``words``, read from the stream and the protocol state alone (the
        receiver's knowledge). A coder with ``frame`` writes *self-delimiting* streams, so several of its
        messages can travel back to back with no length fields in between (BICompFL-GR relays the
        clients' uplink streams this way, :func:`split_stacked`); ``None`` when its streams are not.
      live_prefix: a :class:`LivePrefix` when the coder can code only the first ``live`` (traced)
        coordinates of a static ``dim``-coordinate buffer (Fixed-KLMS, and :func:`with_crc` /
        :func:`with_side_info` around it); ``None`` (the default) when it codes every coordinate.
        :func:`check_live_prefix` refuses a coder without one.
    """

    init: Callable[[int], Any]
    encode: Callable[..., tuple[Message, Any]]
    decode: Callable[..., tuple[jax.Array, Any]]
    update: Callable[[Any, Any], tuple[Any, Any]]
    downlink: Callable[[Any], Message]
    receive: Callable[[Any, Message], Any]
    capacity_words: Callable[[int], int]
    uses_prior: bool = True
    name: str = "coder"
    frame: Callable[[Any, jax.Array, Any], jax.Array] | None = None
    deterministic: bool = False
    fixed_bits: Callable[[int], int] | None = None
    live_prefix: LivePrefix | None = None

    @property
    def fixed_length(self) -> bool:
        """Whether every message has one length per dimension (:attr:`fixed_bits` is declared)."""
        return self.fixed_bits is not None


def check_live_prefix(coder: Coder, argument: str = "coder") -> LivePrefix:
    """``coder.live_prefix``, or a ``ValueError`` naming ``argument`` when the coder declares none (it codes
    every coordinate of its input, so it cannot code a live prefix of a static buffer)."""
    if coder.live_prefix is None:
        raise ValueError(
            f"{argument}: coder {coder.name!r} cannot code only the first `live` coordinates of a buffer "
            "(Coder.live_prefix is None); use a coder that declares one, e.g. "
            "klms_coder(KLMSConfig(adaptive=False, ...))"
        )
    return coder.live_prefix


def empty_message() -> Message:
    """A message of 0 bits (an empty word array)."""
    return Message(jnp.zeros((0,), jnp.uint32), as_bits(0))


def _words(message: Message) -> jax.Array:
    words = jnp.asarray(message.payload)
    if words.ndim != 1 or words.dtype != jnp.uint32:
        raise ValueError(
            f"a message payload must be a 1-D uint32 word array, got {words.dtype} of shape {words.shape}"
        )
    return words


def concat_messages(*parts: Message) -> Message:
    """One stream holding ``parts`` back to back at bit precision: part ``i + 1`` starts at bit
    ``sum(num_bits[:i + 1])``, with no padding in between (``num_bits`` is the sum). The payload is a
    buffer of the parts' word counts plus one word per join (zero past ``num_bits``)."""
    if not parts:
        return empty_message()
    words = _words(parts[0])
    offset = as_bits(parts[0].num_bits)
    for part in parts[1:]:
        pw = _words(part)
        buf = jnp.concatenate([words, jnp.zeros(pw.shape[0] + 1, jnp.uint32)])
        check_capacity_bits(32 * buf.shape[0], "a concatenated message's buffer")
        words = pack_fixed(pw, 32, bit_offset=offset, out=buf)
        offset = offset + as_bits(part.num_bits)
    return Message(words, offset)


def concat_after_float32(values: jax.Array, *parts: Message) -> Message:
    """``concat_messages(encode_float32(values), *parts)``, the same payload and length, with the first join
    done by placing words: the float32 header is a whole number of words known when tracing, so the next
    part starts on a word and needs no shift of each of its words (``concat_messages`` cannot know that of
    a traced length). The header of :func:`clip_update`-style coders and of vector downlinks."""
    head = encode_float32(values)
    if not parts:
        return head
    first, rest = parts[0], parts[1:]
    pw = _words(first)
    words = jnp.concatenate([head.payload.reshape(-1), pw, jnp.zeros(1, jnp.uint32)])
    check_capacity_bits(32 * words.shape[0], "a concatenated message's buffer")
    return concat_messages(Message(words, head.num_bits + as_bits(first.num_bits)), *rest)


def split_message(message: Message, lengths: tuple[int, ...]):
    """Cuts a stream built by :func:`concat_messages` whose leading parts have the static ``lengths`` (bits);
    the last part is the rest. Returns ``len(lengths) + 1`` messages (each leading part's payload holds
    ``ceil(length / 32)`` words, the last part the remaining words).

    Bits past ``message.num_bits`` are zeroed first, so a padded buffer cannot leak into a part."""
    words = _words(message)
    n = words.shape[0]
    words, _ = mask_to_length(words, message.num_bits)
    parts = []
    offset = 0
    for length in lengths:
        cap = -(-length // 32)
        part = _words_from(words, cap, offset)
        part, _ = mask_to_length(part, length)
        parts.append(Message(part, as_bits(length)))
        offset += length
    rest_cap = max(0, n - offset // 32)
    rest = _words_from(words, rest_cap, offset)
    parts.append(Message(rest, as_bits(message.num_bits) - offset))
    return parts


def _words_from(words: jax.Array, count: int, offset: int) -> jax.Array:
    """``count`` words of the stream from its static bit ``offset`` (zeros past the end): a slice when
    ``offset`` is a whole number of words, else :func:`~sidejax.coding.bitstream.unpack_fixed`'s shifts."""
    padded = jnp.pad(words, (0, count + 1))
    if offset % 32 == 0:
        return padded[offset // 32 : offset // 32 + count]
    return unpack_fixed(padded, count, 32, bit_offset=offset)


def concat_stacked(messages: Message, keep: jax.Array | None = None) -> Message:
    """One stream holding the stacked ``messages`` (payload ``[n, words]``, ``num_bits[n]``) back to back
    at bit precision, in order, skipping those with ``keep[i]`` False: :func:`concat_messages` for a
    batch, as one ``lax.scan`` (no Python loop over the parts). The payload is a buffer of
    ``n * words + 1`` words (zero past ``num_bits``). The parts carry no lengths: the receiver cuts the
    stream with a coder's ``frame`` (:func:`split_stacked`)."""
    words = jnp.asarray(messages.payload, jnp.uint32)
    if words.ndim != 2:
        raise ValueError(f"messages.payload must be stacked as [parts, words], got shape {words.shape}")
    n, cap = words.shape
    bits = jnp.broadcast_to(as_bits(messages.num_bits), (n,))
    keep = jnp.ones(n, bool) if keep is None else jnp.asarray(keep, bool)

    def step(carry, part):
        buf, offset = carry
        w, nb, k = part
        w, _ = mask_to_length(w, nb)
        placed = pack_fixed(w, 32, bit_offset=offset, out=buf)
        return (jnp.where(k, placed, buf), offset + jnp.where(k, nb, 0)), None

    buf = jnp.zeros(n * cap + 1, jnp.uint32)
    check_capacity_bits(32 * buf.shape[0], "a relay's buffer")
    (buf, total), _ = jax.lax.scan(step, (buf, as_bits(0)), (words, bits, keep))
    return Message(buf, total)


def split_stacked(message: Message, frame: Callable, state: Any, num_parts: int, capacity_words: int):
    """Cuts a stream of ``num_parts`` self-delimiting messages written back to back (:func:`concat_stacked`)
    into ``Message(payload[num_parts, capacity_words], num_bits[num_parts])``, reading each part's length
    with ``frame(state, words, bit_offset)`` (:attr:`Coder.frame`) at the running offset.

    Returns ``(messages, ok)``: ``ok`` is False when the parts do not add up to ``message.num_bits`` exactly
    (a truncated or padded relay)."""
    words = jnp.asarray(message.payload, jnp.uint32)
    words = jnp.pad(words, (0, num_parts * capacity_words + 1))
    words, ok_length = mask_to_length(words, message.num_bits)

    def step(offset, _):
        nb = as_bits(frame(state, words, offset))
        part = unpack_fixed(words, capacity_words, 32, bit_offset=offset)
        part, _ = mask_to_length(part, jnp.minimum(nb, 32 * capacity_words))
        return offset + nb, (part, nb)

    total, (parts, bits) = jax.lax.scan(step, as_bits(0), None, length=num_parts)
    ok = ok_length & (total == as_bits(message.num_bits)) & jnp.all(bits <= 32 * capacity_words)
    return Message(parts, bits), ok


def configured_coder(config, protocol: tuple[Callable, ...], **fields) -> Coder:
    """The :class:`Coder` of a stateful protocol whose functions take its static ``config`` as their last
    argument, bound to ``config`` here once with the contract's signatures (``decode(shared_key, p, state,
    message)``, ...): ``protocol`` is ``(init, encode, decode, update, downlink, receive, frame)`` in the
    order of the Coder's fields (``init(dim, config)``, ``encode(keys, q, p, state, config)``, ...,
    ``frame(state, words, bit_offset, config)``). ``capacity_words`` is ``config.capacity_words``; ``fields``
    sets the others (``name``, ``deterministic``, ``fixed_bits``)."""
    init, encode, decode, update, downlink, receive, frame = protocol
    return Coder(
        init=lambda dim: init(dim, config),
        encode=lambda keys, q, p, state: encode(keys, q, p, state, config),
        decode=lambda shared_key, p, state, message: decode(shared_key, p, state, message, config),
        update=lambda state, decoded: update(state, decoded, config),
        downlink=lambda state: downlink(state, config),
        receive=lambda state, message: receive(state, message, config),
        frame=lambda state, words, bit_offset: frame(state, words, bit_offset, config),
        capacity_words=config.capacity_words,
        **fields,
    )


def stateless_coder(
    encode,
    decode,
    *,
    uses_prior: bool,
    name: str,
    capacity_words: Callable[[int], int],
    deterministic: bool,
    fixed_bits: Callable[[int], int] | None = None,
) -> Coder:
    """A :class:`Coder` without protocol state: ``encode(keys, q, p)``, ``decode(shared_key, p, message)``;
    ``update`` is the identity and ``downlink`` sends nothing. ``capacity_words``, ``deterministic`` and
    ``fixed_bits`` are declared as :class:`Coder` describes them."""

    def update(state, decoded):
        return state, StreamCheck(jnp.asarray(decoded.valid), jnp.asarray(decoded.errors))

    return Coder(
        init=lambda dim: EmptyState(),
        encode=lambda keys, q, p, state: encode(keys, q, p),
        decode=lambda shared_key, p, state, message: decode(shared_key, p, message),
        update=update,
        downlink=lambda state: empty_message(),
        receive=lambda state, message: state,
        capacity_words=capacity_words,
        uses_prior=uses_prior,
        name=name,
        deterministic=deterministic,
        fixed_bits=fixed_bits,
    )


def encode_float32(x: jax.Array) -> Message:
    """Encodes a float vector as IEEE-754 float32 words (32 bits per coordinate, lossless for float32).

    The payload is the bit pattern itself (``uint32``), so the length is ``32 * x.size`` by construction.
    """
    words = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
    return Message(payload=words, num_bits=payload_bits(words))


def decode_float32(message: Message) -> jax.Array:
    """Inverse of :func:`encode_float32`: bit-exact."""
    return jax.lax.bitcast_convert_type(message.payload, jnp.float32)


class Float32Info(NamedTuple):
    """``valid``: the value sent was finite; ``ideal_bits``: NaN (no ideal rate for a point mass)."""

    valid: jax.Array
    ideal_bits: jax.Array


def _known_dim(p) -> int | None:
    """The vector length the receiver knows from ``p`` (a distribution's dimension, or the length of a
    reference point ``p.center``), or ``None`` when ``p`` does not tell it."""
    center = getattr(p, "center", None)
    if center is not None:
        return int(jnp.shape(center)[-1])
    try:
        return int(dist_dim(p))
    except (TypeError, ValueError, AttributeError):
        return None


def float32_coder() -> Coder:
    """The uncompressed coder: the sender draws its sample of ``q`` with its private key (a point mass,
    :class:`sidejax.distributions.PointMass`, for FedAvg's parameters; a Gaussian for uncompressed SGLD)
    and sends it as float32 words, 32 bits per coordinate. ``p`` is not used."""

    def encode(keys, q, p):
        del p
        value = q.sample(keys.private)
        return encode_float32(value), Float32Info(jnp.all(jnp.isfinite(value)), jnp.float32(jnp.nan))

    def decode(shared_key, p, message):
        del shared_key
        words = _words(message)
        dim = _known_dim(p)
        if dim is not None and words.shape[0] > dim:
            # a static buffer longer than the vector (e.g. a stream cut out of a concatenation inside jit):
            # the words past the vector must be zero, then they are dropped
            words, ok_tail = mask_to_length(words, message.num_bits)
            words = words[:dim]
        else:
            ok_tail = jnp.asarray(True)
        ok = ok_tail & (jnp.asarray(message.num_bits) == 32 * words.shape[0])
        errors = failed_checks(length=ok)
        return decode_float32(Message(words, message.num_bits)), StreamCheck(ok, errors)

    return stateless_coder(
        encode,
        decode,
        uses_prior=False,
        name="float32",
        capacity_words=lambda dim: int(dim),
        deterministic=True,
        fixed_bits=lambda dim: 32 * int(dim),
    )


class SideInfoDecoded(NamedTuple):
    """``inner``: the inner coder's decoded info; ``valid``/``errors`` of the whole stream."""

    inner: Any
    valid: jax.Array
    errors: jax.Array


def with_side_info(coder: Coder, num_values: int) -> Coder:
    """``coder`` plus ``num_values`` float32 values of side information sent in front of its stream.

    The wrapped coder takes ``q = (inner_q, side)`` with ``side`` a float vector ``[num_values]`` (e.g. QSGD's
    per-tensor norms) and decodes to ``(inner_sample, side)``. The stream is the ``32 * num_values`` bits of
    ``side`` followed by the inner coder's stream (:func:`concat_messages`), so the receiver reads the
    side information first and the inner stream is exactly the rest. ``p`` and the state are the inner
    coder's.
    """
    if num_values < 0:
        raise ValueError(f"num_values must be >= 0, got {num_values}")
    head = 32 * num_values

    def encode(keys, q, p, state):
        inner_q, side = q
        side = jnp.asarray(side, jnp.float32)
        if side.shape != (num_values,):
            raise ValueError(f"side information must have shape ({num_values},), got {side.shape}")
        msg, info = coder.encode(keys, inner_q, p, state)
        info = info._replace(valid=info.valid & jnp.all(jnp.isfinite(side)))
        return concat_after_float32(side, msg), info

    def decode(shared_key, p, state, message):
        side_msg, inner_msg = split_message(message, (head,))
        sample, decoded = coder.decode(shared_key, p, state, inner_msg)
        return (sample, decode_float32(side_msg)), SideInfoDecoded(decoded, decoded.valid, decoded.errors)

    def update(state, decoded):
        return coder.update(state, decoded.inner._replace(valid=decoded.valid, errors=decoded.errors))

    # concat_messages' buffer: the side words, the inner buffer and one word for the shift
    return wrap_coder(
        coder,
        encode,
        decode,
        update,
        name=f"{coder.name}+side",
        bits=head,
        words=num_values + 1,
        live_prefix=coder.live_prefix,  # ``live`` counts the inner vector; the side values always travel
    )


def wrap_coder(
    coder: Coder,
    encode,
    decode,
    update,
    *,
    name: str,
    bits: int = 0,
    words: int = 0,
    frame=None,
    live_prefix: LivePrefix | None = None,
    **fields,
) -> Coder:
    """The :class:`Coder` of a wrapper around ``coder`` (:func:`with_side_info`, :func:`with_crc`,
    :func:`sidejax.coding.clip_update`): its own ``encode``, ``decode``, ``update`` and ``name``; every
    message is the inner stream plus ``bits`` bits of the wrapper's (a header or a checksum), held in a
    buffer of ``words`` more words than the inner coder's (``capacity_words``); ``fixed_bits`` grows by
    ``bits`` where the inner coder declares it. ``frame`` is the wrapper's own (``None``: its streams are not
    self-delimiting), and so is ``live_prefix`` (``None``: a wrapper that keeps the inner coder's passes it
    on, where a prefix coded alone and inside a buffer still give the same message). ``init``,
    ``downlink``, ``receive``, ``uses_prior`` and ``deterministic`` are the inner coder's unless ``fields``
    replaces them."""
    fixed_bits = None
    if coder.fixed_bits is not None:

        def fixed_bits(dim):
            return bits + coder.fixed_bits(dim)

    return coder._replace(
        encode=encode,
        decode=decode,
        update=update,
        name=name,
        capacity_words=lambda dim: words + coder.capacity_words(dim),
        fixed_bits=fixed_bits,
        frame=frame,
        live_prefix=live_prefix,
        **fields,
    )


def _kl_ideal_bits(info) -> jax.Array:
    """The ideal rate of the message, :math:`D_{KL}(q \\| p)` in bits (the Coder contract's name)."""
    return info.kl_bits


#: The ``ideal_bits`` property of an encoder info that stores the ideal rate as its ``kl_bits`` field
#: (:class:`sidejax.coding.KLMSClientInfo`, :class:`sidejax.coding.KLMSAvgClientInfo`).
kl_ideal_bits = property(_kl_ideal_bits)


def prior_fingerprint(p) -> jax.Array:
    """A 32-bit fingerprint of a distribution's parameters (every leaf's float32 bits):
    :math:`\\sum_k \\mathrm{bits}(v_k) \\cdot m_k \\bmod 2^{32}` with odd multipliers
    :math:`m_k = (2654435761 (k + 1)) \\,|\\, 1`. Vectorised (one multiply-add per value); two priors that
    differ in any single value always differ (an odd multiplier is invertible mod :math:`2^{32}`)."""
    total = jnp.uint32(0)
    for i, leaf in enumerate(jax.tree.leaves(p)):
        v = jax.lax.bitcast_convert_type(jnp.asarray(leaf, jnp.float32).reshape(-1), jnp.uint32)
        k = jnp.arange(v.shape[0], dtype=jnp.uint32) + jnp.uint32(1 + (i << 24))
        mult = (k * jnp.uint32(2654435761)) | jnp.uint32(1)
        total = total + jnp.sum(v * mult, dtype=jnp.uint32)
    return total


def stream_crc(shared_key, p, words: jax.Array, num_bits) -> jax.Array:
    """CRC-32 (:func:`sidejax.coding.crc32_words`) of the shared key's data words, the prior's fingerprint
    (:func:`prior_fingerprint`; left out when ``p`` is ``None``), then the first ``num_bits`` bits of
    ``words`` (later bits zeroed), over ``ceil(num_bits / 32)`` stream words. Any error burst of up to 32
    bits in the stream is detected, and so are a wrong shared key and a receiver whose prior differs."""
    key_words = jax.random.key_data(shared_key).reshape(-1).astype(jnp.uint32)
    if p is not None:
        key_words = jnp.concatenate([key_words, prior_fingerprint(p)[None]])
    masked, _ = mask_to_length(words, num_bits)
    used = (as_bits(num_bits) + 31) // 32
    return crc32_words(jnp.concatenate([key_words, masked]), key_words.shape[0] + used)


class CRCDecoded(NamedTuple):
    """What :func:`with_crc`'s decoder reports: the inner coder's report (``inner``), and ``valid`` /
    ``errors`` with the check's verdict added (:data:`ERR_CRC` when the checksum does not match,
    :data:`ERR_LENGTH` when the message is shorter than the checksum)."""

    inner: Any
    valid: jax.Array
    errors: jax.Array


def with_crc(coder: Coder) -> Coder:
    """``coder`` with an integrity check: every message is the inner coder's stream followed by 32 bits, the
    :func:`stream_crc` of (the shared key, the prior's fingerprint when ``coder.uses_prior``, the inner
    stream). The receiver recomputes it from what it knows and reports a mismatch as :data:`ERR_CRC`
    (``valid`` False), so a flipped or lost bit, a stream decoded with another shared key, and a receiver
    whose prior has drifted from the sender's are detected instead of decoding to a plausible wrong sample.
    It costs 32 bits per message, counted in ``num_bits`` (and in ``fixed_bits``); the coder it returns is
    not ``deterministic``, since the checksum depends on the shared key.

    Everything else is the inner coder's: state, protocol (``update`` sees the inner report with the
    check's verdict in its ``valid`` and ``errors``), downlink, ``live_prefix`` (a prefix's message plus
    32 bits), and ``frame`` (plus 32 bits), so a checked
    stream stays self-delimiting. Works inside and outside ``jit``, for any coder, and the coders with a
    checksum of their own (``KLMSConfig(crc32=True)``, ``KLMSAvgConfig(crc32=True)``) compute the same
    :func:`stream_crc` inside their streams.
    """

    def prior(p):
        return p if coder.uses_prior else None

    def encode(keys, q, p, state):
        msg, info = coder.encode(keys, q, p, state)
        words = _words(msg)
        crc = stream_crc(keys.shared, prior(p), words, msg.num_bits)
        return concat_messages(msg, Message(crc[None], as_bits(32))), info

    def decode(shared_key, p, state, message):
        words = _words(message)
        nb = as_bits(message.num_bits)
        inner_bits = jnp.maximum(nb - 32, 0)
        sent = unpack_fixed(words, 1, 32, bit_offset=inner_bits)[0]  # bits past the buffer read as 0
        inner_words, _ = mask_to_length(words, inner_bits)
        sample, inner = coder.decode(shared_key, p, state, Message(inner_words, inner_bits))
        ok = (nb >= 32) & (sent == stream_crc(shared_key, prior(p), inner_words, inner_bits))
        errors = jnp.asarray(inner.errors, jnp.int32) | failed_checks(length=nb >= 32, crc=ok | (nb < 32))
        return sample, CRCDecoded(inner, errors == 0, errors)

    def update(state, decoded):
        return coder.update(state, decoded.inner._replace(valid=decoded.valid, errors=decoded.errors))

    frame = None
    if coder.frame is not None:

        def frame(state, words, bit_offset):
            return coder.frame(state, words, bit_offset) + 32

    # concat_messages' buffer: the inner buffer, the checksum word and one word for the shift
    return wrap_coder(
        coder,
        encode,
        decode,
        update,
        name=f"{coder.name}+crc",
        bits=32,
        words=2,
        frame=frame,
        live_prefix=coder.live_prefix,  # a prefix's message plus the checksum
        deterministic=False,  # the checksum covers the shared key
    )
