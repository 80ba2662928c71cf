"""FedAvg (sidejax.algorithms.fedavg): exact against centralised SGD, real message lengths, local steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import BASE
from jax.flatten_util import ravel_pytree

from sidejax.algorithms import fedavg
from sidejax.coding import decode_float32, encode_float32
from sidejax.data import make_federated_data
from sidejax.fl import Batch, LocalTraining, build_round_step, epoch_order
from sidejax.keys import ORDER, client_keys, client_streams, epoch_key, round_key, stream_key


def test_fedavg_one_client_one_step_equals_centralized_sgd(small_model, digits):
    spec, params, loss = small_model
    train, _ = digits
    x, y = train.x[:64], train.y[:64]
    fed = make_federated_data(x, y, [np.arange(64)])
    lr = 0.3
    algo = fedavg(loss, LocalTraining(optax.sgd(lr), batch_size=64, num_epochs=1), clients_per_round=1)
    state = algo.init(BASE, params, 1)
    new_state, info = jax.jit(build_round_step(algo))(round_key(BASE, 0), state, fed)

    # The same step, centrally: one SGD step on the full batch, in the client's epoch order.
    keys = client_keys(round_key(BASE, 0), 0)
    ekey = epoch_key(client_streams(keys.private).train, 0)
    order = epoch_order(stream_key(ekey, ORDER), jnp.int32(64), 64)
    batch = Batch(jnp.asarray(x)[order], jnp.asarray(y)[order], jnp.ones(64))
    grads = jax.jit(jax.grad(loss))(params, batch, None)
    expected = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a - lr * b, p, g))(params, grads)
    # Two differently compiled programs (the round, and a separate grad + update): equal to a few ULP, not bit
    # for bit (on another machine of the same kind: 1-3 ULP on 9 of 2,778 weights; 0 on this one).
    for got, want in zip(jax.tree.leaves(new_state.server.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_max_ulp(np.asarray(got), np.asarray(want), maxulp=8)
    assert int(info.clients.extra[0]) == 1  # exactly one local step


def test_bits_are_message_lengths(fedavg_ten_rounds, small_model):
    _, params, _ = small_model
    d = ravel_pytree(params)[0].size
    _, (_, info) = fedavg_ten_rounds
    assert info.uplink_bits.shape == (10, 4)
    np.testing.assert_array_equal(info.uplink_bits, 32.0 * d)
    np.testing.assert_array_equal(info.downlink_bits, 32.0 * d)
    np.testing.assert_array_equal(info.uplink_errors, 0)  # every float32 stream decoded well formed
    assert np.asarray(info.clients.valid).all()
    x = jax.random.normal(jax.random.key(1), (37,))
    msg = encode_float32(x)
    assert msg.payload.dtype == jnp.uint32 and float(msg.num_bits) == 37 * 32
    np.testing.assert_array_equal(decode_float32(msg), x)


def test_participants_unequal_sizes_take_their_own_number_of_steps(fedavg_ten_rounds, digits_fed):
    _, (_, info) = fedavg_ten_rounds
    counts = np.asarray(digits_fed.num_examples)
    ids = np.asarray(info.client_ids)
    steps = np.asarray(info.clients.extra)
    np.testing.assert_array_equal(steps, -(-counts[ids] // 16))
    assert len(set(counts.tolist())) > 1  # the fixture really has unequal clients


def test_builder_argument_errors(small_model):
    _, _, loss = small_model
    with pytest.raises(ValueError, match="batch_size"):
        fedavg(loss, LocalTraining(optax.sgd(0.1), batch_size=0), clients_per_round=2)
    with pytest.raises(ValueError, match="exactly one of num_epochs and num_steps"):
        fedavg(
            loss, LocalTraining(optax.sgd(0.1), batch_size=4, num_epochs=1, num_steps=3), clients_per_round=2
        )
    with pytest.raises(ValueError, match="clients_per_round"):  # checked when the round is built
        build_round_step(fedavg(loss, LocalTraining(optax.sgd(0.1), batch_size=4), clients_per_round=0))
