"""Local training (sidejax.fl.local): epochs or steps of one key schedule, exact against a numpy oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_equal

from sidejax.fl import (
    ClientData,
    build_local_trainer,
    build_sampling_trainer,
    epoch_order,
    num_local_steps,
    schedule_batches,
)
from sidejax.keys import ORDER, epoch_key, step_key, stream_key

# The recorder federation: 23 examples whose input is their own id; a client owns 17 of them (a permutation)
# in an index row of 20, so with batches of 3 an epoch has ceil(20/3) = 7 steps: 5 full batches, one of 2
# valid examples and one with none.
NUM_TOTAL, MAX_EXAMPLES, BATCH = 23, 20, 3
STEPS_PER_EPOCH = num_local_steps(MAX_EXAMPLES, BATCH)
LR, MOMENTUM = 1.0, 0.5


def recorder_loss(params, batch, key):
    """``v · Σ_i mask_i w[x_i]`` with ``v ∈ {1..7}`` drawn from the step key: the gradient adds ``v`` to the
    weight of every valid example of the batch, so SGD with momentum 0.5 and lr 1 keeps ``w`` in small dyadic
    numbers (exact in float32) that record which examples each step visited and with which key."""
    v = jax.random.randint(key, (), 1, 8).astype(jnp.float32)
    picked = params["w"][batch.x.astype(jnp.int32)]
    return v * jnp.sum(jnp.where(batch.mask > 0, picked, 0.0))


def recorder_client(seed: int, num_examples: int) -> ClientData:
    rng = np.random.default_rng(seed)
    row = rng.permutation(NUM_TOTAL)[:MAX_EXAMPLES].astype(np.int32)
    row[num_examples:] = row[0]  # padding points at a real example
    x = jnp.arange(NUM_TOTAL, dtype=jnp.float32)
    return ClientData(x, jnp.zeros(NUM_TOTAL, jnp.int32), jnp.asarray(row), jnp.int32(num_examples))


def recorder_oracle(key, data: ClientData, num_steps: int):
    """The documented schedule, step by step in numpy: global step t is step t mod 7 of epoch t // 7, with
    order epoch_order(stream_key(epoch_key(key, e), ORDER)) and key step_key(epoch_key(key, e), s)."""
    n = int(data.num_examples)
    indices = np.asarray(data.indices)
    w, trace = np.zeros(NUM_TOTAL, np.float32), np.zeros(NUM_TOTAL, np.float32)
    loss_sum, updates = np.float32(0), 0
    for t in range(num_steps):
        e, s = divmod(t, STEPS_PER_EPOCH)
        ekey = epoch_key(key, e)
        order = np.asarray(epoch_order(stream_key(ekey, ORDER), jnp.int32(n), MAX_EXAMPLES))
        pos = s * BATCH + np.arange(BATCH)
        valid = pos < n
        if not valid.any():
            continue  # a step without data changes nothing
        ids = indices[order[pos[valid]]]
        v = np.float32(jax.random.randint(step_key(ekey, s), (), 1, 8))
        loss_sum += v * np.sum(w[ids], dtype=np.float32)
        grad = np.zeros(NUM_TOTAL, np.float32)
        grad[ids] = v
        trace = grad + np.float32(MOMENTUM) * trace
        w = w - np.float32(LR) * trace
        updates += 1
    return w, updates, loss_sum / np.float32(max(updates, 1))


@pytest.mark.parametrize(
    "schedule",
    [
        dict(num_steps=4),  # inside the first epoch
        dict(num_steps=STEPS_PER_EPOCH),  # one whole epoch
        dict(num_steps=2 * STEPS_PER_EPOCH + 2),  # two epochs and 2 steps of a third
        dict(num_steps=2 * STEPS_PER_EPOCH + 6),  # ... and 6 steps, the last one without data
        dict(num_epochs=2),
    ],
)
def test_schedule_is_exactly_the_documented_one(schedule):
    key, data = jax.random.key(11), recorder_client(0, 17)
    train = jax.jit(build_local_trainer(recorder_loss, optax.sgd(LR, MOMENTUM), batch_size=BATCH, **schedule))
    params, info = train(key, {"w": jnp.zeros(NUM_TOTAL)}, data)
    steps = schedule.get("num_steps", STEPS_PER_EPOCH * schedule.get("num_epochs", 0))
    w, updates, loss = recorder_oracle(key, data, steps)
    assert np.abs(w).max() > 0  # the recorder recorded something
    np.testing.assert_array_equal(params["w"], w)  # dyadic values: exact on every backend
    assert int(info.num_steps) == updates and bool(info.finite)
    # The mean loss divides by the number of updates, a traced count: a GPU's float32 division is not always
    # correctly rounded (XLA may multiply by the reciprocal), so within 2 ulp there (on the H200, 2 + 2·7
    # steps failed bit equality); any schedule error moves the loss by whole units of the dyadic weights.
    np.testing.assert_array_max_ulp(np.float32(info.loss), np.float32(loss), maxulp=2)


def test_schedule_batches_are_the_trainers_batches_and_keys():
    """``schedule_batches`` (pFedMe's and Per-FedAvg's minibatches) stacks the documented schedule: two
    epochs and 3 steps of a third, the step without data masked out entirely."""
    key, data = jax.random.key(11), recorder_client(0, 17)
    steps = 2 * STEPS_PER_EPOCH + 3
    batches, keys = jax.jit(schedule_batches, static_argnums=(2, 3))(key, data, BATCH, steps)
    assert batches.x.shape == (steps, BATCH) and keys.shape == (steps,)
    indices = np.asarray(data.indices)
    for t in range(steps):
        e, s = divmod(t, STEPS_PER_EPOCH)
        ekey = epoch_key(key, e)
        order = np.asarray(epoch_order(stream_key(ekey, ORDER), data.num_examples, MAX_EXAMPLES))
        pos = s * BATCH + np.arange(BATCH)
        valid = pos < int(data.num_examples)
        np.testing.assert_array_equal(np.asarray(batches.mask[t]), valid.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(batches.x[t])[valid], indices[order[pos[valid]]])
        assert jnp.array_equal(jax.random.key_data(keys[t]), jax.random.key_data(step_key(ekey, s)))
    assert not np.asarray(batches.mask[STEPS_PER_EPOCH - 1]).any()  # the epoch's last step holds no data


@pytest.mark.parametrize("average", [False, True])
def test_sampling_trainer_collects_the_documented_iterates(average):
    """FedPA's sampler: 3 burn-in steps, then 4 windows of 2 steps (11 steps: past the first epoch and its
    empty 7th step). The training is the num_steps trainer's, and sample l is the iterate after the last step
    of window l (average=False) or the float32 mean of the window's iterates (IASG, average=True), all exact
    against the numpy oracle's iterates (windows of 2: the halving is exact; XLA may divide by another
    constant as a multiplication by its reciprocal, one ulp away)."""
    key, data = jax.random.key(11), recorder_client(0, 17)
    burnin, every, count = 3, 2, 4
    total = burnin + count * every
    train = build_sampling_trainer(
        recorder_loss,
        optax.sgd(LR, MOMENTUM),
        batch_size=BATCH,
        burnin_steps=burnin,
        steps_per_sample=every,
        num_samples=count,
        average=average,
    )
    params, samples, info = jax.jit(train)(key, {"w": jnp.zeros(NUM_TOTAL)}, data)
    iterates = [recorder_oracle(key, data, t)[0] for t in range(1, total + 1)]
    expected = []
    for window in range(count):
        steps = iterates[burnin + window * every : burnin + (window + 1) * every]
        if average:
            acc = np.zeros(NUM_TOTAL, np.float32)
            for w in steps:
                acc = acc + w
            expected.append(acc / np.float32(every))
        else:
            expected.append(steps[-1])
    assert samples.shape == (count, NUM_TOTAL) and samples.dtype == jnp.float32
    np.testing.assert_array_equal(samples, np.stack(expected))
    assert len({np.asarray(e).tobytes() for e in expected}) == count  # different samples
    w, updates, loss = recorder_oracle(key, data, total)
    np.testing.assert_array_equal(params["w"], w)
    assert int(info.num_steps) == updates and float(info.loss) == loss and bool(info.finite)


def test_sampling_trainer_argument_errors(small_model):
    _, _, loss = small_model
    opt = optax.sgd(0.1)
    ok = dict(batch_size=4, burnin_steps=0, steps_per_sample=1, num_samples=2)
    for name, value, match in [
        ("burnin_steps", -1, "burnin_steps must be an integer >= 0"),
        ("steps_per_sample", 0, "steps_per_sample must be an integer >= 1"),
        ("num_samples", 0, "num_samples must be an integer >= 1"),
        ("num_samples", 2.0, "num_samples must be an integer >= 1"),
        ("batch_size", 0, "batch_size must be an integer >= 1"),
        ("average", 1, "average must be a bool"),
    ]:
        with pytest.raises(ValueError, match=match):
            build_sampling_trainer(loss, opt, **{**ok, name: value})


def test_num_steps_schedule_vmaps_over_clients_of_different_sizes():
    keys = jnp.stack([jax.random.key(1), jax.random.key(2)])
    clients = [recorder_client(1, 17), recorder_client(2, 5)]
    rows, sizes = jnp.stack([c.indices for c in clients]), jnp.stack([c.num_examples for c in clients])
    stacked = ClientData(clients[0].x, clients[0].y, rows, sizes)
    train = build_local_trainer(recorder_loss, optax.sgd(LR, MOMENTUM), batch_size=BATCH, num_steps=10)
    params, info = jax.jit(jax.vmap(train, in_axes=(0, None, ClientData(None, None, 0, 0))))(
        keys, {"w": jnp.zeros(NUM_TOTAL)}, stacked
    )
    for c, client in enumerate(clients):
        w, updates, loss = recorder_oracle(keys[c], client, 10)
        np.testing.assert_array_equal(params["w"][c], w)
        assert int(info.num_steps[c]) == updates and float(info.loss[c]) == loss
    assert int(info.num_steps[1]) < int(info.num_steps[0])  # the small client skips its empty steps


def test_num_steps_of_whole_epochs_is_bit_identical_to_num_epochs(small_model, digits):
    """A real model with a stateful optimizer (Adam), a padded client, both trainers jitted."""
    _, params, loss = small_model
    train, _ = digits
    x, y = jnp.asarray(train.x[:40]), jnp.asarray(train.y[:40])
    data = ClientData(x, y, jnp.concatenate([jnp.arange(30), jnp.zeros(10, jnp.int32)]), jnp.int32(30))
    by_epochs = build_local_trainer(loss, optax.adam(0.01), batch_size=8, num_epochs=3)
    by_steps = build_local_trainer(loss, optax.adam(0.01), batch_size=8, num_steps=3 * 5)
    # the same program: num_steps = 3 * steps_per_epoch traces to the num_epochs=3 jaxpr
    args = (jax.random.key(4), params, data)
    assert str(jax.make_jaxpr(by_epochs)(*args)) == str(jax.make_jaxpr(by_steps)(*args))
    pe, ie = jax.jit(by_epochs)(*args)
    ps, is_ = jax.jit(by_steps)(*args)
    assert tree_equal(pe, ps) and tree_equal(ie, is_)
    assert int(ie.num_steps) == 3 * num_local_steps(30, 8) and bool(ie.finite)
    assert not tree_equal(pe, params)


def test_local_trainer_argument_errors(small_model):
    _, _, loss = small_model
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match="exactly one of num_epochs and num_steps"):
        build_local_trainer(loss, opt, batch_size=4)
    with pytest.raises(ValueError, match="exactly one of num_epochs and num_steps"):
        build_local_trainer(loss, opt, batch_size=4, num_epochs=1, num_steps=3)
    with pytest.raises(ValueError, match="num_steps must be an integer >= 1"):
        build_local_trainer(loss, opt, batch_size=4, num_steps=0)
    with pytest.raises(ValueError, match="num_epochs must be an integer >= 1"):
        build_local_trainer(loss, opt, batch_size=4, num_epochs=1.5)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        build_local_trainer(loss, opt, batch_size=0, num_epochs=1)
    build_local_trainer(loss, opt, batch_size=np.int64(4), num_steps=np.int32(3))  # numpy integers are fine


def test_padding_target_does_not_change_local_training(small_model, digits):
    """Padding slots point at real examples; which one must not matter (exact zero contribution)."""
    _, params, loss = small_model
    train, _ = digits
    x, y = jnp.asarray(train.x[:40]), jnp.asarray(train.y[:40])
    trainer = jax.jit(build_local_trainer(loss, optax.sgd(0.1), batch_size=8, num_epochs=2))
    from sidejax.fl import ClientData

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
