"""The family contract test: every coder in sidejax obeys the Coder contract (like optax's alias tests).

For each coder, on a fixed (q, p) pair:

1. decode reproduces the encoder's choice bit for bit (against an oracle of what the encoder chose:
   the private-key sample for sample-then-code coders, the selected candidates for KLMS);
2. ``num_bits`` is the stream's length: the host boundary (:func:`sidejax.coding.sent_message`) cuts the
   payload to exactly ``ceil(num_bits / 32)`` words, no bit past ``num_bits`` is set, that message decodes
   as the capacity buffer does, and the same stream one bit shorter does not decode cleanly;
3. every output is finite;
4. a second call with other keys and values does not recompile (encode and decode);
5. ``decode``'s signature is ``(shared_key, p, state, message)``: it cannot see ``q`` or the private key;
6. the protocol side information round-trips: after ``update``, the receivers' ``receive`` of
   ``downlink(state)`` rebuilds the state they encode against;
7. the declared fields are true: ``capacity_words(dim)`` is the payload of ``encode`` inside jit for
   several dims, ``deterministic`` and ``fixed_bits`` agree with encoding under other keys, other inputs
   and another protocol state (what callers used to find out by compiling probe programs);
8. ``live_prefix``: a coder that declares one codes the first ``live`` (traced) coordinates of a static
   buffer as it codes those coordinates alone; every other coder is refused by ``check_live_prefix``,
   which names the argument.
9. one behaviour: ``encode``, ``decode`` and ``downlink`` give the same outputs (shapes, dtypes, values)
   outside ``jit`` as inside it.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_equal

from sidejax.blocks import block_sizes
from sidejax.coding import (
    KLMSAvgConfig,
    KLMSConfig,
    check_live_prefix,
    elias_coder,
    equal_blocks,
    fixed_width_coder,
    float32_coder,
    klms_avg_coder,
    klms_coder,
    klms_init,
    mask_coder,
    pack_pseudocoreset,
    pseudocoreset_coder,
    scaled_sign_coder,
    sent_message,
    sent_words,
    topk_coder,
    with_crc,
    with_side_info,
)
from sidejax.coding.base import ERR_CRC, WITHHELD_BITS, Message, included, withhold
from sidejax.coding.importance import candidate_uniforms, candidates, encode_bounded, importance_decode
from sidejax.coding.lattice import (
    additive_noise_coder,
    clip_update,
    lrsuq_coder,
    lrsuq_quantize,
    lrsuq_reconstruct,
    sdq_coder,
    sdq_quantize,
    sdq_reconstruct,
)
from sidejax.coding.lrsuq import GaussianNoise
from sidejax.distributions import Bernoulli, DiagGaussian, PointMass, Sign, StochasticLevels, Ternary
from sidejax.keys import ClientKeys, client_keys, draw_key, round_key
from sidejax.lattices import hexagonal, integer_lattice

DIM = 203  # not a multiple of 32
NUM_SIDE = 3


def _keys(seed: int, client: int = 3):
    return client_keys(round_key(jax.random.key(seed), 0), client)


def _bernoulli(seed):
    rng = np.random.default_rng(seed)
    q = Bernoulli(jnp.asarray(rng.uniform(0.05, 0.95, DIM), jnp.float32))
    p = Bernoulli(jnp.asarray(rng.uniform(0.2, 0.8, DIM), jnp.float32))
    return q, p


def _levels(seed, s=3):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(DIM) * (rng.uniform(size=DIM) < 0.3)
    scaled = s * v / np.abs(v).max()
    return StochasticLevels(jnp.asarray(scaled, jnp.float32)), Ternary(jnp.full((DIM, 3), 1 / 3, jnp.float32))


def _ternary_levels(seed):
    q, _ = _levels(seed, s=1)
    rng = np.random.default_rng(seed + 100)
    nz = rng.uniform(0.05, 0.3, DIM)
    p = Ternary(jnp.asarray(np.stack([nz / 2, 1 - nz, nz / 2], -1), jnp.float32))
    return q, p


def _signs(seed):
    rng = np.random.default_rng(seed)
    return Sign(jnp.asarray(rng.uniform(0.05, 0.95, DIM), jnp.float32)), Sign(jnp.full(DIM, 0.5, jnp.float32))


def _gauss(seed):
    rng = np.random.default_rng(seed)
    loc = jnp.asarray(rng.standard_normal(DIM) * 0.5, jnp.float32)
    return DiagGaussian(loc, jnp.full(DIM, 1.0, jnp.float32)), DiagGaussian(jnp.zeros(DIM), jnp.ones(DIM))


def _point(seed):
    rng = np.random.default_rng(seed)
    return PointMass(jnp.asarray(rng.standard_normal(DIM), jnp.float32)), PointMass(
        jnp.zeros(DIM, jnp.float32)
    )


def _pseudocoreset(seed):
    # BPC-FL's uplink: K = 2 pseudo-points of D = 100 inputs, labels of 10 classes, n_m; 2 * 100 + 2 + 1 = DIM
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.standard_normal((2, 100)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, 2), jnp.int32)
    q = PointMass(pack_pseudocoreset(z, labels, int(rng.integers(1, 5000))))
    return q, PointMass(jnp.zeros(DIM, jnp.float32))


def _with_side(make):
    def build(seed):
        q, p = make(seed)
        side = jnp.asarray(np.random.default_rng(seed).uniform(0.5, 2.0, NUM_SIDE), jnp.float32)
        return (q, side), p

    return build


def _sample_oracle(keys, q, p, state):
    del p, state
    return q.sample(keys.private)


def _scaled_sign_oracle(keys, q, p, state):
    # the deterministic compressor (not a sample of q): (||v||_1 / d) * sign(v), sign(0) = +1
    del keys, p, state
    scale = jnp.sum(jnp.abs(q.value)) / q.value.shape[0]
    return jnp.where(q.value < 0, -scale, scale)


def _topk_oracle(keys, q, p, state):
    # the deterministic compressor: the K = floor(d / 10) coordinates of largest magnitude, the others zero
    del keys, p, state
    _, kept = jax.lax.top_k(jnp.abs(q.value), q.value.shape[0] // 10)
    return jnp.zeros_like(q.value).at[kept].set(q.value[kept])


def _klms_oracle(config):
    def oracle(keys, q, p, state):
        # what the encoder chose: one index per block (Gumbel-max on the private key), then the candidates
        blocks = state.blocks
        if config.adaptive:
            from sidejax.blocks import kl_blocks

            blocks = jax.lax.cond(
                state.update,
                lambda: kl_blocks(
                    q.kl_bits(p),
                    config.target_bits,
                    max_block_size=config.max_block_size,
                    max_blocks=blocks.max_blocks,
                ),
                lambda: blocks,
            )
        indices, _ = encode_bounded(
            keys.shared,
            keys.private,
            q,
            p,
            blocks,
            log2_num_candidates=config.log2_num_candidates,
            work_blocks=blocks.max_blocks,
            memory_budget_bytes=config.memory_budget_bytes,
        )
        return importance_decode(keys.shared, p, blocks, indices)

    return oracle


def _klms_avg_oracle(config):
    def oracle(keys, q, p, state):
        # what the encoder chose, without streaming: every [K, dim] candidate, the blocks' log-weights by one
        # segment sum, and each block's index by inversion with its private uniform (uniform if q = 0 on all)
        k = config.log2_num_candidates
        y = candidates(keys.shared, p, k)
        ids = jnp.arange(DIM) // state.block_size
        logw = jax.ops.segment_sum((q.log_prob(y) - p.log_prob(y)).T, ids, num_segments=DIM)
        m = jnp.arange(DIM)
        u = candidate_uniforms(keys.private, m, jnp.zeros_like(m))
        top = jnp.max(logw, axis=1, keepdims=True)
        dead = top == -jnp.inf
        cdf = jnp.cumsum(jnp.exp(jnp.where(dead, 0.0, logw - jnp.where(dead, 0.0, top))), axis=1)
        indices = jnp.minimum(jnp.sum(cdf < u[:, None] * cdf[:, -1:], axis=1), 2**k - 1)
        return importance_decode(keys.shared, p, equal_blocks(DIM, state.block_size), indices)

    return oracle


def _side_oracle(inner):
    def oracle(keys, q, p, state):
        inner_q, side = q
        return inner(keys, inner_q, p, state), side

    return oracle


def _lrsuq_oracle(lattice, noise, gamma):
    def oracle(keys, q, p, state):
        # Algorithms 2/3 by hand: X = q - p normalised to norm gamma, LRSUQ per block, rescaled by ||X||/gamma
        del state
        x = q.value - p.value
        norm = jnp.linalg.norm(x)
        h, coords = lrsuq_quantize(keys.shared, gamma * x / norm, lattice, noise)
        return p.value + (norm / gamma) * lrsuq_reconstruct(keys.shared, h, coords, lattice, noise, DIM)

    return oracle


def _noisy_sdq_oracle(sigma, lattice):
    def oracle(keys, q, p, state):
        # clip to norm 1, add the private Gaussian noise, then SDQ with the shared dithers
        del state
        x = q.value - p.value
        x = x * jnp.minimum(1.0, 1.0 / jnp.linalg.norm(x))
        x = x + sigma * jax.random.normal(draw_key(keys.private, 0), x.shape)
        return p.value + sdq_reconstruct(keys.shared, sdq_quantize(keys.shared, x, lattice), lattice, DIM)

    return oracle


_ADAPTIVE = KLMSConfig(log2_num_candidates=3, max_block_size=16, block_size=4)
_FIXED = KLMSConfig(log2_num_candidates=4, adaptive=False, block_size=5)
_CRC = KLMSConfig(log2_num_candidates=2, max_block_size=8, crc32=True)
_AVG = KLMSAvgConfig(log2_num_candidates=3, block_size=2, max_block_size=16)
# starts with an update round (the stream carries a proposal); blocks of 8 across chunks of 16 coordinates
_AVG_UPDATE = KLMSAvgConfig(
    log2_num_candidates=4, block_size=8, max_block_size=32, initial_update=True, chunk_size=16, crc32=True
)

# (id, coder, make(seed) -> (q, p), oracle)
CASES = [
    ("float32", float32_coder(), _point, _sample_oracle),
    ("signs", fixed_width_coder((-1.0, 1.0)), _signs, _sample_oracle),
    ("elias", elias_coder(3), _levels, _sample_oracle),
    ("mask", mask_coder(), _bernoulli, _sample_oracle),
    ("scaled-sign", scaled_sign_coder(), _point, _scaled_sign_oracle),
    ("topk", topk_coder(10), _point, _topk_oracle),
    ("pseudocoreset", pseudocoreset_coder(2, 10), _pseudocoreset, _sample_oracle),
    ("klms-adaptive-bernoulli", klms_coder(_ADAPTIVE), _bernoulli, _klms_oracle(_ADAPTIVE)),
    ("klms-fixed-gaussian", klms_coder(_FIXED), _gauss, _klms_oracle(_FIXED)),
    ("klms-crc-signs", klms_coder(_CRC), _signs, _klms_oracle(_CRC)),
    ("klms-avg-bernoulli", klms_avg_coder(_AVG), _bernoulli, _klms_avg_oracle(_AVG)),
    ("klms-avg-update-crc-gaussian", klms_avg_coder(_AVG_UPDATE), _gauss, _klms_avg_oracle(_AVG_UPDATE)),
    (
        "cepam-gauss-A2",
        clip_update(lrsuq_coder(hexagonal(), GaussianNoise(0.05))),
        _point,
        _lrsuq_oracle(hexagonal(), GaussianNoise(0.05), 1.0),
    ),
    (
        "gauss+sdq",
        clip_update(
            additive_noise_coder(GaussianNoise(0.1), sdq_coder(integer_lattice(1, 0.01))), mode="clip"
        ),
        _point,
        _noisy_sdq_oracle(0.1, integer_lattice(1, 0.01)),
    ),
    (
        "elias+side",
        with_side_info(elias_coder(3), NUM_SIDE),
        _with_side(_levels),
        _side_oracle(_sample_oracle),
    ),
    (
        "klms+side-ternary",
        with_side_info(klms_coder(_ADAPTIVE), NUM_SIDE),
        _with_side(_ternary_levels),
        _side_oracle(_klms_oracle(_ADAPTIVE)),
    ),
    # with_crc on a stateless coder without a prior, and on a stateful coder that uses its prior and frames
    # its streams (CEPAM's Z^1 stream with the check: test_crc_detects_every_flipped_bit_..., slow)
    ("pseudocoreset+crc", with_crc(pseudocoreset_coder(2, 10)), _pseudocoreset, _sample_oracle),
    pytest.param(
        ("klms-adaptive+crc", with_crc(klms_coder(_ADAPTIVE)), _bernoulli, _klms_oracle(_ADAPTIVE)),
        marks=pytest.mark.slow,  # 6 s from an empty compilation cache: make test-all
    ),
]
IDS = [(c.values[0] if hasattr(c, "values") else c)[0] for c in CASES]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request):
    name, coder, make, oracle = request.param
    state = coder.init(DIM)
    encode = jax.jit(coder.encode)
    decode = jax.jit(coder.decode)
    return name, coder, make, oracle, state, encode, decode


def _encoded(case, seed, encode=None):
    """The case's ``q, p = make(seed)`` under keys ``_keys(seed)``, encoded with ``encode`` (by default the
    case's jitted encoder): returns ``keys, q, p, message, info``."""
    _, _, make, _, state, jit_encode, _ = case
    q, p = make(seed)
    keys = _keys(seed)
    message, info = (encode or jit_encode)(keys, q, p, state)
    return keys, q, p, message, info


def test_decode_reproduces_the_encoders_choice(case):
    _, coder, make, oracle, state, encode, decode = case
    keys, q, p, message, info = _encoded(case, 0)
    sample, decoded = decode(keys.shared, p, state, message)
    assert bool(decoded.valid) and int(decoded.errors) == 0
    assert bool(info.valid)
    # the oracle is another compiled program: integer and discrete values must match exactly, continuous
    # ones (Gaussian candidates through ndtri) to 4 ulp (another fusion may round differently); a wrong
    # candidate is off by far more than that
    expected = jax.jit(oracle)(keys, q, p, state)
    got, want = jax.tree.leaves(sample), jax.tree.leaves(expected)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), maxulp=4)


def test_num_bits_is_the_stream_length(case):
    _, coder, make, _, state, encode, decode = case
    keys, q, p, message, _ = _encoded(case, 1)
    nb = float(message.num_bits)
    assert nb > 0 and nb == int(nb)
    sent = sent_message(message)  # the host boundary: exactly the words sent (raises on set bits past nb)
    words = np.asarray(sent.payload)
    assert words.dtype == np.uint32 and words.shape == (sent_words(nb),)
    np.testing.assert_array_equal(words, np.asarray(message.payload)[: words.shape[0]])
    tail = int(nb) % 32
    if tail:
        assert int(words[-1]) >> tail == 0, "bits past num_bits are set"
    # the receiver decodes the exact words sent as it decodes the capacity buffer
    assert tree_equal(decode(keys.shared, p, state, sent), decode(keys.shared, p, state, message))
    # the same stream one bit shorter is not a clean message (fixed-width fields no longer add up, a
    # variable-length code ends mid-codeword, or a set bit falls past the end); the length keeps the encoder's
    # dtype, so the decoder compiled for the capacity buffer is reused (float lengths: tests/test_bits.py)
    short = message._replace(num_bits=message.num_bits - 1)
    _, decoded = decode(keys.shared, p, state, short)
    assert int(decoded.errors) != 0


def _leaves(tree):
    return [(np.shape(a), np.asarray(a).dtype, np.asarray(a)) for a in jax.tree.leaves(tree)]


def test_same_outputs_inside_and_outside_jit(case):
    """One behaviour (issue 28): ``encode``, ``decode`` and ``downlink`` called eagerly return what the
    jitted functions return, shapes included (the capacity buffer in both modes, no raising on a stream's
    flags in either). Values agree bit for bit, floats to 4 ulp (another fusion may round differently; so
    may the float32 scale the scaled-sign stream carries in its first word, a mean of ``|v|``)."""
    name, coder, make, _, state, encode, decode = case
    q, p = make(6)
    keys = _keys(6)
    eager = coder.encode(keys, q, p, state)
    jitted = encode(keys, q, p, state)
    # a stream one bit short: an invalid report, returned (not raised) in both modes
    short = eager[0]._replace(num_bits=eager[0].num_bits - 1)
    pairs = [
        (eager, jitted),
        (coder.decode(keys.shared, p, state, eager[0]), decode(keys.shared, p, state, jitted[0])),
        (coder.decode(keys.shared, p, state, short), decode(keys.shared, p, state, short)),
        (coder.downlink(state), jax.jit(coder.downlink)(state)),
    ]
    assert int(pairs[2][0][1].errors) != 0
    if name == "scaled-sign":  # the scale word as a float, the sign bits exactly
        (msg, info), (jmsg, jinfo) = pairs[0]
        as_float = lambda m: np.asarray(m.payload[:1]).view(np.float32)
        np.testing.assert_array_max_ulp(as_float(msg), as_float(jmsg), maxulp=4)
        pairs[0] = (
            (msg._replace(payload=msg.payload[1:]), info),
            (jmsg._replace(payload=jmsg.payload[1:]), jinfo),
        )
    for got, want in pairs:
        got, want = _leaves(got), _leaves(want)
        assert [(s, d) for s, d, _ in got] == [(s, d) for s, d, _ in want]
        for (_, dtype, a), (_, _, b) in zip(got, want, strict=True):
            if np.issubdtype(dtype, np.floating):
                assert np.array_equal(np.isnan(a), np.isnan(b))
                np.testing.assert_array_max_ulp(np.nan_to_num(a), np.nan_to_num(b), maxulp=4)
            else:
                np.testing.assert_array_equal(a, b)


def test_a_withheld_message_decodes_invalid(case):
    """What the encoder knows is wrong reaches the receiver (issue 28): a withheld message
    (:func:`sidejax.coding.withhold`, length -1: the sender's input was invalid and it sent no stream) is
    rejected by every decoder, and :func:`sidejax.coding.included` excludes it."""
    _, coder, make, _, state, encode, decode = case
    keys, q, p, message, _ = _encoded(case, 4)
    held = withhold(message, jnp.asarray(False))
    assert int(held.num_bits) == WITHHELD_BITS
    _, decoded = decode(keys.shared, p, state, held)
    assert not bool(decoded.valid) and int(decoded.errors) != 0
    sent = Message(jnp.stack([message.payload, held.payload]), jnp.stack([message.num_bits, held.num_bits]))
    np.testing.assert_array_equal(included(sent, jnp.asarray([True, True])), [True, False])


def test_outputs_finite(case):
    _, coder, make, _, state, encode, decode = case
    keys, q, p, message, _ = _encoded(case, 2)
    sample, _ = decode(keys.shared, p, state, message)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(sample))
    assert np.isfinite(float(message.num_bits))


def test_no_recompilation_on_a_second_call(case):
    _, coder, make, _, state, encode, decode = case
    sizes = []
    for seed in (3, 4):
        q, p = make(seed)
        keys = _keys(seed, client=seed)
        message, _ = encode(keys, q, p, state)
        decode(keys.shared, p, state, message)
        sizes.append((encode._cache_size(), decode._cache_size()))
    assert sizes[1] == sizes[0]  # the fixture's jitted functions are shared with the other tests


def test_decoder_cannot_see_q_or_the_private_key(case):
    _, coder, *_ = case
    assert list(inspect.signature(coder.decode).parameters) == ["shared_key", "p", "state", "message"]
    assert list(inspect.signature(coder.encode).parameters) == ["keys", "q", "p", "state"]


def test_protocol_state_round_trips_through_the_downlink(case):
    _, coder, make, _, state, encode, decode = case
    keys, q, p, message, _ = _encoded(case, 5)
    _, decoded = decode(keys.shared, p, state, message)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), decoded)
    new_state, _ = coder.update(state, stacked)
    # after the update round, twice: the first downlink carries a changed partition (KLMS), the second none.
    # The receivers know the protocol's flags but hold the partition of the round before: whatever is new
    # must come from the message. A stateful protocol's receiver keeps the flag it just received as
    # `changed` (whether the next downlink carries a partition), as the server's next state will.
    for _ in range(2):
        known, want = new_state, new_state
        if hasattr(state, "blocks"):  # KLMS: the partition
            known = new_state._replace(blocks=state.blocks)
        elif hasattr(state, "block_size"):  # KLMS-Avg: the block size
            known = new_state._replace(block_size=state.block_size)
        if hasattr(state, "changed"):
            want = new_state._replace(changed=new_state.update)
        received = coder.receive(known, coder.downlink(new_state))
        assert tree_equal(jax.tree.map(jnp.asarray, received), jax.tree.map(jnp.asarray, want))
        state = new_state
        new_state, _ = coder.update(new_state, stacked)


def _resized(tree, dim: int):
    """``tree`` (a case's ``q`` or ``p``) cut to its first ``dim`` coordinates (side information kept)."""
    return jax.tree.map(lambda a: a[:dim] if a.ndim and a.shape[0] == DIM else a, tree)


def test_declared_capacity_is_the_encoders_buffer(case):
    """``capacity_words(dim)`` is the payload ``encode`` returns inside jit, for several dims (17 and 83
    are K·D + K + 1 for the pseudocoreset's K = 2, and not multiples of 32), and bounds the words sent."""
    _, coder, make, _, state, encode, _ = case
    q, p = make(0)
    keys = _keys(0)
    for dim in (DIM, 17, 83):
        shape = jax.eval_shape(coder.encode, keys, _resized(q, dim), _resized(p, dim), coder.init(dim))
        assert shape[0].payload.shape == (coder.capacity_words(dim),), dim
    message, _ = encode(keys, q, p, state)
    assert message.payload.shape == (coder.capacity_words(DIM),)
    assert sent_words(int(message.num_bits)) <= coder.capacity_words(DIM)


def _fixed_sample(q, key):
    """``q``'s sample drawn with ``key`` as a point mass (side information kept)."""
    if type(q) is tuple:  # with_side_info's (q, side); a distribution is a NamedTuple
        return _fixed_sample(q[0], key), q[1]
    return PointMass(q.sample(key))


def test_declared_determinism_agrees_with_encoding_under_other_keys(case):
    """``deterministic``: a point mass gives the same message and the same decoded vector under any keys
    (and ``q`` enters only through its private-key sample); otherwise another shared key with the same
    private key changes the message or what it decodes to."""
    _, coder, make, _, state, encode, decode = case
    q, p = make(8)
    a, b = _keys(8), _keys(9, client=5)
    message, _ = encode(a, q, p, state)
    if coder.deterministic:
        point = _fixed_sample(q, a.private)
        for keys in (a, b):
            other, _ = encode(keys, point, p, state)
            assert tree_equal(other, message), keys
            x, _ = decode(keys.shared, p, state, other)
            y, _ = decode(a.shared, p, state, message)
            assert tree_equal(x, y)
    else:
        c = ClientKeys(b.shared, a.private)
        other, _ = encode(c, q, p, state)
        x, _ = decode(a.shared, p, state, message)
        y, _ = decode(c.shared, p, state, other)
        assert not (tree_equal(other, message) and tree_equal(x, y))


def test_declared_fixed_length_agrees_with_encoding_other_inputs_and_states(case):
    """``fixed_bits(dim)``: every message is that long, for other inputs, keys and after a protocol update;
    a coder that declares none writes messages of different lengths among the same."""
    _, coder, make, _, state, encode, decode = case
    q0, p = make(10)
    keys = _keys(10)
    message, _ = encode(keys, q0, p, state)
    _, decoded = decode(keys.shared, p, state, message)
    updated, _ = coder.update(state, jax.tree.map(lambda v: jnp.stack([v, v]), decoded))
    # three inputs, and one with every parameter scaled by 1/20 (sparser masks and levels, smaller
    # updates), each in the initial state and after an update round
    inputs = [make(seed)[0] for seed in (10, 11, 12)] + [jax.tree.map(lambda v: v / 20, q0)]
    lengths = set()
    for i, q in enumerate(inputs):
        for s in (state, updated):
            lengths.add(int(encode(_keys(10 + i, client=i), q, p, s)[0].num_bits))
    if coder.fixed_length:
        assert lengths == {coder.fixed_bits(DIM)}
    else:
        assert len(lengths) > 1, lengths


def test_only_wrappers_that_keep_a_prefix_message_pass_the_live_prefix_on():
    """``with_crc`` and ``with_side_info`` add a checksum or a header to the prefix's message and keep
    ``live_prefix``; ``clip_update`` normalises over the whole buffer, padding included, so its message is
    not the prefix's and it declares none (``wrap_coder`` passes it on only when asked)."""
    fixed = klms_coder(_FIXED)
    assert with_crc(fixed).live_prefix == fixed.live_prefix is not None
    assert with_side_info(fixed, 1).live_prefix == fixed.live_prefix
    assert clip_update(fixed).live_prefix is None


def test_live_prefix_codes_the_live_coordinates_alone_or_is_refused(case):
    """``Coder.live_prefix`` (issue 28): with ``live_prefix.init(DIM, live)`` and ``live`` traced (here 3
    blocks and one coordinate), a ``DIM``-coordinate input whose coordinates past ``live`` are padding
    (``q = p``) gives the message of the first ``live`` coordinates coded alone (``init(live)``): the same
    words and length (``fixed_bits(live)``, read back by ``frame``), in the buffer of
    ``capacity_words(DIM)``, decoded to the same values; ``init(DIM, DIM)`` is ``init(DIM)``, and
    ``with_crc`` keeps it. A coder that declares none is refused, naming the argument."""
    _, coder, make, _, state, _, _ = case
    if coder.live_prefix is None:
        with pytest.raises(
            ValueError, match=r"^downlink: coder .*first `live` coordinates.*live_prefix is None"
        ):
            check_live_prefix(coder, "downlink")
        return
    prefix = check_live_prefix(coder)
    assert with_crc(coder).live_prefix is prefix
    live = 3 * prefix.block + 1
    q, p = make(12)
    padded = jax.tree.map(lambda a, b: jnp.where(jnp.arange(DIM) < live, a, b), q, p)
    keys = _keys(12)

    @jax.jit
    def code(live):
        s = prefix.init(DIM, live)
        message, _ = coder.encode(keys, padded, p, s)
        sample, decoded = coder.decode(keys.shared, p, s, message)
        return message, sample, decoded, coder.frame(s, message.payload, 0)

    message, sample, decoded, framed = code(jnp.int32(live))
    alone = coder.init(live)
    want, _ = coder.encode(keys, _resized(q, live), _resized(p, live), alone)  # outside jit: the words sent
    want_sample, _ = coder.decode(keys.shared, _resized(p, live), alone, want)
    assert bool(decoded.valid)
    assert int(message.num_bits) == int(want.num_bits) == int(framed) == coder.fixed_bits(live)
    assert message.payload.shape == (coder.capacity_words(DIM),)
    np.testing.assert_array_equal(np.asarray(message.payload)[: want.payload.shape[0]], want.payload)
    np.testing.assert_array_max_ulp(np.asarray(sample)[:live], np.asarray(want_sample), maxulp=4)
    assert tree_equal(prefix.init(DIM, DIM), state)


def test_klms_live_prefix_is_fixed_mode_only_and_checks_a_known_count():
    with pytest.raises(ValueError, match="^live: adaptive KLMS"):
        klms_init(DIM, _ADAPTIVE, live=5)
    with pytest.raises(ValueError, match=r"^live must be in 1\.\.dim=203, got 204"):
        klms_init(DIM, _FIXED, live=DIM + 1)


def test_klms_downlink_length_matches_the_protocol():
    config = _ADAPTIVE
    coder = klms_coder(config)
    state = coder.init(DIM)
    q, p = _bernoulli(6)
    keys = _keys(6)
    message, _ = coder.encode(keys, q, p, state)
    _, decoded = coder.decode(keys.shared, p, state, message)
    new_state, _ = coder.update(state, jax.tree.map(lambda a: a[None], decoded))
    down = coder.downlink(new_state)
    m = int(new_state.blocks.num_blocks)
    assert bool(new_state.changed)
    assert float(down.num_bits) == 1 + m * config.length_bits
    assert np.asarray(block_sizes(new_state.blocks))[:m].sum() == DIM


def _flip_each_bit(message):
    """Every single-bit corruption of ``message`` (payload ``[num_bits, words]``, same lengths)."""
    nb = int(message.num_bits)
    words = jnp.asarray(message.payload)
    pos = jnp.arange(nb)
    bits = jnp.uint32(1) << (pos % 32).astype(jnp.uint32)
    flips = jnp.zeros((nb, words.shape[0]), jnp.uint32).at[pos, pos // 32].set(bits)
    return message._replace(payload=words[None] ^ flips, num_bits=jnp.full(nb, message.num_bits))


@pytest.mark.parametrize(
    "coder, make",
    [
        (pseudocoreset_coder(2, 10), _pseudocoreset),
        # 12 s and 7 s from an empty compilation cache (the lattice and KLMS decoders vmapped over every
        # flip, with and without the check): make test-all
        pytest.param(
            clip_update(lrsuq_coder(integer_lattice(1), GaussianNoise(0.05))), _point, marks=pytest.mark.slow
        ),
        pytest.param(klms_coder(_ADAPTIVE), _bernoulli, marks=pytest.mark.slow),
    ],
    ids=["pseudocoreset", "cepam-gauss-Z1", "klms-adaptive"],
)
def test_crc_detects_every_flipped_bit_a_wrong_key_and_a_drifted_prior(coder, make):
    """with_crc: each of the stream's bits flipped alone is reported (ERR_CRC or another error), where the
    unchecked coder decodes most of the same flips as clean messages; a stream decoded with another
    client's shared key, and (for a coder that uses its prior) against a prior off in one value, are
    reported too, at a cost of exactly 32 bits."""
    checked = with_crc(coder)
    state = coder.init(DIM)
    q, p = make(7)
    keys = _keys(7)
    plain, _ = coder.encode(keys, q, p, state)
    message, _ = checked.encode(keys, q, p, state)
    assert float(message.num_bits) == float(plain.num_bits) + 32
    decode_all = jax.jit(jax.vmap(checked.decode, (None, None, None, 0)))
    _, decoded = decode_all(keys.shared, p, state, _flip_each_bit(message))
    assert not np.any(np.asarray(decoded.valid))
    _, unchecked = jax.jit(jax.vmap(coder.decode, (None, None, None, 0)))(
        keys.shared, p, state, _flip_each_bit(plain)
    )
    assert np.mean(np.asarray(unchecked.valid)) > 0.5  # what the check is for
    _, other_key = checked.decode(_keys(7, client=4).shared, p, state, message)
    assert int(other_key.errors) & ERR_CRC
    if coder.uses_prior:
        drifted = jax.tree.map(lambda a: a.at[17].add(0.01), p)
        _, other_prior = checked.decode(keys.shared, drifted, state, message)
        assert int(other_prior.errors) & ERR_CRC
