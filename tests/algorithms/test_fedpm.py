"""FedPM and FedPM-KLMS (sidejax.algorithms.fedpm; docs/papers/klms.md#s4-1, docs/papers/klms.md#s7-14,
docs/papers/klms.md#s7-19)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_clients_rebuild_the_server, klms_uplink_bits_per_coordinate, tree_equal

from sidejax.algorithms import bayes_agg, bernoulli_mask, signed_constant_init
from sidejax.fl import run_rounds
from sidejax.layout import flat_layout


def test_bayes_agg_reset_is_the_mean_and_without_reset_counts_accumulate():
    masks = jnp.array([[0.99, 0.01, 0.99], [0.99, 0.99, 0.01]])
    ones = jnp.ones(3)
    a, b, theta = bayes_agg(ones, ones, masks, reset=True)
    np.testing.assert_allclose(np.asarray(theta), np.asarray(masks.mean(0)), rtol=1e-6)
    a2, b2, theta2 = bayes_agg(a, b, masks, reset=False)
    np.testing.assert_allclose(np.asarray(a2), 1 + 2 * np.asarray(masks.sum(0)), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(theta2), (np.asarray(a2) - 1) / (np.asarray(a2 + b2) - 2), rtol=1e-6
    )


def test_signed_constant_init_uses_fan_in():
    params = {
        "Dense_0": {"kernel": jnp.zeros((8, 4)), "bias": jnp.zeros(4)},
        "Conv_0": {"kernel": jnp.zeros((3, 3, 2, 5))},
    }
    w = signed_constant_init(jax.random.key(0), params)
    np.testing.assert_allclose(np.abs(np.asarray(w["Dense_0"]["kernel"])), math.e / math.sqrt(8), rtol=1e-6)
    np.testing.assert_allclose(np.abs(np.asarray(w["Dense_0"]["bias"])), math.e / math.sqrt(8), rtol=1e-6)
    np.testing.assert_allclose(np.abs(np.asarray(w["Conv_0"]["kernel"])), math.e / math.sqrt(18), rtol=1e-6)
    assert 0.3 < float(jnp.mean(w["Dense_0"]["kernel"] > 0)) < 0.7


def test_mask_gradient_wrt_scores_is_the_fedpm_rule():
    """docs/papers/bicompfl.md#s7-18: through m = bernoulli_mask(sigmoid(s), u), d loss / d s equals
    dL/dm * theta^2 * (1 - theta) with FedPM's estimator (dL/dtheta = theta dL/dm, times the sigmoid's
    theta (1 - theta)), and dL/dm * theta (1 - theta) with the identity straight-through estimator; shown on
    a tiny linear softmax model whose frozen weights w are masked (the FedPM client's construction)."""
    x = jax.random.normal(jax.random.key(1), (5, 3))
    labels = jnp.array([0, 1, 1, 0, 1])
    w = signed_constant_init(jax.random.key(2), {"kernel": jnp.zeros((3, 2)), "bias": jnp.zeros(2)})
    scores = {"kernel": jax.random.normal(jax.random.key(3), (3, 2)), "bias": jnp.array([0.4, -1.1])}
    u = {"kernel": jax.random.uniform(jax.random.key(4), (3, 2)), "bias": jnp.array([0.2, 0.9])}

    def loss_of_net(net):
        logits = x @ net["kernel"] + net["bias"]
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(5), labels])

    theta = jax.tree.map(jax.nn.sigmoid, scores)
    mask = jax.tree.map(lambda t, v: (v < t).astype(jnp.float32), theta, u)
    assert 0 < sum(float(jnp.sum(m)) for m in jax.tree.leaves(mask)) < 8  # both mask values occur
    # each gradient one compiled program (op by op, they compiled a kernel per primitive and shape)
    dl_dm = jax.jit(jax.grad(lambda m: loss_of_net(jax.tree.map(jnp.multiply, w, m))))(mask)
    for estimator, power in (("fedpm", 2), ("ste", 1)):

        def loss_of_scores(s, estimator=estimator):
            net = jax.tree.map(
                lambda w_, s_, v: w_ * bernoulli_mask(jax.nn.sigmoid(s_), v, estimator), w, s, u
            )
            return loss_of_net(net)

        grads = jax.jit(jax.grad(loss_of_scores))(scores)
        for k in scores:
            expected = dl_dm[k] * theta[k] ** power * (1 - theta[k])
            np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(expected), rtol=1e-6, atol=0)
            assert np.all(np.asarray(expected) != 0)  # every coordinate gets a gradient, masked or not


def test_fedpm_and_fedpm_klms_run_clean_and_klms_sends_fewer_bits(algorithm_run, small_model):
    klms_uplink_bits_per_coordinate(algorithm_run, flat_layout(small_model[1]).dim, "fedpm")


def test_a_whole_run_is_deterministic_including_the_bit_log(algorithm_run, digits_fed):
    algo, state, final, infos = algorithm_run("fedpm_klms")
    final2, infos2 = run_rounds(algo, jax.random.key(1), state, digits_fed, 3, client_map="map")
    assert tree_equal(final, final2)
    assert tree_equal(infos, infos2)
    # and the KLMS messages decode to masks that BayesAgg turns into the new theta
    assert (
        float(jnp.min(final.server.theta)) >= 0.01 - 1e-7
        and float(jnp.max(final.server.theta)) <= 0.99 + 1e-7
    )


def test_clients_decode_theta_and_the_protocol_state_from_the_downlink(algorithm_run):
    """FedPM's downlink is theta as float32, then the coder's protocol stream; a client that knows only the
    frozen weights, the evaluation uniforms and the protocol's earlier flags rebuilds the server state
    exactly: after an update round the partition comes from the stream, otherwise the client keeps its own."""
    algo, _, final, _ = algorithm_run("fedpm_klms")
    server = final.server
    client_view = lambda sent, coder: sent._replace(theta=jnp.zeros_like(sent.theta), coder=coder)
    assert_clients_rebuild_the_server(algo, server, server.theta.shape[0], client_view)


def test_the_update_flag_survives_a_downlink_past_two_to_the_24_bits():
    """FedPM's downlink is the mask probabilities as float32, then the KLMS protocol stream (the update flag
    first). At 600,000 coordinates the flag sits past bit 2**24: the clients must still read it (with float32
    message lengths they read 0, then encoded a round the server decoded as an update round: every stream of
    the CIFAR-10 CONV6 preset's first round was invalid)."""
    from sidejax.algorithms.dense import receive_vector, vector_downlink
    from sidejax.coding import klms_coder
    from sidejax.coding.klms import KLMSConfig

    dim = 600_000
    coder = klms_coder(KLMSConfig(log2_num_candidates=2, block_size=8, max_block_size=256))

    @jax.jit  # one program (op by op, the 600,000-coordinate init and downlink compiled 84 kernels: 4 s)
    def send_and_receive(theta):
        state = coder.init(dim)  # adaptive: round 0 is an update round
        stale = state._replace(update=jnp.asarray(False))
        message = vector_downlink(theta, coder, state)
        return state, message, receive_vector(message, dim, coder, stale)

    theta = jnp.full((dim,), 0.5, jnp.float32)
    state, message, (received, _, cstate) = send_and_receive(theta)
    assert bool(state.update)
    assert int(message.num_bits) == 32 * dim + 1
    assert bool(cstate.update)
    np.testing.assert_array_equal(np.asarray(received), np.asarray(theta))
