"""Local training (sidejax.fl.local): padding cannot change a client's training; epoch orders."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import tree_equal

from sidejax.fl import ClientData, build_local_trainer, epoch_order, num_local_steps


def test_padding_target_does_not_change_local_training(small_model, digits):
    """Padding slots point at real examples; which one must not matter (exact zero contribution)."""
    _, params, loss = small_model
    train, _ = digits
    x, y = jnp.asarray(train.x[:40]), jnp.asarray(train.y[:40])
    trainer = jax.jit(build_local_trainer(loss, optax.sgd(0.1), batch_size=8, num_epochs=2))
    idx_a = jnp.concatenate([jnp.arange(30), jnp.zeros(10, jnp.int32)])
    idx_b = jnp.concatenate([jnp.arange(30), jnp.full(10, 35, jnp.int32)])
    pa, ia = trainer(jax.random.key(5), params, ClientData(x, y, idx_a, jnp.int32(30)))
    pb, ib = trainer(jax.random.key(5), params, ClientData(x, y, idx_b, jnp.int32(30)))
    assert tree_equal(pa, pb)
    assert int(ia.num_steps) == 2 * num_local_steps(30, 8)


def test_epoch_order_is_a_permutation_of_valid_positions():
    order = np.asarray(epoch_order(jax.random.key(0), jnp.int32(7), 12))
    assert sorted(order[:7].tolist()) == list(range(7))
    assert sorted(order[7:].tolist()) == list(range(7, 12))
