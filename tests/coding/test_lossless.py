"""Variable-length lossless streams: the codeword writer/reader, Elias-gamma and Golomb codes, the chain walk,
QSGD's Elias stream of levels and the Golomb mask stream.

References are numpy/Python bit strings built codeword by codeword; every round trip is checked bit for bit.
Shapes are shared across tests so that each jitted function compiles once per static configuration.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.bits import enumerative_mask_bits
from sidejax.coding import bitstream as bs
from sidejax.coding.lossless import (
    elias_levels_capacity_words,
    elias_levels_decode,
    elias_levels_encode,
    elias_levels_length,
    mask_capacity_words,
    mask_code_length,
    mask_decode,
    mask_encode,
    mask_header_bits,
    optimal_golomb_parameter,
)

# ----------------------------------------------------------------------------------------------------
# Python references


def stream_string(words) -> str:
    """The stream bits of a word buffer as a '0'/'1' string (bit p = bit p % 32 of word p // 32)."""
    w = np.ascontiguousarray(np.asarray(words, np.uint32)).astype("<u4")
    return "".join(map(str, np.unpackbits(w.view(np.uint8), bitorder="little")))


def words_from_string(bits: str, capacity: int) -> np.ndarray:
    arr = np.zeros(32 * capacity, np.uint8)
    arr[: len(bits)] = np.frombuffer(bits.encode(), np.uint8) - ord("0")
    return np.packbits(arr, bitorder="little").view("<u4").astype(np.uint32)


def binary(x: int, width: int) -> str:
    return format(x, f"0{width}b") if width > 0 else ""


def eg_string(n: int) -> str:
    return "0" * (n.bit_length() - 1) + format(n, "b")


def golomb_string(n: int, m: int) -> str:
    q, r = divmod(n, m)
    b = (m - 1).bit_length()
    u = (1 << b) - m
    return "0" * q + "1" + (binary(r, b - 1) if r < u else binary(r + u, b))


def qsgd_string(levels) -> str:
    out, prev = [], -1
    for i in np.flatnonzero(levels):
        lv = int(levels[i])
        out += [eg_string(int(i) - prev), "1" if lv < 0 else "0", eg_string(abs(lv))]
        prev = int(i)
    return "".join(out)


def qsgd_symbol_ends(levels) -> list[int]:
    ends, total, prev = [], 0, -1
    for i in np.flatnonzero(levels):
        total += len(eg_string(int(i) - prev)) + 1 + len(eg_string(abs(int(levels[i]))))
        ends.append(total)
        prev = int(i)
    return ends


def golomb_m(k: int, d: int) -> int:
    if k == 0:
        return 1
    p = k / d
    return int(min(max(np.ceil(np.log(2 - p) / -np.log1p(-p)), 1), d))


def mask_string(mask, flag: int, m: int) -> str:
    d = len(mask)
    coded = np.asarray(mask, bool) ^ bool(flag)
    out, prev = [str(flag), binary(m, d.bit_length())], -1
    for i in np.flatnonzero(coded):
        out.append(golomb_string(int(i) - prev - 1, m))
        prev = int(i)
    return "".join(out)


# ----------------------------------------------------------------------------------------------------
# bit writer and reader


@functools.partial(jax.jit, static_argnames=("cap", "split", "offset"))
def _writer(values, lengths, cap, split, offset):
    """One program for the writer tests: a single write, two writes chained through ``out``, the 2-D row
    form, and the low (up to 32) bits of every codeword read back."""
    words, end = bs.write_codewords(values, lengths, capacity_words=cap, bit_offset=offset)
    first, mid = bs.write_codewords(values[:split], lengths[:split], capacity_words=cap, bit_offset=offset)
    both, end2 = bs.write_codewords(
        values[split:], lengths[split:], capacity_words=cap, bit_offset=mid, out=first
    )
    rows, end3 = bs.write_codewords(
        values.reshape(-1, 3), lengths.reshape(-1, 3), capacity_words=cap, bit_offset=offset
    )
    low = jnp.minimum(lengths, 32)
    starts = offset + jnp.cumsum(lengths) - lengths
    back = bs.read_bits(words, starts + lengths - low, low)
    past = bs.read_bits(words, jnp.array([32 * cap + 5, 32 * cap - 3]), 32)
    return words, end, both, end2, rows, end3, back, past


def test_write_read_codewords_match_reference():
    rng = np.random.default_rng(0)
    n = 300
    lengths = rng.integers(0, 41, n).astype(np.int32)
    lengths[:6] = [0, 1, 31, 32, 33, 40]
    values = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    offset = 13
    ref = "".join(
        binary(v & ((1 << min(L, 32)) - 1), min(L, 32)).rjust(L, "0") if L else ""
        for v, L in zip(values.tolist(), lengths.tolist(), strict=True)
    )
    cap = -(-(offset + len(ref)) // 32) + 1
    words, end, both, end2, rows, end3, back, past = _writer(values, lengths, cap, 100, offset)
    assert int(end) == int(end2) == int(end3) == offset + len(ref)
    assert stream_string(words) == "0" * offset + ref + "0" * (32 * cap - offset - len(ref))
    np.testing.assert_array_equal(np.asarray(both), np.asarray(words))
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(words))
    low = np.minimum(lengths, 32).astype(np.uint64)
    want = (values.astype(np.uint64) & ((np.uint64(1) << low) - np.uint64(1))).astype(np.uint32)
    np.testing.assert_array_equal(np.asarray(back), want)
    np.testing.assert_array_equal(np.asarray(past), [0, 0])  # bits past the buffer read as 0


def test_next_one_bit_matches_reference():
    rng = np.random.default_rng(1)
    bits = "".join(rng.choice(["0" * int(z) + "1" for z in rng.integers(0, 200, 40)]))
    words = words_from_string(bits, -(-len(bits) // 32) + 2)
    cap = 32 * len(words)
    got = np.asarray(jax.jit(bs.next_one_bit)(words, jnp.arange(cap)))
    padded = bits.ljust(cap, "0")
    want = [padded.find("1", p) if padded.find("1", p) >= 0 else cap for p in range(cap)]
    np.testing.assert_array_equal(got, want)


@functools.partial(jax.jit, static_argnames="cap")
def _elias_gamma(ns, cap):
    value, length = bs.elias_gamma_codeword(ns)
    words, end = bs.write_codewords(value, length, capacity_words=cap)
    starts = jnp.concatenate([jnp.cumsum(length) - length, jnp.stack([end, 32 * cap - 1])])
    return length, bs.elias_gamma_length(ns), words, end, bs.elias_gamma_decode(words, starts)


def test_elias_gamma_codewords_match_reference():
    ns = np.array(list(range(1, 41)) + [255, 256, 2**31 - 1, 2**31, 2**32 - 1], np.uint64).astype(np.uint32)
    ref = [eg_string(int(n)) for n in ns]
    assert ref[:5] == ["1", "010", "011", "00100", "00101"]
    cap = -(-sum(map(len, ref)) // 32) + 2
    length, length2, words, end, (n, ln, ok) = _elias_gamma(ns, cap)
    np.testing.assert_array_equal(np.asarray(length), [len(s) for s in ref])
    np.testing.assert_array_equal(np.asarray(length2), 2 * np.floor(np.log2(ns.astype(np.float64))) + 1)
    assert stream_string(words)[: int(end)] == "".join(ref)
    np.testing.assert_array_equal(np.asarray(n[:-2]), ns)
    np.testing.assert_array_equal(np.asarray(ln[:-2]), [len(s) for s in ref])
    assert bool(jnp.all(ok[:-2]))
    # 32 zeros (the empty tail) are not a codeword of a uint32
    assert not bool(jnp.any(ok[-2:])) and bool(jnp.all(ln[-2:] == bs.INVALID_LENGTH))


GOLOMB_N = np.concatenate([np.arange(61), np.random.default_rng(2).integers(0, 3000, 39)]).astype(np.int32)
GOLOMB_CAP = 5000  # words: fits sum(n) + 100 bits for m = 1


@jax.jit
def _golomb_roundtrip(n, m):
    value, length = bs.golomb_codeword(n, m)
    words, end = bs.write_codewords(value, length, capacity_words=GOLOMB_CAP)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(length)[:-1]])
    decoded, dec_len, valid = bs.golomb_decode(words, starts, m)
    return words, end, length, bs.golomb_length(n, m), decoded, dec_len, valid


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 16, 17, 31, 32, 33, 100, 1000, 2**20 + 3])
def test_golomb_roundtrip_matches_reference(m):
    words, end, length, length2, decoded, dec_len, valid = _golomb_roundtrip(GOLOMB_N, jnp.int32(m))
    ref = [golomb_string(int(n), m) for n in GOLOMB_N]
    np.testing.assert_array_equal(np.asarray(length), [len(s) for s in ref])
    np.testing.assert_array_equal(np.asarray(length2), np.asarray(length))
    assert int(end) == sum(map(len, ref))
    assert stream_string(words)[: int(end)] == "".join(ref)
    assert not stream_string(words)[int(end) :].count("1")
    np.testing.assert_array_equal(np.asarray(decoded), GOLOMB_N)
    np.testing.assert_array_equal(np.asarray(dec_len), np.asarray(length))
    assert bool(jnp.all(valid))


def test_golomb_decode_without_terminator_is_invalid():
    words = jnp.zeros(4, jnp.uint32).at[0].set(1)  # stream bit 0 set, then 127 zeros
    n, ln, ok = jax.jit(bs.golomb_decode)(words, jnp.array([0, 1, 100]), jnp.int32(3))
    np.testing.assert_array_equal(np.asarray(ok), [True, False, False])
    assert int(ln[1]) == bs.INVALID_LENGTH and int(n[1]) == 0


# ----------------------------------------------------------------------------------------------------
# the chain of codeword starts


CHAIN_LENS = [3, 2, 5, 1, 1, 4, 2, 2, 7, 1, 3]
CHAIN_STARTS = [0, 3, 5, 10, 11, 12, 16, 18, 20, 27, 28]


@pytest.mark.parametrize("method", ["walk", "jump"])
def test_chain_walk_results_and_malformed_input(method):
    table = jnp.ones(40, jnp.int32).at[jnp.array(CHAIN_STARTS)].set(jnp.array(CHAIN_LENS))
    starts_fn = jax.jit(functools.partial(bs.codeword_starts, max_symbols=10, method=method))
    starts, count, ok = starts_fn(table, 20)
    assert bool(ok) and int(count) == 8
    np.testing.assert_array_equal(np.asarray(starts), CHAIN_STARTS[:8] + [0, 0])
    assert bool(starts_fn(table, 0)[2])  # empty stream
    assert not bool(starts_fn(table, 19)[2])  # the last codeword overruns num_bits
    assert bool(starts_fn(table, 28)[2])  # exactly max_symbols = 10 codewords
    assert not bool(starts_fn(table, 31)[2])  # 11 codewords: more than allowed
    assert not bool(starts_fn(table, 41)[2])  # past the table
    assert not bool(starts_fn(table, -3)[2])
    # zero lengths (no progress) and invalid codewords end the walk with ok=False
    assert not bool(starts_fn(jnp.zeros(40, jnp.int32), 20)[2])
    assert not bool(starts_fn(table.at[5].set(bs.INVALID_LENGTH), 20)[2])


def test_chain_methods_agree_under_vmap():
    rng = np.random.default_rng(3)
    tables = rng.integers(1, 6, (16, 200)).astype(np.int32)
    tables[rng.random((16, 200)) < 0.01] = bs.INVALID_LENGTH
    ends = rng.integers(0, 200, 16)
    out = {
        method: jax.jit(jax.vmap(functools.partial(bs.codeword_starts, max_symbols=60, method=method)))(
            tables, ends
        )
        for method in ("walk", "jump")
    }
    (sw, cw, okw), (sj, cj, okj) = out["walk"], out["jump"]
    np.testing.assert_array_equal(np.asarray(okw), np.asarray(okj))
    assert 0 < int(okw.sum()) < 16  # both outcomes occur
    for b in np.flatnonzero(np.asarray(okw)):
        # reference: follow the chain in Python
        pos, ref = 0, []
        while pos < ends[b]:
            ref.append(pos)
            pos += int(tables[b, pos])
        assert int(cw[b]) == int(cj[b]) == len(ref)
        np.testing.assert_array_equal(np.asarray(sw[b, : len(ref)]), ref)
        np.testing.assert_array_equal(np.asarray(sj[b]), np.asarray(sw[b]))


def _golomb_length_at(operands, pos):
    view, m = operands
    return bs.golomb_decode_at(view, pos, m)[1]


def test_walk_symbols_is_the_walk_on_the_table_of_every_position():
    """walk_symbols computes each length where the walk reaches it; it returns walk_codewords' result on
    the table of every position (random streams of Golomb codewords, some ending inside a codeword or past
    the buffer), unbatched and under vmap; the readers at given positions equal those at every position."""
    rng = np.random.default_rng(5)
    streams = rng.integers(0, 2**32, (12, 6), dtype=np.uint64).astype(np.uint32)
    streams[:4] &= np.uint32(0x11111111)  # long runs of zeros
    ends = np.concatenate([rng.integers(0, 192, 10), [192, 250]]).astype(np.int32)
    m = jnp.int32(3)

    def both(words, end):
        view = bs.stream_view(words)
        walked = bs.walk_symbols(_golomb_length_at, (view, m), end, max_symbols=40, bit_capacity=192, start=1)
        tabled = bs.walk_codewords(bs.golomb_decode(words, None, m)[1], end, max_symbols=40, start=1)
        pos = jnp.arange(192)
        at = bs.golomb_decode_at(view, pos, m), bs.elias_gamma_decode_at(view, pos)
        return walked, tabled, at, (bs.golomb_decode(words, None, m), bs.elias_gamma_decode(words))

    batched = jax.jit(jax.vmap(both))(jnp.asarray(streams), jnp.asarray(ends))
    single = jax.jit(both)(jnp.asarray(streams[0]), jnp.asarray(ends[0]))
    for walked, tabled, at, every in (batched, single):
        for x, y in zip(jax.tree.leaves((walked, at)), jax.tree.leaves((tabled, every)), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert 0 < int(np.sum(np.asarray(batched[0][2]))) < len(ends)  # both outcomes of ok occur


def _golomb_symbol_at(operands, pos):
    view, m = operands
    value, length, _ = bs.golomb_decode_at(view, pos, m)
    return length, (value, pos)


def test_walk_symbol_fields_keeps_what_each_symbol_read():
    """walk_symbol_fields returns walk_symbols' starts, count and ok, and for symbol i the fields read at
    its start (zero past the count), unbatched and under vmap."""
    rng = np.random.default_rng(6)
    streams = rng.integers(0, 2**32, (8, 6), dtype=np.uint64).astype(np.uint32)
    streams[:3] &= np.uint32(0x01010101)
    ends = np.concatenate([rng.integers(0, 192, 7), [192]]).astype(np.int32)
    m = jnp.int32(5)

    def both(words, end):
        view = bs.stream_view(words)
        fields = bs.walk_symbol_fields(_golomb_symbol_at, (view, m), end, max_symbols=40, bit_capacity=192)
        plain = bs.walk_symbols(_golomb_length_at, (view, m), end, max_symbols=40, bit_capacity=192)
        return fields, plain, bs.golomb_decode_at(view, plain[0], m)[0]

    for words, end in ((streams, ends), (streams[0], ends[0])):
        f = jax.jit(jax.vmap(both)) if words.ndim == 2 else jax.jit(both)
        (starts, count, ok, (values, at)), plain, want = f(jnp.asarray(words), jnp.asarray(end))
        for x, y in zip((starts, count, ok), plain, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        live = np.arange(40) < np.asarray(count)[..., None]
        np.testing.assert_array_equal(
            np.where(live, np.asarray(values), 0), np.where(live, np.asarray(want), 0)
        )
        np.testing.assert_array_equal(np.asarray(at), np.where(live, np.asarray(starts), 0))
        assert np.all(np.asarray(values)[~live] == 0)


def test_set_bit_positions_match_numpy():
    """The first `count` ones at or after `start` (the ends of unary codewords), against numpy's
    flatnonzero of the unpacked bits; `found` is False when the stream has fewer ones (both occur)."""
    rng = np.random.default_rng(7)
    fns = {c: jax.jit(lambda w, s, c=c: bs.set_bit_positions(bs.stream_view(w), s, c)) for c in (1, 7, 120)}
    outcomes = set()
    for density in (0.02, 0.3, 0.9):
        bits = (rng.random(9 * 32) < density).astype(np.uint32)
        packed = bs.pack_fixed(jnp.asarray(bits), 1)  # stream bit i is field i
        for start in (0, 1, 31, 32, 77, 200):
            ones = np.flatnonzero(bits[start:]) + start
            for count, f in fns.items():
                pos, found = f(packed, start)
                k = min(count, len(ones))
                np.testing.assert_array_equal(np.asarray(pos)[:k], ones[:k])
                assert np.all(np.asarray(pos)[k:] == 32 * packed.shape[0])
                assert bool(found) == (count <= len(ones))
                outcomes.add(bool(found))
    assert outcomes == {True, False}


def test_prefix_sum_and_bounded_golomb_are_the_plain_ones():
    """prefix_sum equals jnp.cumsum (int32 and bool, 1-D and along axis 1); golomb_codeword with a static
    bound (float quotient, exact correction) equals the integer division for every n below the bound,
    including the largest n near 2^24 and quotients just below and above integers."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.integers(-1000, 1000, (50, 7)), jnp.int32)
    np.testing.assert_array_equal(bs.prefix_sum(x, axis=1), jnp.cumsum(x, axis=1))
    np.testing.assert_array_equal(bs.prefix_sum(x.reshape(-1)), jnp.cumsum(x.reshape(-1)))
    b = jnp.asarray(rng.random(1000) < 0.3)
    np.testing.assert_array_equal(bs.prefix_sum(b), jnp.cumsum(b, dtype=jnp.int32))
    bound = 2**24
    fast_codeword = jax.jit(lambda n, m: bs.golomb_codeword(n, m, bound=bound))
    plain_codeword = jax.jit(bs.golomb_codeword)
    for m in (1, 2, 3, 7, 33, 1000, 65_537, 2**23 + 1, bound - 1):
        q = rng.integers(0, bound // m, 2000)
        n = np.clip(
            np.concatenate([q * m, q * m - 1, q * m + m - 1, rng.integers(0, bound, 2000)]), 0, bound - 1
        )
        n = jnp.asarray(n, jnp.uint32)
        fast, plain = fast_codeword(n, jnp.int32(m)), plain_codeword(n, jnp.int32(m))
        for a, c in zip(fast, plain, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


# ----------------------------------------------------------------------------------------------------
# QSGD Elias stream

D = 300


@functools.partial(jax.jit, static_argnames=("max_level",))
def _qsgd_encode(levels, max_level):
    return jax.vmap(functools.partial(elias_levels_encode, max_level=max_level))(levels) + (
        jax.vmap(elias_levels_length)(levels),
    )


@functools.partial(jax.jit, static_argnames=("max_level", "method"))
def _qsgd_decode_batch(words, num_bits, max_level, method):
    return jax.vmap(functools.partial(elias_levels_decode, dim=D, max_level=max_level, method=method))(
        words, num_bits
    )


def chunked(decode, words, num_bits, batch, *static):
    """Runs a vmapped decoder over any number of streams in chunks of ``batch`` (padded with copies of the
    first stream), so that every call reuses one compiled program."""
    words, num_bits = np.asarray(words), np.asarray(num_bits, np.float32)
    n = len(words)
    pad = -n % batch
    words = np.concatenate([words, np.repeat(words[:1], pad, 0)])
    num_bits = np.concatenate([num_bits, np.repeat(num_bits[:1], pad)])
    outs = [decode(words[i : i + batch], num_bits[i : i + batch], *static) for i in range(0, n + pad, batch)]
    return tuple(np.concatenate([np.asarray(o[k]) for o in outs])[:n] for k in range(len(outs[0])))


def _qsgd_decode(words, num_bits, max_level, method):
    return chunked(_qsgd_decode_batch, words, num_bits, 8, max_level, method)


def _closed_form_bits(levels: np.ndarray) -> int:
    """QSGD Elias length in closed form: per nonzero 2 floor(log2 gap) + 2 + 2 floor(log2 |level|) + 1."""
    pos = np.flatnonzero(levels)
    gaps = np.diff(np.concatenate([[-1], pos]))
    mags = np.abs(levels[pos]).astype(np.int64)
    eg = lambda n: 2 * np.floor(np.log2(n)).astype(np.int64) + 1  # noqa: E731
    return int(np.sum(eg(gaps) + 1 + eg(mags)))


def qsgd_cases(s: int) -> np.ndarray:
    rng = np.random.default_rng(s)
    signs = rng.choice([-1, 1], D)
    cases = [
        np.zeros(D),
        s * signs,  # the worst case: every coordinate at the top level
        signs * rng.integers(1, s + 1, D),  # dense
        (rng.random(D) < 0.03) * signs * rng.integers(1, s + 1, D),  # sparse
        np.eye(D)[-1] * -s,  # one nonzero at the last coordinate: the longest gap
        np.eye(D)[0] * s,
        (np.arange(D) % 7 == 3) * signs,
        (rng.random(D) < 0.5) * signs * rng.integers(0, s + 1, D),
    ]
    return np.stack(cases).astype(np.int32)


@pytest.mark.parametrize("s", [1, 6, 2**20])
def test_qsgd_levels_roundtrip_bit_exact(s):
    levels = qsgd_cases(s)
    words, num_bits, length = _qsgd_encode(levels, s)
    cap = elias_levels_capacity_words(D, s)
    assert words.shape == (len(levels), cap)
    for i, lv in enumerate(levels):
        ref = qsgd_string(lv)
        assert float(num_bits[i]) == float(length[i]) == len(ref)
        assert stream_string(words[i]) == ref.ljust(32 * cap, "0")
        assert _closed_form_bits(lv) == len(ref)
    # the capacity is the worst case exactly for s = 1 (3 bits per coordinate) and bounds it otherwise
    assert float(num_bits[1]) <= 32 * cap
    if s == 1:
        assert float(num_bits[1]) == 3 * D and cap == -(-3 * D // 32)
    for method in ("walk", "jump") if s == 6 else ("walk",):  # jump: one level bound, fewer compilations
        decoded, ok = _qsgd_decode(words, num_bits, s, method)
        assert ok.all()
        np.testing.assert_array_equal(decoded, levels)


def test_qsgd_jit_matches_vmap_and_trimmed_payload():
    all_levels = qsgd_cases(1)
    words, num_bits, _ = _qsgd_encode(all_levels, 1)  # vmapped over the 8 cases
    one_dec = jax.jit(functools.partial(elias_levels_decode, dim=D, max_level=1))

    @jax.jit
    def one(levels):  # unbatched encode and decode
        w, nb = elias_levels_encode(levels, max_level=1)
        return (w, nb) + elias_levels_decode(w, nb, dim=D, max_level=1)

    for i in (2, 3, 6):  # three different vectors
        w, nb, decoded, ok = one(all_levels[i])
        np.testing.assert_array_equal(np.asarray(w), np.asarray(words[i]))
        assert float(nb) == float(num_bits[i]) and bool(ok)
        np.testing.assert_array_equal(np.asarray(decoded), all_levels[i])
    # the receiver decodes from the ceil(num_bits / 32) words actually sent
    sent = bs.trim_payload(words[3], num_bits[3])  # the sparse vector
    decoded, ok = one_dec(sent, num_bits[3])
    assert bool(ok) and sent.shape[0] < words.shape[1]
    np.testing.assert_array_equal(np.asarray(decoded), all_levels[3])


@pytest.mark.parametrize("method", ["walk", "jump"])
def test_qsgd_corrupted_streams(method):
    """Detected: truncation inside a symbol, set bits past num_bits, bad num_bits, invalid codes. A cut at a
    symbol boundary or a flip that still parses is not detectable; then the stream decodes to the levels
    that re-encode to exactly the received bits."""
    lv = qsgd_cases(6)[3]
    words, num_bits, _ = _qsgd_encode(qsgd_cases(6), 6)
    words, nb = np.asarray(words[3]), int(num_bits[3])
    cap = words.shape[0]
    ref = qsgd_string(lv)
    ends = qsgd_symbol_ends(lv)
    streams, lengths = [], []
    cuts = list(range(0, nb + 1))
    for cut in cuts:  # truncated payloads: the receiver holds the first `cut` bits only
        streams.append(words_from_string(ref[:cut], cap))
        lengths.append(cut)
    rng = np.random.default_rng(4)
    flips = rng.choice(nb, 48, replace=False)
    for f in flips:
        streams.append(words_from_string(ref[:f] + str(1 - int(ref[f])) + ref[f + 1 :], cap))
        lengths.append(nb)
    # a flipped sign bit always parses: the level changes sign
    first = int(np.flatnonzero(lv)[0])
    sign_at = len(eg_string(first + 1))
    streams.append(words_from_string(ref[:sign_at] + str(1 - int(ref[sign_at])) + ref[sign_at + 1 :], cap))
    lengths.append(nb)
    streams += [words] * 6
    lengths += [nb - 1, nb + 1, -1, 32 * cap + 1, nb + 0.5, float("nan")]  # intact buffer, wrong length
    decoded, ok = _qsgd_decode(np.stack(streams), lengths, 6, method)
    assert not np.any(decoded[~ok])  # rejected streams decode to zeros
    for j, cut in enumerate(cuts):  # accepted exactly at the symbol boundaries: a prefix of the symbols
        assert ok[j] == (cut == 0 or cut in ends)
        if ok[j]:
            keep = np.flatnonzero(lv)[: (ends.index(cut) + 1 if cut else 0)]
            np.testing.assert_array_equal(decoded[j], np.where(np.isin(np.arange(D), keep), lv, 0))
    for j in range(len(cuts), len(cuts) + len(flips)):
        if ok[j]:
            assert qsgd_string(decoded[j]) == stream_string(streams[j])[:nb]
    assert 0 < ok[len(cuts) : len(cuts) + len(flips)].sum() < len(flips)  # about half parse (57 of 123 flips)
    assert not ok[-6:].any()
    assert (
        ok[-7]
        and decoded[-7, first] == -lv[first]
        and np.array_equal(np.delete(decoded[-7], first), np.delete(lv, first))
    )


def test_qsgd_garbage_never_hangs():
    rng = np.random.default_rng(5)
    cap = elias_levels_capacity_words(D, 1)
    words = rng.integers(0, 2**32, (8, cap), dtype=np.uint64).astype(np.uint32)
    words[4:] &= np.uint32(0x01010101)  # sparse ones: long zero runs
    decoded, ok = _qsgd_decode(words, np.full(8, 32.0 * cap), 1, "walk")
    assert not ok.any() and not decoded.any()


def test_qsgd_validation():
    with pytest.raises(ValueError, match="max_level"):
        elias_levels_encode(jnp.zeros(4, jnp.int32), max_level=0)
    with pytest.raises(ValueError, match="levels must lie"):
        elias_levels_encode(jnp.array([0, 3, -4], jnp.int32), max_level=3)
    with pytest.raises(ValueError, match="levels must be a 1-D integer"):
        elias_levels_encode(jnp.zeros(4), max_level=1)
    with pytest.raises(ValueError, match="exceeds"):
        elias_levels_capacity_words(100_000_000, 1)
    with pytest.raises(ValueError, match="words must be"):
        elias_levels_decode(jnp.zeros((2, 3), jnp.uint32), 0, dim=4, max_level=1)
    with pytest.raises(ValueError, match="dim"):
        elias_levels_decode(jnp.zeros(3, jnp.uint32), 0, dim=0, max_level=1)


# ----------------------------------------------------------------------------------------------------
# mask stream

DM = 1000


@jax.jit
def _mask_encode(masks):
    return jax.vmap(mask_encode)(masks) + (jax.vmap(mask_code_length)(masks),)


@functools.partial(jax.jit, static_argnames=("method",))
def _mask_decode_batch(words, num_bits, method):
    return jax.vmap(functools.partial(mask_decode, dim=DM, method=method))(words, num_bits)


def _mask_decode(words, num_bits, method):
    return chunked(_mask_decode_batch, words, num_bits, len(mask_cases()), method)


def mask_cases() -> np.ndarray:
    rng = np.random.default_rng(6)
    cases = [rng.random(DM) < p for p in (0.0, 0.001, 0.01, 0.1, 0.3, 0.7, 0.99, 1.0)]
    half = np.zeros(DM, bool)
    half[rng.choice(DM, DM // 2, replace=False)] = True  # exactly half: the ones are coded
    above = half.copy()
    above[np.flatnonzero(~half)[0]] = True  # one more: the zeros are coded
    tail = np.arange(DM) >= DM - 300  # the longest first gap
    cases += [half, above, tail, ~tail, np.arange(DM) % 2 == 1, np.eye(DM, dtype=bool)[-1]]
    return np.stack(cases).astype(np.float32)


def test_mask_roundtrip_bit_exact():
    masks = mask_cases()
    words, num_bits, length = _mask_encode(masks)
    cap = mask_capacity_words(DM)
    assert words.shape == (len(masks), cap)
    width = DM.bit_length()
    for i, mk in enumerate(masks):
        ones = int(mk.sum())
        flag = int(2 * ones > DM)
        m = golomb_m(min(ones, DM - ones), DM)
        s = stream_string(words[i])
        assert s[0] == str(flag) and int(s[1 : 1 + width], 2) == m
        ref = mask_string(mk, flag, m)
        assert float(num_bits[i]) == float(length[i]) == len(ref) <= 32 * cap
        assert s == ref.ljust(32 * cap, "0")
    for method in ("walk", "jump"):
        decoded, ok = _mask_decode(words, num_bits, method)
        assert ok.all() and decoded.dtype == np.float32
        np.testing.assert_array_equal(decoded, masks)


def test_mask_tiny_dims_exhaustive():
    for d in (1, 3):  # no symbols at all (max d // 2 = 0), and odd
        masks = ((np.arange(2**d)[:, None] >> np.arange(d)) & 1).astype(np.float32)
        roundtrip = jax.jit(
            jax.vmap(lambda m, d=d: (lambda w, nb: (nb,) + mask_decode(w, nb, dim=d))(*mask_encode(m)))
        )
        num_bits, decoded, ok = roundtrip(masks)
        assert bool(jnp.all(ok))
        np.testing.assert_array_equal(np.asarray(decoded), masks)
        assert np.all(np.asarray(num_bits) >= mask_header_bits(d))


def test_mask_length_close_to_enumerative_code():
    """Bernoulli masks at d = 61706: within 1% of the ideal two-part enumerative code (measured 0.01-0.9%)."""
    d = 61706
    rng = np.random.default_rng(7)
    masks = jnp.asarray(np.stack([rng.random(d) < p for p in (0.01, 0.1, 0.3, 0.5, 0.7, 0.99)]), jnp.float32)
    length, ideal = jax.jit(jax.vmap(lambda m: (mask_code_length(m), enumerative_mask_bits(m))))(masks)
    ratio = np.asarray(length) / np.asarray(ideal)
    assert np.all(ratio >= 1.0) and np.all(ratio < 1.01), ratio


def test_optimal_golomb_parameter_matches_float64():
    d = 61706
    ks = np.arange(0, d // 2 + 1, 97)
    got = np.asarray(jax.jit(jax.vmap(lambda k: optimal_golomb_parameter(k, d)))(ks))
    np.testing.assert_array_equal(got, [golomb_m(int(k), d) for k in ks])


@pytest.mark.parametrize("method", ["walk", "jump"])
def test_mask_corrupted_streams(method):
    """Detected: truncation inside a codeword, set bits past num_bits, bad num_bits, header parameter outside
    [1, d], too many coded positions, a position past d. Undetectable: cuts at codeword boundaries and
    nearly every bit flip (the Golomb code is complete, so almost any bit string parses; here all 48 flips
    do); an accepted stream is then exactly the stream of the decoded mask with the received flag and
    parameter."""
    mk = mask_cases()[3]  # density 0.1
    words, num_bits, _ = _mask_encode(mask_cases())
    words, nb = np.asarray(words[3]), int(num_bits[3])
    cap = words.shape[0]
    ref = stream_string(words)[:nb]
    width = DM.bit_length()
    head = 1 + width
    m = int(ref[1:head], 2)
    ends = [head]
    for i, prev in zip(np.flatnonzero(mk), np.concatenate([[-1], np.flatnonzero(mk)[:-1]]), strict=True):
        ends.append(ends[-1] + len(golomb_string(int(i - prev - 1), m)))
    streams, lengths = [], []
    cuts = list(range(0, nb + 1, 3))
    for cut in cuts:
        streams.append(words_from_string(ref[:cut], cap))
        lengths.append(cut)
    flips = np.random.default_rng(8).choice(nb, 48, replace=False)
    for f in flips:
        streams.append(words_from_string(ref[:f] + str(1 - int(ref[f])) + ref[f + 1 :], cap))
        lengths.append(nb)
    bad_m = [0, DM + 1, 2**width - 1]
    for bm in bad_m:
        streams.append(words_from_string(ref[0] + binary(bm, width) + ref[head:], cap))
        lengths.append(nb)
    streams += [words] * 4
    lengths += [nb - 1, -1, 32 * cap + 1, nb + 0.5]
    decoded, ok = _mask_decode(np.stack(streams), lengths, method)
    assert not np.any(decoded[~ok])
    for j, cut in enumerate(cuts):
        assert ok[j] == (cut in ends)
    nf = len(cuts) + len(flips)
    for j in range(len(cuts), nf):
        if ok[j]:
            s = stream_string(streams[j])
            flag, mj = int(s[0]), int(s[1:head], 2)
            assert mask_string(decoded[j], flag, mj) == s[:nb]
    assert not ok[nf:].any()


def test_mask_too_many_coded_positions_rejected():
    """A stream coding more positions than the flag allows (d // 2 ones) is malformed."""
    d = DM
    m, width = 1, d.bit_length()
    bits = "0" + binary(m, width) + "1" * (d // 2 + 1)  # m = 1: each '1' codes the next position
    good = "0" + binary(m, width) + "1" * (d // 2)  # exactly d // 2 ones: valid
    words = [words_from_string(b, mask_capacity_words(d)) for b in (bits, good)]
    decoded, ok = _mask_decode(words, [len(bits), len(good)], "walk")
    assert not ok[0] and not decoded[0].any()
    assert ok[1] and decoded[1].tolist() == [1.0] * (d // 2) + [0.0] * (d - d // 2)


def test_mask_validation():
    with pytest.raises(ValueError, match="only 0 and 1"):
        mask_encode(jnp.array([0.0, 0.5, 1.0]))
    with pytest.raises(ValueError, match="1-D"):
        mask_encode(jnp.zeros((2, 2)))
    with pytest.raises(ValueError, match="dim"):
        mask_decode(jnp.zeros(2, jnp.uint32), 0, dim=0)
    with pytest.raises(ValueError, match="method"):
        mask_decode(jnp.zeros(2, jnp.uint32), 0, dim=4, method="scan")


def test_public_api():
    from sidejax.coding import lossless

    for module in (bs, lossless):
        for name in module.__all__:
            assert hasattr(module, name), name
