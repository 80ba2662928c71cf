"""Local training: an Optax optimizer inside ``lax.scan`` over epochs and minibatch steps (a number of
epochs, or a number of steps of the same epoch schedule).

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
from jax.flatten_util import ravel_pytree

from sidejax.fl.base import Batch, ClientData
from sidejax.keys import ORDER, epoch_key, step_key, stream_key
from sidejax.types import Params, PRNGKey
from sidejax.utils import check_count, tree_all_finite

__all__ = [
    "LocalInfo",
    "epoch_order",
    "num_local_steps",
    "classification_loss",
    "masked_mean",
    "build_local_trainer",
    "build_sampling_trainer",
    "schedule_batches",
    "LocalTraining",
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
    num_epochs: int | None = None,
    num_steps: int | None = None,
):
    """Builds ``train(key, params, data) -> (params, LocalInfo)``: local minibatch optimisation for a number
    of epochs or a number of steps.

    The optimizer state is initialised inside ``train`` (fresh every round), so ``train`` vmaps over clients.

    Schedule: an epoch has ``steps_per_epoch = ceil(max_examples / batch_size)`` steps
    (:func:`num_local_steps`, static). Epoch ``e`` visits the client's examples in the order drawn from
    ``stream_key(epoch_key(key, e), ORDER)`` (:func:`epoch_order`), and its step ``s`` takes the batch at
    positions ``s·batch_size ..`` of that order and passes ``step_key(epoch_key(key, e), s)`` to ``loss_fn``
    (see :mod:`sidejax.keys`). With ``num_steps = N``, global step ``t = 0..N-1`` is step
    ``t mod steps_per_epoch`` of epoch ``t // steps_per_epoch``, with exactly those keys: the first ``N``
    steps of the epoch schedule, so ``num_steps = k · steps_per_epoch`` is ``num_epochs = k`` (the same
    program, bit for bit), and any other ``N`` ends inside a partial epoch. As in an epoch, a step whose
    batch holds no valid example (a client smaller than ``max_examples``) leaves parameters and optimizer
    state unchanged, so such a client makes fewer than ``N`` updates (``LocalInfo.num_steps`` counts them).

    Implementation: ``lax.scan`` over the ``N // steps_per_epoch`` full epochs, each drawing its order once
    (one ``argsort`` of ``max_examples`` scores per epoch) and scanning its steps; then, if
    ``r = N mod steps_per_epoch > 0``, one more epoch body whose step scan has length ``r``. No step is
    computed and masked away and no order is drawn per step; the cost of a partial epoch is a second
    (shorter) step scan in the program.

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> scalar`` (masked mean over ``batch.mask``).
      optimizer: any Optax gradient transformation (e.g. ``optax.sgd(0.05)``).
      batch_size: examples per step (static).
      num_epochs: local epochs (static). Exactly one of ``num_epochs`` and ``num_steps``.
      num_steps: local steps of the epoch schedule (static), counted over epochs.

    Returns:
      The pure training function; ``key`` is the client's training key (:func:`sidejax.keys.client_streams`).

    Raises:
      ValueError: if not exactly one of ``num_epochs`` and ``num_steps`` is given, or a count is not an
        integer >= 1.
    """
    batch_size = check_count(batch_size, "batch_size")
    if (num_epochs is None) == (num_steps is None):
        raise ValueError(
            "build_local_trainer needs exactly one of num_epochs and num_steps, got "
            f"num_epochs={num_epochs!r}, num_steps={num_steps!r}"
        )
    if num_epochs is not None:
        num_epochs = check_count(num_epochs, "num_epochs")
    else:
        num_steps = check_count(num_steps, "num_steps")
    return _scan_trainer(loss_fn, optimizer, batch_size, num_epochs, num_steps, None)


def schedule_batches(
    key: PRNGKey, data: ClientData, batch_size: int, num_steps: int
) -> tuple[Batch, PRNGKey]:
    """The first ``num_steps`` minibatches of :func:`build_local_trainer`'s epoch schedule, stacked: for the
    local loops that are not one optimizer step per batch (pFedMe's inner solves, Per-FedAvg's two or three
    batches per step).

    Global step ``t`` is step ``s = t mod steps_per_epoch`` of epoch ``e = t // steps_per_epoch``: the batch
    at positions ``s·batch_size ..`` of the order drawn from ``stream_key(epoch_key(key, e), ORDER)``, its
    mask (1 for a valid example), and the step's key ``step_key(epoch_key(key, e), s)``: the batches and
    keys :func:`build_local_trainer` uses with ``num_steps``.

    Returns:
      ``(batches, keys)``: a :class:`Batch` whose leaves have a leading ``[num_steps]`` axis, and the
      ``[num_steps]`` step keys.
    """
    batch_size = check_count(batch_size, "batch_size")
    num_steps = check_count(num_steps, "num_steps")
    max_examples = data.indices.shape[0]
    steps = num_local_steps(max_examples, batch_size)
    epochs = -(-num_steps // steps)
    ekeys = jax.vmap(lambda e: epoch_key(key, e))(jnp.arange(epochs))
    orders = jax.vmap(lambda k: epoch_order(stream_key(k, ORDER), data.num_examples, max_examples))(ekeys)
    orders = jnp.pad(orders, ((0, 0), (0, steps * batch_size - max_examples)))
    t = jnp.arange(num_steps)
    e, s = t // steps, t % steps
    pos = orders.reshape(epochs, steps, batch_size)[e, s]
    valid = (s[:, None] * batch_size + jnp.arange(batch_size)) < data.num_examples
    gidx = data.indices[pos]
    batches = Batch(x=data.x[gidx], y=data.y[gidx], mask=valid.astype(jnp.float32))
    return batches, jax.vmap(step_key)(ekeys[e], s)


class _Recorder(NamedTuple):
    """What a trainer records along its steps: ``init(params) -> buffer`` and
    ``record(buffer, t, params) -> buffer``, called after schedule step ``t`` (1-based count of the schedule's
    steps, padding steps included) with the parameters after it."""

    init: Callable
    record: Callable


def _scan_trainer(loss_fn, optimizer, batch_size: int, num_epochs, num_steps, recorder: _Recorder | None):
    """The local trainer of :func:`build_local_trainer` (``recorder=None``) and of
    :func:`build_sampling_trainer` (which also carries the recorder's buffer through the same steps)."""
    grad_fn = jax.value_and_grad(loss_fn)

    def train(key: PRNGKey, params: Params, data: ClientData):
        max_examples = data.indices.shape[0]
        steps = num_local_steps(max_examples, batch_size)
        padded = steps * batch_size
        full_epochs, last_steps = (num_epochs, 0) if num_steps is None else divmod(num_steps, steps)

        def run_epoch(carry, e, length: int):
            ekey = epoch_key(key, e)
            order = epoch_order(stream_key(ekey, ORDER), data.num_examples, max_examples)
            order = jnp.pad(order, (0, padded - max_examples))

            def step(carry, s):
                params, opt_state, loss_sum, n_steps, finite, *buffer = carry
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
                if recorder is not None:
                    buffer = [recorder.record(buffer[0], e * steps + s + 1, params)]
                carry = (params, opt_state, loss_sum, n_steps + has_data.astype(jnp.int32), finite, *buffer)
                return carry, None

            carry, _ = jax.lax.scan(step, carry, jnp.arange(length))
            return carry

        carry = (params, optimizer.init(params), jnp.float32(0.0), jnp.int32(0), jnp.asarray(True))
        if recorder is not None:
            carry = (*carry, recorder.init(params))
        if full_epochs:
            epoch = lambda carry, e: (run_epoch(carry, e, steps), None)
            carry, _ = jax.lax.scan(epoch, carry, jnp.arange(full_epochs))
        if last_steps:  # the partial epoch that num_steps ends in: its first last_steps steps
            carry = run_epoch(carry, jnp.int32(full_epochs), last_steps)
        params, _, loss_sum, n_steps, finite, *buffer = carry
        finite = finite & tree_all_finite(params)
        loss = loss_sum / jnp.maximum(n_steps, 1).astype(jnp.float32)
        info = LocalInfo(loss=loss, num_steps=n_steps, finite=finite)
        return (params, info) if recorder is None else (params, buffer[0], info)

    return train


def build_sampling_trainer(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    batch_size: int,
    burnin_steps: int,
    steps_per_sample: int,
    num_samples: int,
    average: bool = True,
):
    """Builds ``train(key, params, data) -> (params, samples, LocalInfo)``: local training that also collects
    ``num_samples`` iterates along the way (FedPA's local posterior samples, Al-Shedivat et al. 2021).

    The training is :func:`build_local_trainer`'s with ``num_steps = burnin_steps + num_samples ·
    steps_per_sample`` (the same keys, batches and updates: the returned ``params`` and ``LocalInfo`` equal
    that trainer's bit for bit). After the ``burnin_steps`` first steps, the steps fall into ``num_samples``
    consecutive windows of ``steps_per_sample`` steps; sample ``l`` is, with ``average=True``, the mean of
    the ``steps_per_sample`` iterates after the steps of window ``l`` (iterate-averaged SGD, IASG, Mandt et
    al. 2017, the sampler of FedPA's experiments), and with ``average=False`` the iterate after the window's
    last step. The last sample's window ends at the last step. Steps are counted along the schedule (padding
    steps of a client smaller than ``max_examples`` included, as in ``num_steps``), so every client fills
    all its samples; such a padding step leaves the iterate unchanged, and it still counts in a window.

    Memory: one ``[num_samples, P]`` buffer carried through the steps (``P`` the flat parameter count).

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> scalar`` (masked mean over ``batch.mask``).
      optimizer: any Optax gradient transformation.
      batch_size: examples per step (static).
      burnin_steps: steps before the first window (an integer >= 0).
      steps_per_sample: steps per window (an integer >= 1).
      num_samples: number of windows, i.e. of samples (an integer >= 1).
      average: IASG window means (``True``) or the window's last iterate (``False``).

    Returns:
      The pure training function; ``samples`` is float32 ``[num_samples, P]`` in
      :func:`jax.flatten_util.ravel_pytree` order.

    Raises:
      ValueError: if a count is not an integer in its range or ``average`` is not a bool.
    """
    batch_size = check_count(batch_size, "batch_size")
    burnin = check_count(burnin_steps, "burnin_steps", minimum=0)
    every = check_count(steps_per_sample, "steps_per_sample")
    count = check_count(num_samples, "num_samples")
    if not isinstance(average, bool):
        raise ValueError(f"average must be a bool, got {average!r}")

    def init(params):
        flat = ravel_pytree(params)[0]
        return jnp.zeros((count, flat.shape[0]), flat.dtype)

    def record(buffer, t, params):
        flat = ravel_pytree(params)[0]
        after = t - burnin  # steps done inside the windows
        if average:  # add the iterate to its window's sum: window (after - 1) // every
            active = after >= 1
            slot = jnp.clip((after - 1) // every, 0, count - 1)
            row = jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(active, row + flat, row), slot, 0)
        hit = (after >= every) & (after % every == 0)  # the last step of window after // every - 1
        slot = jnp.clip(after // every - 1, 0, count - 1)
        row = jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(hit, flat, row), slot, 0)

    recorder = _Recorder(init, record)
    inner = _scan_trainer(loss_fn, optimizer, batch_size, None, burnin + count * every, recorder)
    if not average:
        return inner

    def train(key: PRNGKey, params: Params, data: ClientData):
        params, sums, info = inner(key, params, data)
        return params, sums / jnp.asarray(every, sums.dtype), info

    return train


class LocalTraining(NamedTuple):
    """How the clients train locally, as one argument of every algorithm builder.

    Attributes:
      optimizer: the clients' Optax optimizer (its state is initialised afresh every round).
      batch_size: examples per step.
      num_epochs: local epochs per round; ``None`` with ``num_steps`` set (and 1 when neither is set).
      num_steps: a fixed number of local steps per round instead of epochs (see :func:`build_local_trainer`).
    """

    optimizer: optax.GradientTransformation
    batch_size: int
    num_epochs: int | None = None
    num_steps: int | None = None

    def trainer(self, loss_fn: Callable):
        """:func:`build_local_trainer` for ``loss_fn`` with these settings."""
        epochs = 1 if self.num_epochs is None and self.num_steps is None else self.num_epochs
        return build_local_trainer(
            loss_fn, self.optimizer, batch_size=self.batch_size, num_epochs=epochs, num_steps=self.num_steps
        )
