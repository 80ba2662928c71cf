"""The counter-hash generator behind every importance-sampling candidate (KLMS, BICompFL, MRC).

A channel-simulation coder draws ``K`` candidates from the prior ``p`` on every coordinate, and the receiver
must regenerate the one that was chosen. Both ends therefore need the uniform ``u[k, j]`` behind candidate
``k`` at coordinate ``j`` as a pure function of the shared key and the two counters, readable at any
``(k, j)`` without generating the others (the decoder reads ``dim`` of them, not ``K x dim``). Until stream
format 1 this was one Threefry-2x32 block per coordinate pair: correct, but about 65 integer operations per
uniform, so the candidates cost more than everything else the coder does. Format 2 (this module) uses a
cheap hash built from a 32-bit mixing permutation:

.. math::

    \\mathrm{mix}(x) &= \\text{xorshift}_{16} \\circ (\\times \\mathtt{0x846ca68b})
        \\circ \\text{xorshift}_{15} \\circ (\\times \\mathtt{0x7feb352d}) \\circ \\text{xorshift}_{16}\\,(x)
        \\qquad (\\text{xorshift}_s(x) = x \\oplus (x \\gg s)) \\\\
    a_j &= \\mathrm{mix}(\\mathrm{mix}(j \\oplus w_0) + (w_1 \\oplus \\mathtt{0x7f4a7c15}))
        \\qquad \\text{(one per coordinate)} \\\\
    b_k &= \\mathrm{mix}(\\mathrm{mix}(k \\cdot \\mathtt{0x9e3779b9} \\oplus w_1)
        + (w_0 \\oplus \\mathtt{0x3c6ef372}))
        \\qquad \\text{(one per candidate)} \\\\
    h_{k,j} &= \\mathrm{mix}(\\mathrm{mix}(a_j \\oplus b_k) + b_k), \\qquad
    u_{k,j} = (\\lfloor h_{k,j} / 2^9 \\rfloor + \\tfrac12)\\, 2^{-23} \\in (0, 1)

with :math:`(w_0, w_1)` the two 32-bit words of the shared key (:func:`key_words`) and all arithmetic in
``uint32`` (wrapping). ``mix`` is a bijection of 32-bit words (xorshifts and odd multipliers are
invertible) with ``mix(0) = 0``, which the two constants keep away from the all-zero key; its two
multipliers are the "lowbias32" constants found by a published search for 32-bit
mixers with low avalanche bias (see docs/architecture.md#candidate-generator). Why this shape:

- **Cost.** ``a`` and ``b`` are computed once per coordinate and once per candidate; each of the ``K x d``
  uniforms costs one xor, two ``mix`` and one add, about 18 integer operations, against Threefry's ~65. In
  one process on this machine's CPU the ``K x d`` uniforms come 7.5-10x faster than the format-1 Threefry
  ones (experiments/bench/importance_coder.py, ``floor_counter`` vs ``floor_threefry``).
- **Portability.** Only ``uint32`` xor, shift, add and multiply, which every backend computes exactly, then
  an exact float32 conversion: the same key gives the same words and the same uniforms on CPU, GPU and
  TPU (``make gpu-check`` compares them bit for bit). ``rbg`` keys, whose streams differ by backend, are
  refused.
- **Rows without collisions.** For a fixed candidate ``k`` the map ``a_j -> h_{k,j}`` is a bijection and so
  is ``j -> a_j``: two coordinates of one candidate never share a word. The outer ``+ b_k`` breaks the
  symmetry of the xor, so the coincidence :math:`a_j \\oplus b_k = a_{j'} \\oplus b_{k'}` does not make
  ``h`` repeat in a rectangle ``(k, j), (k', j')``.
- **Blocks.** The block of a coordinate is a function of the coordinate (blocks partition ``[0, d)``), so
  a candidate's value does not depend on the partition or on how the encoder chunks its work, and the
  block needs no counter of its own; the shared key already separates clients, rounds and directions
  (:mod:`sidejax.keys`).

The statistical battery in ``tests/coding/test_counter.py`` checks (fixed keys, sample sizes stated
there): per-bit balance, a 1024-bin chi-square of the uniforms, lag-1 serial correlation along
coordinates and along candidates, correlation and 2-D chi-square between neighbouring candidates,
coordinates, blocks and keys (clients), and the strict avalanche criterion of each input bit of ``j``,
``k`` and the key; and a numpy oracle of the formula above, word for word. The coders' exact-law tests
(``tests/coding/test_importance*.py``, ``test_coders.py``) run on it unchanged.

Streams encoded with format 1 (Threefry candidates) decode to other samples under format 2, silently: the
index stream is the same shape. Format 3 moved CEPAM's lattice latents and dithers onto the same hash
(:func:`sidejax.keys.lattice_keys`): a format-2 lattice stream would decode with other dithers.
:data:`STREAM_FORMAT` is therefore written in every serialised message (:mod:`sidejax.coding.wire`) and
every checkpoint, and both refuse another format by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sidejax.distributions import bits_to_open_uniform

__all__ = [
    "STREAM_FORMAT",
    "STREAM_FORMATS",
    "mix32",
    "key_words",
    "coordinate_seeds",
    "candidate_seeds",
    "combine",
    "counter_words",
    "counter_uniforms",
    "grid_uniforms",
]

#: The stream format this sidejax writes and reads: 3 = counter-hash candidates (this module) and
#: counter-hash lattice latents and dithers (CEPAM, :mod:`sidejax.coding.lrsuq`).
STREAM_FORMAT = 3
#: Every stream format there has been, and how its shared randomness was generated.
STREAM_FORMATS = {
    1: "Threefry-2x32 candidates (sidejax before the counter hash); not decodable by this version",
    2: "counter-hash candidates with Threefry lattice dithers (CEPAM differs); not decodable by this version",
    3: "counter-hash candidates, lattice latents and dithers (sidejax.coding.counter)",
}

_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_GOLDEN = 0x9E3779B9
_C_COORDINATE = 0x7F4A7C15
_C_CANDIDATE = 0x3C6EF372


def mix32(x: jax.Array) -> jax.Array:
    """The 32-bit mixing permutation ``mix`` of the module docstring (``uint32`` in, ``uint32`` out)."""
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(_M1)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(_M2)
    return x ^ (x >> 16)


def key_words(key) -> tuple[jax.Array, jax.Array]:
    """The two ``uint32`` words ``(w0, w1)`` of a Threefry-2x32 key (typed, as :mod:`sidejax.keys` makes
    them, or raw ``uint32[2]`` key data).

    Raises ``ValueError`` for a key of another implementation (e.g. ``rbg``, whose random bits differ by
    backend, so a client and a server on different backends would not regenerate the same candidates).
    """
    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl = str(jax.random.key_impl(key))
        data = jax.random.key_data(key)
    else:
        impl, data = "raw key data", jnp.asarray(key)
    if data.shape != (2,) or "rbg" in impl:
        raise ValueError(
            f"shared_key must be one Threefry-2x32 key (2 words of key data), got {impl} with key data of "
            f"shape {data.shape}: the candidate generator needs a key whose bits are the same on every "
            f"backend; make keys with jax.random.key(seed) under the default jax_default_prng_impl, or with "
            f"sidejax.keys"
        )
    data = data.astype(jnp.uint32)
    return data[0], data[1]


def coordinate_seeds(words, cols: jax.Array) -> jax.Array:
    """``a_j`` of the module docstring for the coordinates ``cols`` (any integer array)."""
    w0, w1 = words
    return mix32(mix32(cols.astype(jnp.uint32) ^ w0) + (w1 ^ jnp.uint32(_C_COORDINATE)))


def candidate_seeds(words, rows: jax.Array) -> jax.Array:
    """``b_k`` of the module docstring for the candidates ``rows`` (any integer array)."""
    w0, w1 = words
    spread = rows.astype(jnp.uint32) * jnp.uint32(_GOLDEN)
    return mix32(mix32(spread ^ w1) + (w0 ^ jnp.uint32(_C_CANDIDATE)))


def combine(a: jax.Array, b: jax.Array) -> jax.Array:
    """``h = mix(mix(a ^ b) + b)``, elementwise over broadcast coordinate seeds ``a`` and candidate seeds
    ``b``: the word behind one candidate value."""
    return mix32(mix32(a ^ b) + b)


def counter_words(key, rows: jax.Array, cols: jax.Array) -> jax.Array:
    """The words ``h[rows[i], cols[i]]`` (``uint32``), elementwise over broadcast ``rows`` and ``cols``."""
    words = key_words(key)
    return combine(coordinate_seeds(words, jnp.asarray(cols)), candidate_seeds(words, jnp.asarray(rows)))


def counter_uniforms(key, rows: jax.Array, cols: jax.Array) -> jax.Array:
    """The uniforms ``u[rows[i], cols[i]]`` in (0, 1) (float32), elementwise over broadcast ``rows`` and
    ``cols``: what the decoder reads, one per coordinate."""
    return bits_to_open_uniform(counter_words(key, rows, cols))


def grid_uniforms(key, num_rows: int, col_start, num_cols: int) -> jax.Array:
    """All ``[num_rows, num_cols]`` uniforms of candidates ``0..num_rows-1`` at coordinates
    ``col_start .. col_start + num_cols - 1`` (``col_start`` may be traced): what the encoder reads, one
    coordinate chunk at a time, with the per-row and per-column seeds computed once."""
    words = key_words(key)
    a = coordinate_seeds(words, jnp.asarray(col_start, jnp.uint32) + jnp.arange(num_cols, dtype=jnp.uint32))
    b = candidate_seeds(words, jnp.arange(num_rows, dtype=jnp.uint32))
    return bits_to_open_uniform(combine(a[None, :], b[:, None]))
