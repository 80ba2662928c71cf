"""Local training: an Optax optimizer inside ``lax.scan`` over epochs and minibatch steps.

A client holds ``num_examples`` valid examples at the front of a padded index row of length
``max_examples`` (see :class:`sidejax.fl.ClientData`). One local epoch visits each valid example once, in a
fresh random order, in ``ceil(max_examples / batch_size)`` steps (a static number, so clients of different
sizes vmap together). A step's batch carries a mask; a client with fewer examples than ``max_examples`` runs
the same number of steps, and the steps whose batch holds no valid example leave parameters and optimizer
state unchanged. The last partial batch averages over its valid examples only.

The loss contract is ``loss_fn(params, batch, key) -> scalar``, where ``batch`` is a :class:`Batch` and the
loss is a masked mean (``sum(l * mask) / max(sum(mask), 1)``); :func:`classification_loss` builds one for a
Flax classifier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from sidejax.fl.base import Batch, ClientData
from sidejax.keys import ORDER, epoch_key, step_key, stream_key
from sidejax.types import Params, PRNGKey
from sidejax.utils import tree_all_finite

__all__ = [
    "LocalInfo",
    "epoch_order",
    "num_local_steps",
    "classification_loss",
    "masked_mean",
    "build_local_trainer",
]


class LocalInfo(NamedTuple):
    """Diagnostics of one client's local training.

    Attributes:
      loss: mean loss over the steps that had data.
      num_steps: number of steps that updated the parameters.
      finite: False if any loss or the final parameters are NaN/inf.
    """

    loss: jax.Array
    num_steps: jax.Array
    finite: jax.Array


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """``sum(values * mask) / max(sum(mask), 1)``: the mean over valid entries (0 when there are none).

    Padding entries contribute an exact zero (``where``, not a product), so which real example a padding
    slot points at cannot change the result.
    """
    valid = mask > 0
    return jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(jnp.sum(valid), 1).astype(values.dtype)


def classification_loss(apply_fn: Callable) -> Callable:
    """Masked softmax cross-entropy for a Flax classifier ``apply_fn({'params': p}, x, train=True)``."""

    def loss_fn(params: Params, batch: Batch, key: PRNGKey) -> jax.Array:
        del key
        logits = apply_fn({"params": params}, batch.x, train=True)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
        return masked_mean(ce, batch.mask)

    return loss_fn


def num_local_steps(max_examples: int, batch_size: int) -> int:
    """Steps per local epoch: ``ceil(max_examples / batch_size)``."""
    return -(-max_examples // batch_size)


def epoch_order(key: PRNGKey, num_examples: jax.Array, max_examples: int) -> jax.Array:
    """A uniformly random order of the valid positions ``0..num_examples-1``, padding positions last.

    Returns:
      int32 ``[max_examples]``: positions into the client's index row.
    """
    scores = jax.random.uniform(key, (max_examples,))
    scores = jnp.where(jnp.arange(max_examples) < num_examples, scores, 2.0)
    return jnp.argsort(scores).astype(jnp.int32)


def build_local_trainer(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    batch_size: int,
    num_epochs: int,
):
    """Builds ``train(key, params, data) -> (params, LocalInfo)``: local epochs of minibatch optimisation.

    The optimizer state is initialised inside ``train`` (fresh every round), so ``train`` vmaps over clients.

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> scalar`` (masked mean over ``batch.mask``).
      optimizer: any Optax gradient transformation (e.g. ``optax.sgd(0.05)``).
      batch_size: examples per step (static).
      num_epochs: local epochs (static).

    Returns:
      The pure training function. ``key`` is the client's training key (:func:`sidejax.keys.client_streams`);
      epoch ``e`` draws its order from ``stream_key(epoch_key(key, e), ORDER)`` and its step ``s`` passes
      ``step_key(epoch_key(key, e), s)`` to ``loss_fn`` (see :mod:`sidejax.keys`).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
    grad_fn = jax.value_and_grad(loss_fn)

    def train(key: PRNGKey, params: Params, data: ClientData) -> tuple[Params, LocalInfo]:
        max_examples = data.indices.shape[0]
        steps = num_local_steps(max_examples, batch_size)
        padded = steps * batch_size

        def epoch(carry, e):
            ekey = epoch_key(key, e)
            order = epoch_order(stream_key(ekey, ORDER), data.num_examples, max_examples)
            order = jnp.pad(order, (0, padded - max_examples))

            def step(carry, s):
                params, opt_state, loss_sum, n_steps, finite = carry
                pos = jax.lax.dynamic_slice_in_dim(order, s * batch_size, batch_size)
                valid = (s * batch_size + jnp.arange(batch_size)) < data.num_examples
                gidx = data.indices[pos]
                batch = Batch(x=data.x[gidx], y=data.y[gidx], mask=valid.astype(jnp.float32))
                loss, grads = grad_fn(params, batch, step_key(ekey, s))
                updates, new_opt = optimizer.update(grads, opt_state, params)
                new_params = optax.apply_updates(params, updates)
                has_data = jnp.any(valid)
                keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(has_data, a, b), new, old)
                params = keep(new_params, params)
                opt_state = keep(new_opt, opt_state)
                loss_sum = loss_sum + jnp.where(has_data, loss, 0.0)
                finite = finite & (jnp.isfinite(loss) | ~has_data)
                return (params, opt_state, loss_sum, n_steps + has_data.astype(jnp.int32), finite), None

            carry, _ = jax.lax.scan(step, carry, jnp.arange(steps))
            return carry, None

        init = (params, optimizer.init(params), jnp.float32(0.0), jnp.int32(0), jnp.asarray(True))
        (params, _, loss_sum, n_steps, finite), _ = jax.lax.scan(epoch, init, jnp.arange(num_epochs))
        finite = finite & tree_all_finite(params)
        loss = loss_sum / jnp.maximum(n_steps, 1).astype(jnp.float32)
        return params, LocalInfo(loss=loss, num_steps=n_steps, finite=finite)

    return train
