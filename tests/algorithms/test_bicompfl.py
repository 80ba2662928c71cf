"""BICompFL (sidejax.algorithms.bicompfl; docs/papers/bicompfl.md#s2-3, docs/papers/bicompfl.md#s3-3 to
docs/papers/bicompfl.md#s3-6, docs/papers/bicompfl.md#s7-9 to docs/papers/bicompfl.md#s7-16,
docs/papers/bicompfl.md#s7-21).

The protocol invariants are checked after every round of short runs on digits (a 2,778-parameter MLP, 10
clients, Fixed blocks of 128 with 16 candidates: the CPU profile of docs/papers/bicompfl.md#s2-3, 1/32 bit per
parameter per sample). Each algorithm runs one round per call of one compiled program, so its states can be
compared round by round.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_equal

from sidejax.algorithms.bicompfl import (
    CLIP,
    _downlink_encode,
    _group_of,
    bicompfl_downlink,
    bicompfl_gr,
    bicompfl_gr_reconst,
    bicompfl_pr,
    clip_table,
    decode_samples,
    encode_samples,
    fixed_rates,
    split_groups,
)
from sidejax.coding import (
    ERR_CRC,
    KLMSConfig,
    check_decoded,
    klms_coder,
    klms_init,
    mask_coder,
    with_side_info,
)
from sidejax.distributions import Bernoulli
from sidejax.fl import LocalTraining, run_rounds
from sidejax.keys import client_keys

N = 10
ROUNDS = 3
SPLIT_ROUNDS = 2  # the hybrid's downlinks of rounds 1 (split) and 2 (full) fall inside the ROUNDS run
FIXED = KLMSConfig(log2_num_candidates=4, adaptive=False, block_size=128)
ADAPTIVE = KLMSConfig(log2_num_candidates=4, block_size=128, max_block_size=256)
CRC = KLMSConfig(log2_num_candidates=4, adaptive=False, block_size=128, crc32=True)
# the downlink: the library's default, with the CRC-32, and without it (the paper's bit counts)
DOWN_CRC = bicompfl_downlink(128, 4)
DOWN = bicompfl_downlink(128, 4, crc32=False)


def _local():
    return LocalTraining(optax.adam(0.1), batch_size=32)


def _builders(loss):
    return {
        "gr": lambda: bicompfl_gr(loss, _local(), num_clients=N, coder=klms_coder(FIXED)),
        "gr_adaptive": lambda: bicompfl_gr(loss, _local(), num_clients=N, coder=klms_coder(ADAPTIVE)),
        "gr_reconst": lambda: bicompfl_gr_reconst(
            loss, _local(), num_clients=N, coder=klms_coder(FIXED), downlink=DOWN
        ),
        "pr_partial": lambda: bicompfl_pr(  # with the CRC (prior fingerprint) on both links
            loss, _local(), num_clients=N, clients_per_round=6, coder=klms_coder(CRC), downlink=DOWN_CRC
        ),
        "pr_split": lambda: bicompfl_pr(
            loss, _local(), num_clients=N, coder=klms_coder(FIXED), downlink=DOWN, split_downlink=True
        ),
        "pr_hybrid": lambda: bicompfl_pr(  # split downlinks while t < SPLIT_ROUNDS, then PR's
            loss,
            _local(),
            num_clients=N,
            coder=klms_coder(FIXED),
            downlink=DOWN,
            split_downlink=True,
            split_rounds=SPLIT_ROUNDS,
        ),
    }


@pytest.fixture(scope="module")
def runs(small_model, digits_fed):
    """``runs(name) -> (algo, states[ROUNDS + 1], infos[ROUNDS])``, one round per call (one compilation)."""
    _, params, loss = small_model
    builders = _builders(loss)
    cache = {}

    def run(name):
        if name not in cache:
            algo = builders[name]()
            states = [algo.init(jax.random.key(0), params, N)]
            infos = []
            for _ in range(ROUNDS):
                state, info = run_rounds(algo, jax.random.key(1), states[-1], digits_fed, 1, client_map="map")
                states.append(state)
                infos.append(jax.tree.map(lambda a: a[0], info))
            cache[name] = (algo, states, infos)
        return cache[name]

    return run


def _clean(infos):
    for info in infos:
        assert bool(np.all(np.asarray(info.clients.finite))) and bool(info.server_finite)
        assert bool(np.all(np.asarray(info.clients.valid)))
        np.testing.assert_array_equal(info.uplink_errors, 0)
        np.testing.assert_array_equal(info.clients.downlink_errors, 0)


def _on_grid(values, num_samples):
    return np.isin(np.asarray(values), clip_table(num_samples)).all()


# ----------------------------------------------------------------------------------------------------
# protocol invariants (docs/papers/bicompfl.md#s7-9 to docs/papers/bicompfl.md#s7-13)


@pytest.mark.parametrize("name", ["gr", "gr_adaptive"])
def test_gr_every_client_rebuilds_the_federators_model_bit_for_bit(runs, name):
    """docs/papers/bicompfl.md#s7-9: after every round every client's model (rebuilt from the relayed streams
    and its own, decoded against its own copy of the prior) equals the federator's, bit for bit, and so does
    every client's copy of the coder's protocol state (the adaptive partition is parsed from the relayed
    update-round streams)."""
    _, states, infos = runs(name)
    _clean(infos)
    for t in range(1, ROUNDS + 1):
        clients, server_before = states[t].clients, states[t - 1].server
        for j in range(N):
            assert np.array_equal(np.asarray(clients.theta[j]), np.asarray(server_before.theta)), (t, j)
            assert tree_equal(jax.tree.map(lambda a, j=j: a[j], clients.coder), server_before.coder), (t, j)
    assert not np.array_equal(np.asarray(states[2].server.theta), np.asarray(states[1].server.theta))
    for s in states[1:]:
        # c(k / n): every average lies on the clip grid (docs/papers/bicompfl.md#s7-13)
        assert _on_grid(s.server.theta, N)
    if name == "gr_adaptive":  # round 0 was an update round: each client sent its own partition
        assert int(states[1].server.coder.blocks.num_blocks) != int(states[0].server.coder.blocks.num_blocks)


def test_gr_reconst_clients_share_one_estimate_that_is_not_the_aggregate(runs):
    """docs/papers/bicompfl.md#s7-11: all clients hold the same estimate, equal to the federator's; it differs
    from theta_{t+1}."""
    _, states, infos = runs("gr_reconst")
    _clean(infos)
    for t in range(2, ROUNDS + 1):
        hats = np.asarray(states[t].clients.theta_hat)
        assert (hats == hats[0]).all()
        np.testing.assert_array_equal(hats[0], np.asarray(states[t].server.theta_hat))
        assert _on_grid(hats[0], N)
        assert not np.array_equal(hats[0], np.asarray(states[t - 1].server.theta))


@pytest.mark.parametrize("name", ["pr_partial", "pr_split"])
def test_pr_the_federators_copies_equal_the_clients_estimates(runs, name):
    """docs/papers/bicompfl.md#s7-10: the federator's copy of every client's estimate equals the client's own
    bit for bit after every round, for participants and for clients that sat the round out (partial
    participation: theirs is unchanged on both sides); the estimates differ across clients (zeta > 0)."""
    _, states, infos = runs(name)
    _clean(infos)
    for t in range(1, ROUNDS + 1):
        server, clients = states[t].server, states[t].clients
        np.testing.assert_array_equal(np.asarray(server.theta_hat), np.asarray(clients.theta_hat))
        if name == "pr_partial" and t >= 2:
            took_part = np.isin(np.arange(N), np.asarray(infos[t - 1].client_ids))
            prev = np.asarray(states[t - 1].clients.theta_hat)
            now = np.asarray(clients.theta_hat)
            assert (now[~took_part] == prev[~took_part]).all()
            assert all((now[i] != prev[i]).any() for i in np.flatnonzero(took_part))
    hats = np.asarray(states[ROUNDS].clients.theta_hat)
    assert (hats != hats[0]).any(axis=1).sum() >= N // 2
    assert ((hats >= CLIP) & (hats <= 1 - CLIP)).all() and np.isfinite(hats).all()


def test_splitdl_refreshes_exactly_its_rotating_group(runs, small_model):
    """docs/papers/bicompfl.md#s7-12: in round t client j's estimate changes only on the coordinates of group
    (j + t) mod n; the groups are block aligned, disjoint and cover every block, so every coordinate is
    refreshed within n rounds."""
    _, states, _ = runs("pr_split")
    d = states[0].server.theta.shape[0]
    b = FIXED.block_size
    num_blocks = -(-d // b)
    bounds = split_groups(num_blocks, N)
    assert bounds[0] == 0 and bounds[-1] == num_blocks and (np.diff(bounds) >= 1).all()
    covered = np.zeros(num_blocks, int)
    for g in range(N):
        covered[bounds[g] : bounds[g + 1]] += 1
    assert (covered == 1).all()  # a partition of the blocks
    for t in range(1, ROUNDS):  # the downlink at the start of round t refreshes group (j + t) mod n
        prev = np.asarray(states[t].clients.theta_hat)
        now = np.asarray(states[t + 1].clients.theta_hat)
        for j in range(N):
            g = (j + t) % N
            lo, hi = bounds[g] * b, min(bounds[g + 1] * b, d)
            changed = np.flatnonzero(now[j] != prev[j])
            assert changed.size > 0 and changed.min() >= lo and changed.max() < hi, (t, j)
    # the rotation visits every group for every client within n rounds
    for j in range(N):
        assert sorted((j + t) % N for t in range(N)) == list(range(N))


@pytest.mark.slow  # two programs agree bit for bit with XLA's default emitters only (Makefile)
def test_the_hybrid_splits_before_split_rounds_and_sends_prs_full_downlink_after(runs, small_model):
    """docs/papers/bicompfl.md#splitdl-hybrid: the downlink carrying theta_t is SplitDL's for
    t < split_rounds (the run equals the pure SplitDL run bit for bit, and exactly the group's coordinates
    change) and PR's from t = split_rounds on (the federator's messages and its new copies of the estimates
    equal ``bicompfl_pr``'s from the same state, bit for bit); each phase's downlink is its own variant's
    length, read from the messages."""
    _, params, loss = small_model
    hybrid_algo, hybrid, infos = runs("pr_hybrid")
    _, split, split_infos = runs("pr_split")
    _clean(infos)
    np.testing.assert_array_equal(np.asarray(hybrid[SPLIT_ROUNDS].server.round), SPLIT_ROUNDS)
    for t in range(SPLIT_ROUNDS):  # rounds 0 (nothing to send) and 1 (split)
        assert tree_equal(hybrid[t + 1], split[t + 1]), t
        assert tree_equal(infos[t], split_infos[t]), t
    d = hybrid[0].server.theta.shape[0]
    b = FIXED.block_size
    bounds = split_groups(-(-d // b), N) * b
    prev, now = (np.asarray(hybrid[t].clients.theta_hat) for t in (SPLIT_ROUNDS - 1, SPLIT_ROUNDS))
    for j in range(N):
        g = (j + SPLIT_ROUNDS - 1) % N
        changed = np.flatnonzero(now[j] != prev[j])
        assert changed.size > 0 and changed.min() >= bounds[g] and changed.max() < min(bounds[g + 1], d)
    # from round SPLIT_ROUNDS on: PR's downlink from the same state (any downlink key)
    pr = bicompfl_pr(loss, _local(), num_clients=N, coder=klms_coder(FIXED), downlink=DOWN)
    ids = jnp.arange(N)
    dkey = jax.random.key(11)
    server = hybrid[SPLIT_ROUNDS].server
    want, got = (jax.jit(a.broadcast)(dkey, server, ids) for a in (pr, hybrid_algo))
    assert tree_equal(got, want)
    refreshed = np.asarray(want[0].theta_hat) != np.asarray(server.theta_hat)
    assert refreshed.any(axis=0).mean() > 0.9  # the full downlink reaches (almost) every coordinate
    # the full round as run: the clients' estimates are the federator's copies (decoded from the messages)
    np.testing.assert_array_equal(
        np.asarray(hybrid[SPLIT_ROUNDS + 1].clients.theta_hat),
        np.asarray(hybrid[SPLIT_ROUNDS + 1].server.theta_hat),
    )
    want_rates = fixed_rates(d, num_clients=N, block_size=b, log2_num_candidates=4)
    for t, key in ((SPLIT_ROUNDS - 1, "pr_splitdl"), (SPLIT_ROUNDS, "pr")):
        got_bits = np.asarray(infos[t].downlink_bits)
        np.testing.assert_allclose(got_bits.mean() / d, want_rates[key]["downlink"], rtol=1e-6)
    # per client: n_DL samples of 4 bits per block of its group, then of every block
    sizes = np.diff(split_groups(-(-d // b), N))
    groups = (np.arange(N) + SPLIT_ROUNDS - 1) % N
    np.testing.assert_array_equal(np.asarray(infos[SPLIT_ROUNDS - 1].downlink_bits), N * 4 * sizes[groups])
    np.testing.assert_array_equal(np.asarray(infos[SPLIT_ROUNDS].downlink_bits), N * 4 * -(-d // b))


# ----------------------------------------------------------------------------------------------------
# bits: measured from the messages, equal to the Fixed formulas (docs/papers/bicompfl.md#s2-3,
# docs/papers/bicompfl.md#s7-15, docs/papers/bicompfl.md#s7-16)


def test_measured_rates_are_the_fixed_formulas(runs):
    """Uplink and downlink lengths read from the messages equal the formulas of docs/papers/bicompfl.md#s2-3
    at this d exactly (the first downlink, before any aggregate exists, is empty); GR's relay is (n - 1)
    uplinks, SplitDL's mean downlink is 1/n of PR's."""
    _, states, _ = runs("gr")
    d = states[0].server.theta.shape[0]
    want = fixed_rates(d, num_clients=N, block_size=128, log2_num_candidates=4)
    crc = 32 / d  # pr_partial runs with the CRC: 32 more bits per message (per downlink sample)
    cases = [
        ("gr", "gr", 0),
        ("gr_reconst", "gr_reconst", 0),
        ("pr_partial", "pr", crc),
        ("pr_split", "pr_splitdl", 0),
    ]
    for name, key, extra in cases:
        _, _, infos = runs(name)
        np.testing.assert_array_equal(np.asarray(infos[0].downlink_bits), 0.0)
        for info in infos:
            np.testing.assert_allclose(
                np.asarray(info.uplink_bits) / d, want[key]["uplink"] + extra, rtol=1e-6
            )
        for info in infos[1:]:
            np.testing.assert_allclose(
                np.asarray(info.downlink_bits).mean() / d, want[key]["downlink"] + N * extra, rtol=1e-6
            )
    assert want["pr_splitdl"]["bpp"] == pytest.approx(want["gr"]["bpp"] / 5, rel=0.02)


@pytest.mark.parametrize(
    "d,ul_256,ul_128",
    [(61_706, 0.031375, 0.031310), (1_933_258, 0.031251, None), (2_262_602, 0.031253, None)],
)
def test_fixed_formulas_give_the_spec_values(d, ul_256, ul_128):
    """docs/papers/bicompfl.md#s7-15 and docs/papers/bicompfl.md#s2-3: the exact uplink rates with ceil(d/b)
    blocks, and every variant within 2% of the table's 1/32-per-sample values (GR 0.3125, PR 0.34375, Reconst
    0.34375 with BC 0.0625, SplitDL 0.0625, GR BC 0.059375)."""
    r = fixed_rates(d, num_clients=10, block_size=256, log2_num_candidates=8)
    assert r["gr"]["uplink"] == pytest.approx(ul_256, abs=5e-7)
    if ul_128:
        r128 = fixed_rates(d, num_clients=10, block_size=128, log2_num_candidates=4)
        assert r128["gr"]["uplink"] == pytest.approx(ul_128, abs=5e-7)
    table = {
        "gr": (0.03125, 0.28125, 0.3125, 0.059375),
        "pr": (0.03125, 0.3125, 0.34375, 0.34375),
        "gr_reconst": (0.03125, 0.3125, 0.34375, 0.0625),
        "pr_splitdl": (0.03125, 0.03125, 0.0625, 0.0625),
    }
    for name, values in table.items():
        got = [r[name][k] for k in ("uplink", "downlink", "bpp", "bc")]
        np.testing.assert_allclose(got, values, rtol=0.02, err_msg=name)


def test_a_run_is_deterministic_including_the_bit_log(runs, digits_fed):
    """docs/papers/bicompfl.md#s7-21: the same seeds give the same states and the same bit log."""
    algo, states, infos = runs("gr_adaptive")
    again, info = run_rounds(algo, jax.random.key(1), states[0], digits_fed, 1, client_map="map")
    assert tree_equal(again, states[1])
    assert tree_equal(jax.tree.map(lambda a: a[0], info), infos[0])


# ----------------------------------------------------------------------------------------------------
# bad input


def test_a_party_whose_prior_is_out_of_sync_is_detected(runs, digits_fed):
    """With the CRC (which covers a fingerprint of the prior; the default downlink has it) a client whose
    estimate differs from the federator's copy in one coordinate, by one ulp, is caught: on the downlink by
    the client (its estimate is then overwritten by the refresh) and, in round 0 when no downlink precedes
    the uplink, by the federator. Without the CRC both would decode silently to garbage."""
    algo, states, _ = runs("pr_partial")

    def corrupt(state, client):
        hats = state.clients.theta_hat
        bad = hats.at[client, 5].set(jnp.nextafter(hats[client, 5], 1.0))
        return state._replace(clients=state.clients._replace(theta_hat=bad))

    for t, link in ((0, "uplink"), (2, "downlink")):
        client = int(
            np.asarray(run_rounds(algo, jax.random.key(1), states[t], digits_fed, 1)[1].client_ids)[0, 1]
        )
        _, info = run_rounds(
            algo, jax.random.key(1), corrupt(states[t], client), digits_fed, 1, client_map="map"
        )
        ids = np.asarray(info.client_ids[0])
        errors = info.uplink_errors[0] if link == "uplink" else info.clients.downlink_errors[0]
        errors = np.asarray(errors)
        slot = int(np.flatnonzero(ids == client)[0])
        assert errors[slot] & ERR_CRC, link
        assert (np.delete(errors, slot) == 0).all(), link


def test_the_default_downlink_carries_the_crc():
    """The library's downlink coder checks the priors by default (issue 28): every message ends in the
    CRC-32, 32 bits more than the paper's unchecked one; a group is coded as a live prefix of its blocks."""
    d = 2778
    assert DOWN_CRC.fixed_bits(d) == DOWN.fixed_bits(d) + 32 == 22 * 4 + 32
    assert DOWN_CRC.live_prefix.block == DOWN.live_prefix.block == 128


def test_a_splitdl_group_codes_only_its_own_coordinates():
    """A group narrower than the widest one is coded in a buffer whose last live block runs into the next
    group; there the target is the prior (q = p), so the message and the receiver's refreshed prior do not
    depend on the target outside the group, and the prior outside it is unchanged."""
    down = bicompfl_downlink(4, 3, crc32=False)
    dim, groups = 4 * 7, 3  # 7 blocks in groups of 2, 2, 3: groups 0 and 1 are one block narrower
    keys = client_keys(jax.random.key(5), 1)
    u = jax.random.uniform(jax.random.key(7), (2, dim), minval=0.05, maxval=0.95)
    target, prior = u[0], u[1]
    group = _group_of(down, dim, groups, 0)
    assert group.width == 12 and int(group.length) == 8
    other = target.at[8:].set(1.0 - target[8:])  # the target changed outside group 0 only
    a = _downlink_encode(down, 2, keys, target, prior, group)
    b = _downlink_encode(down, 2, keys, other, prior, group)
    assert tree_equal(a, b)
    np.testing.assert_array_equal(a[1][8:], prior[8:])
    assert int(a[2]) == 0


def test_the_host_boundary_raises_on_a_mismatched_prior_or_a_partition_for_another_model():

    coder = klms_coder(CRC)
    d = 40
    state = klms_init(d, CRC)
    keys = client_keys(jax.random.key(0), 2)
    q, p = Bernoulli(jnp.full(d, 0.7)), Bernoulli(jnp.full(d, 0.4))
    msg, _ = jax.jit(encode_samples, static_argnums=(0, 5))(coder, keys, q, p, state, 1)
    cap = CRC.capacity_words(d)
    samples, _, errors = decode_samples(coder, keys.shared, p, state, msg, 1, cap)
    assert int(errors) == 0 and samples.shape == (1, d)
    # decode_samples flags (never raises on the stream, eagerly as in jit); check_decoded raises on the flag
    _, _, off = decode_samples(coder, keys.shared, Bernoulli(jnp.full(d, 0.41)), state, msg, 1, cap)
    with pytest.raises(
        ValueError, match="invalid stream of importance samples: .*prior differs from the sender's"
    ):
        check_decoded(off, "stream of importance samples")
    with pytest.raises(ValueError, match="blocks were built for"):  # a block allocation for another model
        decode_samples(coder, keys.shared, p, klms_init(d + 1, CRC), msg, 1, cap)


def test_builders_reject_bad_settings(small_model):
    _, params, loss = small_model
    local = _local()
    with pytest.raises(ValueError, match="ignores p"):
        bicompfl_gr(loss, local, num_clients=N, coder=mask_coder())
    with pytest.raises(ValueError, match="self-delimiting"):
        bicompfl_gr(loss, local, num_clients=N, coder=with_side_info(klms_coder(FIXED), 1))
    # the downlink is a Coder that uses p, frames its streams and codes a group (Coder.live_prefix): an
    # adaptive KLMS partition follows the whole vector's KL, so it is refused
    with pytest.raises(ValueError, match=r"downlink: coder 'klms' .*live_prefix is None"):
        bicompfl_pr(loss, local, num_clients=N, coder=klms_coder(FIXED), downlink=klms_coder(ADAPTIVE))
    with pytest.raises(
        ValueError, match="downlink: coder 'golomb-mask' must code against the receiver's prior"
    ):
        bicompfl_gr_reconst(loss, local, num_clients=N, coder=klms_coder(FIXED), downlink=mask_coder())
    with pytest.raises(TypeError, match="downlink must be a sidejax.coding.Coder"):
        bicompfl_pr(loss, local, num_clients=N, coder=klms_coder(FIXED), downlink=FIXED)
    with pytest.raises(ValueError, match="clients_per_round"):
        bicompfl_pr(loss, local, num_clients=N, coder=klms_coder(FIXED), downlink=DOWN, clients_per_round=11)
    with pytest.raises(ValueError, match="num_uplink_samples"):
        bicompfl_gr(loss, local, num_clients=N, coder=klms_coder(FIXED), num_uplink_samples=0)
    gr = bicompfl_gr(loss, local, num_clients=N, coder=klms_coder(FIXED))
    with pytest.raises(ValueError, match="built for num_clients=10"):  # GR needs every client every round
        gr.init(jax.random.key(0), params, 12)
    pr = dict(num_clients=N, coder=klms_coder(FIXED), downlink=DOWN)
    with pytest.raises(ValueError, match="split_rounds=5 .* needs split_downlink=True"):
        bicompfl_pr(loss, local, split_rounds=5, **pr)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="split_rounds must be an integer >= 1"):
            bicompfl_pr(loss, local, split_downlink=True, split_rounds=bad, **pr)
    with pytest.raises(ValueError, match="num_groups <= num_blocks"):
        split_groups(3, 10)
    with pytest.raises(ValueError, match="power of two"):
        KLMSConfig(log2_num_candidates=4, adaptive=False, block_size=128, max_block_size=100)
