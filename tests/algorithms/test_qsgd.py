"""QSGD and QSGD-KLMS (sidejax.algorithms.qsgd; docs/papers/klms.md#s4-3, docs/papers/klms.md#s7-13)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SMALL_KLMS, abstract_params, klms_uplink_bits_per_coordinate

from sidejax.algorithms import qsgd, qsgd_dequantize, qsgd_elias_bound_bits, qsgd_law, qsgd_quantize
from sidejax.algorithms.qsgd import initial_symbol_prior, symbol_prior
from sidejax.coding import elias_coder, klms_coder, sent_message, with_side_info
from sidejax.distributions import StochasticLevels, Ternary
from sidejax.fl import LocalTraining
from sidejax.keys import client_keys
from sidejax.layout import flat_layout


def test_qsgd_is_unbiased_and_symbol_law_sums_to_one():
    layout = flat_layout({"a": jnp.zeros(6), "b": jnp.zeros(4)})
    v = jnp.array([0.3, -1.2, 0.0, 2.0, -0.1, 0.7, 5.0, -3.0, 0.2, 1.0])
    n = 20000
    for s in (1, 2):
        signed, norms = jax.vmap(lambda k, s=s: qsgd_quantize(k, v, layout, s))(
            jax.random.split(jax.random.key(0), n)
        )
        vhat = jax.vmap(lambda a, b, s=s: qsgd_dequantize(a, b, layout, s))(signed, norms)
        mean = np.asarray(vhat.mean(0))
        se = np.asarray(vhat.std(0)) / math.sqrt(n) + 1e-9
        assert np.all(np.abs(mean - np.asarray(v)) <= 5 * se), (s, mean)
    law, norms = qsgd_law(v, layout, 1)  # s = 1: the symbol law that QSGD-KLMS codes (eq. 5)
    q = law.as_ternary()
    np.testing.assert_allclose(np.asarray(q.probs.sum(-1)), 1.0, atol=1e-6)
    assert float(jnp.min(q.probs)) >= 0.0
    np.testing.assert_allclose(np.asarray(norms), [np.linalg.norm(v[:6]), np.linalg.norm(v[6:])], rtol=1e-6)
    # E[symbol] = P(+1) - P(-1) = v_i / n_l(i): the same unbiased quantiser
    expect = np.asarray(v) / np.repeat(np.asarray(norms), [6, 4])
    np.testing.assert_allclose(np.asarray(q.probs[:, 2] - q.probs[:, 0]), expect, rtol=1e-6, atol=1e-7)


def test_qsgd_elias_bound_reproduces_the_papers_bug():
    """docs/papers/klms.md#s4-3: per-tensor CONV6 accounting gives 0.0722 / 0.1399 bpp with the reference
    code's precedence bug (Table 8's QSGD numbers) and 0.029 / 0.053 bpp with the correct bound."""
    from sidejax.models import get_model

    spec = get_model("conv6", num_classes=10, input_shape=(32, 32, 3))
    # only the tensors' sizes count: zeros of the parameters' shapes, not a compiled initialisation (4 s)
    layout = flat_layout(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract_params(spec)))
    d = layout.dim
    got = {
        (s, pc): qsgd_elias_bound_bits(s, layout.tensor_sizes, paper_compat=pc) / d
        for s in (1, 2)
        for pc in (True, False)
    }
    assert got[(1, True)] == pytest.approx(0.0722, abs=5e-4)
    assert got[(2, True)] == pytest.approx(0.1399, abs=5e-4)
    assert got[(1, False)] == pytest.approx(0.029, abs=1e-3)
    assert got[(2, False)] == pytest.approx(0.053, abs=1e-3)


@pytest.mark.slow  # 11 s from an empty compilation cache; the Elias stream's contract is in test_coders
def test_qsgd_message_length_by_hand():
    """QSGD's message (the coder qsgd builds: ``with_side_info(elias_coder(s), num_tensors)``): the per-tensor
    norms as float32, then the Elias stream of the levels with gaps over the whole flat vector (gamma(gap),
    a sign bit, gamma(|level|) per nonzero), and it decodes back exactly."""
    layout = flat_layout({"a": jnp.zeros(6), "b": jnp.zeros(3)})
    levels = jnp.array([0, 2, 0, 0, -1, 0, 0, 0, 5], jnp.float32)
    norms = jnp.array([1.5, 0.25], jnp.float32)
    # nonzeros at 1, 4, 8: gaps 2 (3 bits), 3 (3 bits), 4 (5 bits); levels 2 (3 bits), 1 (1 bit), 5 (5 bits);
    # 3 sign bits; 2 norms of 32 bits
    expected = (3 + 3 + 5) + (3 + 1 + 5) + 3 + 2 * 32
    coder = with_side_info(elias_coder(5), layout.num_tensors)
    keys = client_keys(jax.random.key(0), 0)
    state = coder.init(layout.dim)
    msg, info = coder.encode(keys, (StochasticLevels(levels), norms), None, state)  # integer levels: exact
    assert bool(info.valid) and float(msg.num_bits) == expected
    assert msg.payload.shape == (coder.capacity_words(layout.dim),)  # the capacity buffer, as in jit
    msg = sent_message(msg)  # the host boundary: exactly the words sent
    assert msg.payload.shape == (-(-expected // 32),)
    p = Ternary(jnp.full((layout.dim, 3), 1 / 3))  # the receiver's p (the decoder reads the length from it)
    (got, got_norms), decoded = coder.decode(keys.shared, p, state, msg)
    assert bool(decoded.valid) and int(decoded.errors) == 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(levels))
    np.testing.assert_array_equal(np.asarray(got_norms), np.asarray(norms))


def test_qsgd_klms_requires_one_level(small_model):
    with pytest.raises(ValueError, match="s = 1"):
        qsgd(
            small_model[2],
            LocalTraining(optax.sgd(0.1), batch_size=8),
            clients_per_round=2,
            levels=2,
            coder=klms_coder(SMALL_KLMS),
        )


def test_qsgd_and_qsgd_klms_run_clean_and_klms_sends_fewer_bits(algorithm_run, small_model):
    klms_uplink_bits_per_coordinate(algorithm_run, flat_layout(small_model[1]).dim, "qsgd")


def test_ternary_prior_has_full_support_after_a_round(algorithm_run):
    """QSGD-KLMS's p is rebuilt every round from the last round's symbol counts (5 clients); before any round
    it is the per-tensor initial law. Both have full support (a zero would make the KL infinite)."""
    _, state0, final, _ = algorithm_run("qsgd_klms")
    layout = flat_layout(final.server.params)
    counts = np.asarray(final.server.prior.counts)
    assert bool(final.server.prior.history) and not bool(state0.server.prior.history)
    assert counts.shape == (layout.dim, 2) and counts.min() >= 0 and counts.sum(-1).max() <= 5
    assert counts.sum() > 0  # the clients sent nonzero symbols
    for prior in (
        np.asarray(symbol_prior(jnp.asarray(counts), 5, layout, 1.0)),
        initial_symbol_prior(layout),
    ):
        prior = np.asarray(prior)
        assert prior.min() > 0 and np.allclose(prior.sum(-1), 1, atol=1e-5)
        kl = Ternary(jnp.asarray(prior)).kl_bits(Ternary(jnp.asarray(prior)))
        assert float(jnp.max(jnp.abs(kl))) < 1e-5
