"""The Adaptive-Avg KLMS coder (sidejax.coding.klms_avg; docs/papers/bicompfl.md#s3-8 "Adaptive-Avg",
docs/papers/bicompfl.md#s8-8)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cond_branch_counts, tree_equal

from sidejax.coding import check_decoded, concat_stacked, sent_message, split_stacked
from sidejax.coding.base import ERR_CRC, ERR_LENGTH, ERR_PARSE, ERR_PRIOR, Message
from sidejax.coding.importance import candidate_uniforms, candidates
from sidejax.coding.klms_avg import (
    KLMSAvgConfig,
    KLMSAvgDecoded,
    KLMSAvgState,
    equal_blocks,
    equal_blocks_encode,
    klms_avg_coder,
    klms_avg_decode,
    klms_avg_downlink,
    klms_avg_encode,
    klms_avg_frame,
    klms_avg_init,
    klms_avg_receive,
    klms_avg_server_update,
    row_buckets,
)
from sidejax.distributions import Bernoulli
from sidejax.keys import client_keys, round_key

D = 1000
# K* = 3 (8 candidates), b_0 = 16, b_max = 64 (L = 6), f = 2; chunks of 48 coordinates, so blocks of 16 lie
# inside a chunk or across two, and blocks of 64 span up to three chunks
CFG = KLMSAvgConfig(
    log2_num_candidates=3, block_size=16, max_block_size=64, trigger_factor=2.0, chunk_size=48
)
CRC_CFG = dataclasses.replace(CFG, crc32=True)
L = CFG.length_bits
_rng = np.random.default_rng(0)
Q = Bernoulli(jnp.asarray(_rng.uniform(0.05, 0.95, D), jnp.float32))
P = Bernoulli(jnp.asarray(_rng.uniform(0.2, 0.8, D), jnp.float32))
KEYS = client_keys(round_key(jax.random.key(7), 0), 3)

encode = jax.jit(klms_avg_encode, static_argnames="config")
decode = jax.jit(klms_avg_decode, static_argnames="config")


def _oracle_indices(keys, q, p, block_size: int, log2_k: int) -> np.ndarray:
    """Host oracle of the encoder's choice: every candidate ([K, dim]), per-block log-weights summed in
    float64, and the inversion rule with the block's private uniform u_m (candidate_uniforms at (m, 0)),
    uniform weights where every candidate has q = 0."""
    K = 2**log2_k
    y = candidates(keys.shared, p, log2_k)
    logr = np.asarray(q.log_prob(y), np.float64) - np.asarray(p.log_prob(y), np.float64)  # [K, dim]
    dim = logr.shape[1]
    M = -(-dim // block_size)
    logw = np.zeros((M, K))
    np.add.at(logw, np.arange(dim) // block_size, logr.T)
    u = np.asarray(candidate_uniforms(keys.private, jnp.arange(M), jnp.zeros(M, jnp.int32)), np.float64)
    top = logw.max(axis=1, keepdims=True)
    dead = top == -np.inf
    cdf = np.cumsum(np.exp(np.where(dead, 0.0, logw - np.where(dead, 0.0, top))), axis=1)
    return np.minimum(np.sum(cdf < (u * cdf[:, -1])[:, None], axis=1), K - 1)


def _stream_bits(words) -> np.ndarray:
    """Stream bit ``i`` is bit ``i mod 32`` of word ``i // 32`` (LSB first)."""
    return np.unpackbits(np.asarray(words, np.uint32).astype("<u4").view(np.uint8), bitorder="little")


def _field(bits: np.ndarray, start: int, width: int) -> int:
    return int((bits[start : start + width].astype(np.int64) << np.arange(width)).sum())


# ----------------------------------------------------------------------------------------------------
# the encoder


# chunks of 8 coordinates: blocks of 1 (every row of a chunk's bucket live), 3 (across chunk boundaries), 47,
# 64 and 1000 (across up to 125 chunks), and a short last block
_stream_indices = jax.jit(
    lambda q, p, b: equal_blocks_encode(
        KEYS.shared, KEYS.private, q, p, b, log2_num_candidates=3, max_block_size=1024, chunk_size=8
    )
)


def test_streaming_encoder_chooses_the_oracles_indices_for_every_block_size():
    """The streamed choice is the oracle's for every block size (one compiled program, the size traced), and
    slots past M are zero."""
    assert row_buckets(8, 1024) == (2, 8) and row_buckets(48, 64) == (2, 16, 48)
    assert row_buckets(1000, 64) == (17, 136, 1000)
    for b in (1, 3, 47, 64, 1000):
        indices, fallback = _stream_indices(Q, P, jnp.int32(b))
        M = -(-D // b)
        np.testing.assert_array_equal(
            np.asarray(indices)[:M], _oracle_indices(KEYS, Q, P, b, 3), err_msg=str(b)
        )
        assert not np.asarray(indices)[M:].any() and int(fallback) == 0


def test_under_vmap_over_clients_only_the_row_bucket_of_the_shared_size_runs():
    """The block size is part of the state every client shares, so vmapping the encoder over clients keeps
    the row buckets a lax.switch (one branch runs), not a select over all of them."""
    state = klms_avg_init(D, CFG)
    keys = jax.vmap(lambda i: client_keys(round_key(jax.random.key(0), 0), i))(jnp.arange(3))
    probs = jnp.stack([Q.probs] * 3)
    batched = jax.make_jaxpr(jax.vmap(lambda k, q: klms_avg_encode(k, Bernoulli(q), P, state, CFG)))(
        keys, probs
    )
    assert cond_branch_counts(batched.jaxpr) == [len(row_buckets(48, 64))] == [3]


def test_a_block_without_support_falls_back_to_a_uniform_index_and_is_counted():
    """q puts mass 1 on 1 where p is 1e-6 on the first block of 3: its candidates are all 0 with
    overwhelming probability, so every one has q = 0 and the index comes from the private uniform alone."""
    q = Bernoulli(Q.probs.at[:3].set(1.0))
    p = Bernoulli(P.probs.at[:3].set(1e-6))
    assert not np.asarray(candidates(KEYS.shared, p, 3))[:, :3].any()
    indices, fallback = _stream_indices(q, p, jnp.int32(3))
    u0 = float(candidate_uniforms(KEYS.private, jnp.int32(0), jnp.int32(0)))
    assert int(fallback) == 1 and int(indices[0]) == int(u0 * 8)
    np.testing.assert_array_equal(np.asarray(indices)[:334], _oracle_indices(KEYS, q, p, 3, 3))


# ----------------------------------------------------------------------------------------------------
# the stream


@pytest.mark.parametrize("cfg", [CFG, CRC_CFG], ids=["plain", "crc"])
@pytest.mark.parametrize("update", [False, True], ids=["ordinary", "update-round"])
def test_round_trip_and_the_exact_stream_layout(cfg, update):
    """decode returns the candidates the encoder chose (the oracle's); num_bits is M K* + 1 (+ L in update
    rounds) (+ 32 with the CRC), the fields read back from the wire where the module docstring puts them."""
    state = klms_avg_init(D, cfg)._replace(update=jnp.asarray(update))
    msg, info = encode(KEYS, Q, P, state, config=cfg)
    y, dec = decode(KEYS.shared, P, state, msg, config=cfg)
    b, k = cfg.block_size, cfg.log2_num_candidates
    M = -(-D // b)
    assert int(info.num_blocks) == int(dec.num_blocks) == M == 63
    expected = M * k + 1 + (L if update else 0) + (32 if cfg.crc32 else 0)
    assert float(msg.num_bits) == expected
    assert bool(info.valid) and bool(dec.valid) and int(dec.errors) == 0
    oracle = _oracle_indices(KEYS, Q, P, b, k)
    want = np.asarray(candidates(KEYS.shared, P, k))[oracle[np.arange(D) // b], np.arange(D)]
    np.testing.assert_array_equal(np.asarray(y), want)  # Bernoulli candidates: exact 0/1
    # the wire format, parsed on the host
    bits = _stream_bits(msg.payload)
    np.testing.assert_array_equal([_field(bits, m * k, k) for m in range(M)], oracle)
    kl = float(info.kl_bits)
    request = not 1 / cfg.trigger_factor <= kl / M / k <= cfg.trigger_factor
    proposal = int(np.clip(np.round(k * D / kl), 1, cfg.max_block_size))
    assert _field(bits, M * k, 1) == int(request) == int(info.request) == int(dec.request)
    assert int(info.proposal) == proposal
    assert float(info.mean_block_kl_bits) == pytest.approx(kl / M, rel=1e-6)
    if update:
        assert _field(bits, M * k + 1, L) == proposal - 1 and int(dec.proposal) == proposal
    else:
        assert int(dec.proposal) == b  # no proposal: the round's size
    assert not bits[int(expected) :].any()
    if cfg.crc32 and update:  # outside jit (once: eager encoding is slow): the buffer, cut at the boundary
        host, _ = klms_avg_encode(KEYS, Q, P, state, cfg)
        assert host.payload.shape == msg.payload.shape
        host = sent_message(host)
        assert host.payload.shape == (-(-expected // 32),) and float(host.num_bits) == expected
        y_host, dec_host = klms_avg_decode(KEYS.shared, P, state, host, cfg)
        assert bool(dec_host.valid)
        np.testing.assert_array_equal(np.asarray(y_host), want)


def test_a_malformed_stream_is_flagged_and_raises_at_the_host_boundary():
    state = klms_avg_init(D, CRC_CFG)
    msg, _ = encode(KEYS, Q, P, state, config=CRC_CFG)
    nb = int(msg.num_bits)
    n = -(-nb // 32)

    def errors(m, key=KEYS.shared, p=P):
        return int(decode(key, p, state, m, config=CRC_CFG)[1].errors)

    assert errors(msg) == 0
    assert errors(Message(msg.payload, msg.num_bits - 1)) & ERR_PARSE  # fields do not add up (and a set bit)
    assert errors(Message(msg.payload, msg.num_bits + 1)) == ERR_PARSE
    assert errors(Message(msg.payload[: n - 1], msg.num_bits)) & ERR_LENGTH  # truncated
    stray = msg.payload.at[n].set(1)  # a set bit past num_bits in the capacity buffer
    assert errors(Message(stray, msg.num_bits)) == ERR_LENGTH
    flipped = msg.payload.at[0].set(msg.payload[0] ^ jnp.uint32(1 << 4))  # an index bit
    assert errors(Message(flipped, msg.num_bits)) == ERR_CRC
    assert errors(msg, key=client_keys(round_key(jax.random.key(7), 0), 4).shared) == ERR_CRC
    assert errors(msg, p=jax.tree.map(lambda a: a.at[5].set(jnp.nan), P)) & ERR_PRIOR
    # the host boundary: exactly the words sent (decoded as the capacity buffer is, eagerly as in jit), and
    # no invalid stream passes silently
    exact = sent_message(msg)
    assert exact.payload.shape == (n,)
    for m in (exact, msg):
        assert bool(check_decoded(klms_avg_decode(KEYS.shared, P, state, m, CRC_CFG)[1]).valid)
    truncated = Message(msg.payload[: n - 1], msg.num_bits)
    assert errors(truncated) == int(klms_avg_decode(KEYS.shared, P, state, truncated, CRC_CFG)[1].errors)
    with pytest.raises(ValueError, match="invalid KLMS-Avg stream: the payload is shorter than num_bits"):
        check_decoded(klms_avg_decode(KEYS.shared, P, state, truncated, CRC_CFG)[1], "KLMS-Avg stream")
    with pytest.raises(ValueError, match="CRC-32 mismatch"):
        check_decoded(klms_avg_decode(KEYS.shared, P, state, Message(flipped[:n], msg.num_bits), CRC_CFG)[1])


def test_states_and_distributions_that_do_not_match_raise_or_are_flagged():
    state = klms_avg_init(D, CFG)
    q2 = Bernoulli(jnp.full(D + 1, 0.3))
    with pytest.raises(ValueError, match="p has 1000 coordinates"):  # static shapes: raised
        klms_avg_encode(KEYS, q2, P, state, CFG)
    with pytest.raises(ValueError, match="dim must be an int >= 1"):
        klms_avg_init(0, CFG)
    # the state's values (a size out of range, a state built for another vector) are flagged, the same
    # inside jit and outside it: the client's info and the decoder report them (check_decoded raises)
    for bad in (state._replace(block_size=jnp.int32(65)), klms_avg_init(D + 1, CFG)):
        msg, info = encode(KEYS, Q, P, bad, config=CFG)
        assert not bool(info.valid)
        decoded = decode(KEYS.shared, P, bad, msg, config=CFG)[1]
        assert int(decoded.errors) & ERR_PARSE
        assert tree_equal(klms_avg_decode(KEYS.shared, P, bad, msg, CFG)[1], decoded)
        with pytest.raises(ValueError, match="fields read do not add up"):
            check_decoded(decoded)


# ----------------------------------------------------------------------------------------------------
# the protocol


def _np_kl_bits(probs: np.ndarray) -> float:
    """KL(Bern(probs) || Bern(1/2)) in bits, summed over coordinates, in float64."""
    x = probs.astype(np.float64)
    return float(np.sum(1 + x * np.log2(x) + (1 - x) * np.log2(1 - x)))


# base deviation per round and per-client scale: q_{i,t} = Bern(1/2 + delta_t * scale_i * sign_ij)
SCHEDULE = [0.25, 0.40, 0.40, 0.40, 0.10, 0.10, 0.10, 0.30, 0.30]
SCALES = [0.9, 1.0, 1.12]


def test_a_sequence_of_rounds_follows_the_rule_computed_by_hand():
    """Three clients, nine rounds of a KL that grows, shrinks and grows again. The flag, the update rounds
    and every block size follow the rule computed here in numpy from the probabilities alone: a request when
    KL / M / K* leaves [1/f, f], an update round after any request, proposals clip(round(K* d / KL), 1,
    b_max), the new size round(mean) from the round after the update round. Every message has M K* + 1
    (+ L) bits and decodes; a receiver that only ever sees the downlinks holds the server's state."""
    n = len(SCALES)
    signs = np.where(np.random.default_rng(1).uniform(size=(n, D)) < 0.5, -1.0, 1.0)
    base = jax.random.key(11)
    coder = klms_avg_coder(CFG)

    @jax.jit
    def round_step(server, client, probs, t):
        keys = jax.vmap(lambda i: client_keys(round_key(base, t), i))(jnp.arange(n))
        p = Bernoulli(jnp.full(D, 0.5, jnp.float32))
        msgs, infos = jax.vmap(lambda k, q: coder.encode(k, Bernoulli(q), p, client))(keys, probs)
        _, decoded = jax.vmap(lambda k, m: coder.decode(k.shared, p, server, m))(keys, msgs)
        new_server, sinfo = coder.update(server, decoded)
        down = coder.downlink(new_server)
        # the receiver knows its old size and, from the flag it received last round (its state's `changed`,
        # as receive left it), whether a size follows
        received = coder.receive(client, down)
        return new_server, received, msgs.num_bits, infos, decoded, sinfo, down.num_bits

    k, f, bmax = CFG.log2_num_candidates, CFG.trigger_factor, CFG.max_block_size
    server = client = coder.init(D)
    b, update, changed = CFG.block_size, False, False  # the hand-computed protocol state
    sizes, updates = [], []
    for t, delta in enumerate(SCHEDULE):
        probs = np.float32(0.5) + np.float32(delta) * np.asarray(SCALES, np.float32)[:, None] * signs
        probs = probs.astype(np.float32)
        kl = np.array([_np_kl_bits(row) for row in probs])
        M = -(-D // b)
        ratio = kl / M / k
        requests = (ratio < 1 / f) | (ratio > f)
        raw = k * D / kl
        proposals = np.clip(np.round(raw), 1, bmax).astype(int)
        # the schedule keeps float32 far from every decision boundary, so the rule is unambiguous
        assert np.all(np.abs(raw - np.floor(raw) - 0.5) > 1e-3)
        assert np.all(np.minimum(np.abs(ratio * f - 1), np.abs(ratio / f - 1)) > 1e-3)

        server, client, bits, infos, decoded, sinfo, down_bits = round_step(
            server, client, jnp.asarray(probs), jnp.int32(t)
        )
        np.testing.assert_allclose(np.asarray(infos.kl_bits), kl, rtol=1e-5)
        assert np.asarray(infos.request).tolist() == requests.tolist()
        assert np.asarray(decoded.request).tolist() == requests.tolist()
        assert np.asarray(infos.proposal).tolist() == proposals.tolist()
        assert np.all(np.asarray(bits) == M * k + 1 + (L if update else 0))
        assert np.all(np.asarray(decoded.valid)) and np.all(np.asarray(infos.valid))
        assert bool(sinfo.updated) == update and int(sinfo.num_requests) == requests.sum()
        # the rule: b = round(mean proposals) after an update round, else update = any request
        if update:
            assert np.asarray(decoded.proposal).tolist() == proposals.tolist()
            b, update, changed = int(np.round(proposals.mean())), False, True
        else:
            update, changed = bool(requests.any()), False
        assert (int(server.block_size), bool(server.update), bool(server.changed)) == (b, update, changed)
        assert float(down_bits) == 1 + (L if changed else 0)
        # the receiver's copy, from the downlinks alone: the server's size and flag, and as `changed` the flag
        # it just received (whether the next downlink carries a size)
        assert tree_equal(client, server._replace(changed=server.update))
        sizes.append(b)
        updates.append(update)
    # what happened: requests after rounds 1, 4 and 6 (one client alone), sizes 16 -> 6 -> 64 (clipped) -> 11
    assert updates == [False, True, False, False, True, False, True, False, False]
    assert sizes == [16, 16, 6, 6, 6, 64, 64, 11, 11]


def _decoded(requests, proposals) -> KLMSAvgDecoded:
    c = len(requests)
    return KLMSAvgDecoded(
        jnp.asarray(requests),
        jnp.asarray(proposals, jnp.int32),
        jnp.full(c, 1, jnp.int32),
        jnp.ones(c, bool),
        jnp.zeros(c, jnp.int32),
    )


def test_the_server_rounds_the_mean_half_to_even_and_ignores_requests_in_update_rounds():
    state = klms_avg_init(D, CFG)
    upd = state._replace(update=jnp.asarray(True))
    for proposals, size in (([5, 6], 6), ([6, 7], 6), ([1, 2, 2, 2], 2), ([3, 4, 4], 4), ([64, 63], 64)):
        new, info = klms_avg_server_update(upd, _decoded([True] * len(proposals), proposals), CFG)
        assert int(new.block_size) == int(info.block_size) == size == round(np.mean(proposals)), proposals
        assert not bool(new.update) and bool(new.changed) and bool(info.updated)
    # ordinary rounds: the size stays whatever was proposed (the decoder's neutral value), any request fires
    for requests, fires in (([False, False], False), ([False, True], True)):
        new, info = klms_avg_server_update(state, _decoded(requests, [3, 3]), CFG)
        assert int(new.block_size) == 16 and bool(new.update) == fires and not bool(new.changed)
        assert bool(info.next_update) == fires
    with pytest.raises(ValueError, match="stacked over the participating clients"):
        klms_avg_server_update(state, jax.tree.map(lambda a: a[0], _decoded([True], [3])), CFG)


def test_downlink_is_the_stream_a_stale_receiver_parses():
    """After an update round the downlink is the flag and the new size minus one (1 + L bits, the size sent
    even when it is the old one); otherwise the flag alone. A receiver holding the previous size and the
    flag it received last round rebuilds the server's state; host and jitted streams are the same words."""
    state = klms_avg_init(D, CFG)._replace(update=jnp.asarray(True))
    new, _ = klms_avg_server_update(state, _decoded([False, True], [40, 43]), CFG)
    assert int(new.block_size) == 42 and bool(new.changed) and not bool(new.update)
    downlink = jax.jit(lambda s: klms_avg_downlink(s, CFG))
    receive = jax.jit(lambda s, m: klms_avg_receive(s, m, CFG))
    host, jitted = klms_avg_downlink(new, CFG), downlink(new)
    assert float(host.num_bits) == float(jitted.num_bits) == 1 + L and host.payload.shape == (1,)
    np.testing.assert_array_equal(np.asarray(host.payload), np.asarray(jitted.payload))
    bits = _stream_bits(host.payload)
    assert bits[0] == 0 and _field(bits, 1, L) == 41 and not bits[1 + L :].any()
    # the old size, and from last round's downlink (receive's `changed`: the flag it got) that a size follows
    stale = klms_avg_receive(state, klms_avg_downlink(state, CFG), CFG)
    assert bool(stale.changed) == bool(state.update)
    for msg in (host, jitted):  # the server's size and flag; the flag kept as `changed` for the next downlink
        assert tree_equal(klms_avg_receive(stale, msg, CFG), new._replace(changed=new.update))
        assert tree_equal(receive(stale, msg), new._replace(changed=new.update))
    # the next rounds: the flag only; the receiver keeps its size
    client = receive(stale, host)
    for requests in ([False, False], [True, False]):
        nxt, _ = klms_avg_server_update(new, _decoded(requests, [42, 42]), CFG)
        down = klms_avg_downlink(nxt, CFG)
        assert float(down.num_bits) == 1 and _stream_bits(down.payload).tolist() == [any(requests)] + [0] * 31
        assert tree_equal(receive(client, down), nxt._replace(changed=nxt.update))


# ----------------------------------------------------------------------------------------------------
# self-delimiting streams


@pytest.mark.parametrize(
    "cfg,update", [(CFG, False), (CFG, True), (CRC_CFG, True)], ids=["plain", "update", "crc"]
)
def test_frame_is_each_messages_length_and_a_relay_splits_back_into_the_messages(cfg, update):
    """``frame`` reads each message's length from the state alone; four messages relayed back to back (one
    skipped) by ``concat_stacked`` are cut back into the kept ones by ``split_stacked``, bit for bit, and
    decode to the same samples; one bit less and the relay no longer adds up."""
    state = klms_avg_init(D, cfg)._replace(update=jnp.asarray(update), block_size=jnp.int32(24))
    keys = [client_keys(round_key(jax.random.key(0), 2), i) for i in range(4)]
    qs = [
        Bernoulli(jax.random.uniform(jax.random.key(10 + i), (D,), minval=0.05, maxval=0.95))
        for i in range(4)
    ]
    msgs = [encode(kk, q, P, state, config=cfg)[0] for kk, q in zip(keys, qs, strict=True)]
    frame = klms_avg_coder(cfg).frame
    for m in msgs:
        assert (
            float(frame(state, m.payload, 0)) == float(m.num_bits) == klms_avg_frame(state, m.payload, 0, cfg)
        )
    stacked = Message(jnp.stack([m.payload for m in msgs]), jnp.stack([m.num_bits for m in msgs]))
    keep = jnp.array([True, False, True, True])
    relay = jax.jit(concat_stacked)(stacked, keep)
    assert float(relay.num_bits) == 3 * float(msgs[0].num_bits)
    split = jax.jit(lambda m: split_stacked(m, frame, state, 3, cfg.capacity_words(D)))
    parts, ok = split(relay)
    assert bool(ok)
    for j, i in enumerate([0, 2, 3]):
        used = -(-int(msgs[i].num_bits) // 32)
        assert float(parts.num_bits[j]) == float(msgs[i].num_bits)
        np.testing.assert_array_equal(np.asarray(parts.payload[j][:used]), np.asarray(msgs[i].payload)[:used])
        y, dec = decode(keys[i].shared, P, state, Message(parts.payload[j], parts.num_bits[j]), config=cfg)
        y0, _ = decode(keys[i].shared, P, state, msgs[i], config=cfg)
        assert bool(dec.valid)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    assert not bool(split(Message(relay.payload, relay.num_bits - 1))[1])


# ----------------------------------------------------------------------------------------------------
# memory at scale, and configuration


def test_encoder_memory_does_not_scale_with_the_block_bound_at_two_million_parameters():
    """d = 2e6: the block size is dynamic, so M ranges up to d, and a [blocks, K] accumulator sized to that
    bound would be d K floats. The streamed encoder's compiled temporaries stay within the memory budget
    (measured 146 MiB for K = 4, whose budget-sized chunk is 1.2M coordinates; 103 MiB for K* = 8, where a
    [d, K] array alone is 1.9 GiB), and it runs for the smallest and the largest block size."""
    d = 2_000_000
    cfg = KLMSAvgConfig(log2_num_candidates=2, block_size=2048)
    keys = client_keys(round_key(jax.random.key(0), 0), 1)
    q = Bernoulli(jnp.full(d, 0.6, jnp.float32))
    p = Bernoulli(jnp.full(d, 0.5, jnp.float32))
    compiled = jax.jit(lambda s: klms_avg_encode(keys, q, p, s, cfg)).lower(klms_avg_init(d, cfg)).compile()
    stats = compiled.memory_analysis()
    assert stats.temp_size_in_bytes < cfg.memory_budget_bytes  # 256 MiB; [d, K] int32 indices are 8 MiB
    assert cfg.capacity_words(d) == -(-(2 * d + 1 + 11) // 32)
    for b in (2048, 1):
        msg, info = compiled(klms_avg_init(d, cfg)._replace(block_size=jnp.int32(b)))
        assert float(msg.num_bits) == -(-d // b) * 2 + 1 and bool(info.valid)
        assert int(info.num_fallback_blocks) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(log2_num_candidates=0), "log2_num_candidates"),
        (dict(log2_num_candidates=2.0), "log2_num_candidates"),
        (dict(max_block_size=100), "max_block_size must be a power of two"),
        (dict(max_block_size=1), "max_block_size must be a power of two"),
        (dict(block_size=4096), "block_size must be an int in 1..max_block_size=2048"),
        (dict(block_size=0), "block_size"),
        (dict(trigger_factor=1.0), "trigger_factor must be a finite number > 1"),
        (dict(trigger_factor=0.5), "trigger_factor"),
        (dict(trigger_factor=float("nan")), "trigger_factor"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(memory_budget_bytes=0), "memory_budget_bytes"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KLMSAvgConfig(**kwargs)


def test_equal_blocks_and_the_coder_builder():
    blocks = equal_blocks(10, jnp.int32(4))
    assert int(blocks.num_blocks) == 3 and blocks.max_blocks == 10
    assert np.asarray(blocks.starts).tolist() == [0, 4, 8] + [10] * 8
    assert np.asarray(blocks.block_ids).tolist() == [0] * 4 + [1] * 4 + [2] * 2
    assert isinstance(klms_avg_init(D, CFG), KLMSAvgState)
    with pytest.raises(TypeError, match="KLMSAvgConfig"):
        klms_avg_coder(dataclasses.asdict(CFG))
