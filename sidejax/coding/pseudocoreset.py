"""The pseudocoreset coder: BPC-FL's one-shot uplink (docs/papers/bpcfl.md#a1, docs/papers/bpcfl.md#a8) as a
real stream.

A client sends its pseudocoreset ``C_m = (Z_m, ŷ_m)`` and its example count ``n_m`` once. ``q`` is a
:class:`sidejax.distributions.PointMass` on the flat vector ``[Z_m.ravel(), ŷ_m, n_m]`` (``K·D + K + 1``
values; :func:`pack_pseudocoreset` builds it, :func:`unpack_pseudocoreset` cuts a decoded one) and the
stream is

``[Z: K·D float32 words] [ŷ: K labels, ceil(log2 C) bits each (classification) or K float32 (regression)]
[n_m: 32-bit unsigned integer]``

so the message is ``32 K D + K ceil(log2 C) + 32`` bits (classification) or ``32 (K D + K + 1)``
(regression). The paper counts "floats" as ``K·D + K·d_ŷ (+1 for n_m)`` (docs/papers/bpcfl.md#a8); that
convention is reported beside the measured length, labelled as such, never instead of it. ``p`` is not used by
the decoder beyond its dimension (the receiver knows the shapes): a ``PointMass`` of the right length.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sidejax.bits import as_bits
from sidejax.coding.base import (
    Coder,
    Message,
    StreamCheck,
    _known_dim,
    concat_messages,
    decode_float32,
    encode_float32,
    failed_checks,
    split_message,
    stateless_coder,
)
from sidejax.coding.bitstream import num_words, pack_fixed, received_words, unpack_fixed

__all__ = ["PseudocoresetInfo", "pseudocoreset_coder", "pack_pseudocoreset", "unpack_pseudocoreset"]

#: the largest example count the 32-bit field carries exactly (float32 holds integers up to 2^24 exactly)
MAX_EXAMPLES = 2**24


class PseudocoresetInfo(NamedTuple):
    """Encoder diagnostics: ``valid`` (finite inputs, labels in the alphabet, ``1 <= n_m <= 2^24`` an
    integer) and ``ideal_bits`` (NaN: no ideal rate for a point mass)."""

    valid: jax.Array
    ideal_bits: jax.Array


def pack_pseudocoreset(inputs: jax.Array, labels: jax.Array, num_examples) -> jax.Array:
    """The coder's ``q`` vector ``[inputs.ravel(), labels, num_examples]`` (float32)."""
    return jnp.concatenate(
        [
            jnp.ravel(inputs).astype(jnp.float32),
            jnp.ravel(labels).astype(jnp.float32),
            jnp.reshape(jnp.asarray(num_examples, jnp.float32), (1,)),
        ]
    )


def unpack_pseudocoreset(values: jax.Array, num_points: int, input_shape: tuple[int, ...], *, classes: bool):
    """Inverse of :func:`pack_pseudocoreset`: ``(inputs [K, *input_shape], labels [K], num_examples)``;
    int32 labels and count when ``classes`` (classification), float32 labels otherwise."""
    d = math.prod(input_shape)
    inputs = values[: num_points * d].reshape(num_points, *input_shape)
    labels = values[num_points * d : num_points * (d + 1)]
    n = values[num_points * (d + 1)]
    if classes:
        labels = labels.astype(jnp.int32)
    return inputs, labels, n.astype(jnp.int32)


def pseudocoreset_coder(num_points: int, num_classes: int | None) -> Coder:
    """The BPC-FL uplink coder for pseudocoresets of ``num_points`` points (module docstring).

    Args:
      num_points: ``K``, the pseudo-points per client (static; the receiver knows it).
      num_classes: ``C`` for classification (labels sent in ``ceil(log2 C)`` bits each, at least 1), or
        ``None`` for regression (labels are learned floats, sent as float32).

    Raises:
      ValueError: ``num_points < 1`` or ``num_classes < 2``.
    """
    if isinstance(num_points, bool) or not isinstance(num_points, numbers.Integral) or num_points < 1:
        raise ValueError(f"num_points must be an integer >= 1, got {num_points!r}")
    if num_classes is not None and (
        isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 2
    ):
        raise ValueError(f"num_classes must be an integer >= 2 (or None for regression), got {num_classes!r}")
    k = int(num_points)
    width = 32 if num_classes is None else max(1, math.ceil(math.log2(num_classes)))

    def num_inputs(dim: int) -> int:
        """``K·D`` for a vector of ``dim = K·D + K + 1`` values."""
        if (dim - k - 1) % k or dim < 2 * k + 1:
            raise ValueError(
                f"q's vector has {dim} values: expected K·D + K + 1 for K = {k} pseudo-points "
                "(pack_pseudocoreset)"
            )
        return dim - k - 1

    def fixed_bits(dim: int) -> int:
        return 32 * num_inputs(dim) + width * k + 32

    def capacity_words(dim: int) -> int:
        # concat_messages(Z, labels, n_m): Z's words, then each later part's words and one for the shift
        return num_inputs(dim) + (num_words(k, width) + 1) + (1 + 1)

    def encode(keys, q, p):
        del p
        v = jnp.asarray(q.sample(keys.private), jnp.float32)
        n_inputs = num_inputs(v.shape[0])
        z, labels, n = v[:n_inputs], v[n_inputs:-1], v[-1]
        ok_n = (n >= 1) & (n <= MAX_EXAMPLES) & (n == jnp.round(n))
        head = encode_float32(z)
        if num_classes is None:
            body = encode_float32(labels)
            ok_labels = jnp.all(jnp.isfinite(labels))
        else:
            ok_labels = jnp.all((labels >= 0) & (labels < num_classes) & (labels == jnp.round(labels)))
            index = jnp.clip(jnp.round(labels), 0, num_classes - 1).astype(jnp.uint32)
            body = Message(pack_fixed(index, width), as_bits(width * k))
        count = Message(jnp.clip(n, 0, MAX_EXAMPLES).astype(jnp.uint32)[None], as_bits(32))
        valid = jnp.all(jnp.isfinite(z)) & ok_labels & ok_n
        return concat_messages(head, body, count), PseudocoresetInfo(valid, jnp.float32(jnp.nan))

    def decode(shared_key, p, message):
        del shared_key
        dim = _known_dim(p)
        if dim is None or (dim - k - 1) % k or dim < 2 * k + 1:
            raise ValueError(
                f"p must be a PointMass of length K·D + K + 1 (the receiver knows the shapes), got {dim}"
            )
        n_inputs = dim - k - 1
        expected = fixed_bits(dim)
        words, ok_len = received_words(message, -(-expected // 32))
        ok_parse = as_bits(message.num_bits) == expected
        z_msg, label_msg, count_msg = split_message(
            Message(words, as_bits(expected)), (32 * n_inputs, width * k)
        )
        z = decode_float32(Message(z_msg.payload[:n_inputs], z_msg.num_bits))
        if num_classes is None:
            labels = decode_float32(Message(label_msg.payload[:k], label_msg.num_bits))
            ok_labels = jnp.asarray(True)
        else:
            index = unpack_fixed(label_msg.payload, k, width).astype(jnp.int32)
            ok_labels = jnp.all(index < num_classes)
            labels = jnp.minimum(index, num_classes - 1).astype(jnp.float32)
        n = unpack_fixed(jnp.pad(count_msg.payload, (0, 1)), 1, 32)[0]
        ok_n = (n >= 1) & (n <= MAX_EXAMPLES)
        errors = failed_checks(length=ok_len, parse=ok_parse, input=ok_labels & ok_n)
        value = jnp.concatenate([z, labels, n.astype(jnp.float32)[None]])
        return value, StreamCheck(errors == 0, errors)

    name = "pseudocoreset" if num_classes is None else f"pseudocoreset{width}"
    return stateless_coder(
        encode,
        decode,
        uses_prior=False,
        name=name,
        capacity_words=capacity_words,
        deterministic=True,
        fixed_bits=fixed_bits,
    )
