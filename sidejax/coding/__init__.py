"""Coders: every message a client or the server sends is built here, with its real length in bits."""

from sidejax.coding.base import Message, decode_float32, encode_float32
from sidejax.coding.bitstream import (
    check_stream,
    crc32_words,
    mask_to_length,
    num_words,
    pack_fixed,
    sent_words,
    trim_payload,
    unpack_fixed,
)
from sidejax.coding.importance import (
    ImportanceInfo,
    candidate_uniforms,
    candidate_values,
    candidates,
    choose_chunk_size,
    decode_indices,
    encode_indices,
    importance_decode,
    importance_encode,
)

__all__ = [
    "Message",
    "encode_float32",
    "decode_float32",
    "check_stream",
    "num_words",
    "sent_words",
    "mask_to_length",
    "trim_payload",
    "crc32_words",
    "pack_fixed",
    "unpack_fixed",
    "ImportanceInfo",
    "candidate_uniforms",
    "candidate_values",
    "candidates",
    "choose_chunk_size",
    "decode_indices",
    "encode_indices",
    "importance_decode",
    "importance_encode",
]
