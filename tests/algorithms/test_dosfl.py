"""DOSFL (docs/papers/bpcfl.md#dosfl): the properties that define it.

- the server's replay of a client's distilled data from θ_0 is the θ_final that client optimised for (one
  client), and several clients' data are replayed one after the other in client-id order;
- the outer gradient through the unroll is the derivative of the real loss at θ_final (float64 central
  differences on a linear model, one and two inner steps);
- distillation lowers the real loss from its initialisation (regression with learned labels, and
  classification with fixed labels and a learned step size);
- argument validation names the argument; a NaN client is excluded and the others' replay is kept.

All on a two-parameter linear model, so the module compiles in seconds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_equal

from sidejax.algorithms import Distilled, DOSFLSettings, dosfl
from sidejax.algorithms.dosfl import distill, distillation_loss, distilled_floats, replay, unpack_distilled
from sidejax.data import make_federated_data
from sidejax.fl import Batch, run_rounds
from sidejax.keys import run_keys
from sidejax.utils import enable_x64

PARAMS = {"w": jnp.asarray(0.3), "b": jnp.asarray(-0.2)}
MOMENTUM = optax.sgd(0.1, momentum=0.9)


def linear_loss(params, batch, key):
    """Mean squared error of ``w x + b`` (masked), the loss contract's signature."""
    del key
    f = batch.x[:, 0] * params["w"] + params["b"]
    return jnp.sum(batch.mask * (f - batch.y) ** 2) / jnp.sum(batch.mask)


def logistic_loss(params, batch, key):
    """Two-class cross-entropy of the logits ``(0, w x + b)`` (masked), integer labels."""
    del key
    z = batch.x[:, 0] * params["w"] + params["b"]
    logp = jax.nn.log_softmax(jnp.stack([jnp.zeros_like(z), z], axis=-1))
    nll = -jnp.take_along_axis(logp, batch.y[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return jnp.sum(batch.mask * nll) / jnp.sum(batch.mask)


def _federation(num_clients: int, *, classes: bool = False, per_client: int = 16):
    rng = np.random.default_rng(0)
    x = rng.uniform(-1.0, 1.0, (num_clients * per_client, 1)).astype(np.float32)
    y = (x[:, 0] > 0.1).astype(np.int32) if classes else (2.0 * x[:, 0] + 0.5).astype(np.float32)
    parts = [np.arange(m * per_client, (m + 1) * per_client) for m in range(num_clients)]
    return make_federated_data(x, y, parts)


def _settings(**overrides) -> DOSFLSettings:
    base = dict(
        num_steps=3,
        num_epochs=2,
        batch_size=4,
        num_updates=60,
        num_classes=None,
        input_optimizer=MOMENTUM,
        label_optimizer=MOMENTUM,
        lr_optimizer=None,
        init_lr=0.1,
    )
    return DOSFLSettings(**{**base, **overrides})


@functools.cache
def _run(num_clients: int):
    """One round of DOSFL on the linear model: ``(algo, settings, state0, state, info)``."""
    settings = _settings()
    algo = dosfl(linear_loss, input_shape=(1,), num_clients=num_clients, settings=settings)
    init_key, rounds_key = run_keys(0)
    state0 = algo.init(init_key, PARAMS, num_clients)
    state, info = run_rounds(algo, rounds_key, state0, _federation(num_clients), 1)
    return algo, settings, state0, state, info


def _client(distilled: Distilled, m: int) -> Distilled:
    return jax.tree.map(lambda a: a[m], distilled)


def test_replaying_a_clients_data_from_theta0_gives_its_theta_final():
    """The first client's decoded data replayed from θ_0 is the θ_final it optimised for: the real loss
    there is the loss the client reports for its upload. The measured upload is the paper's
    ``S·B·(D + 1) + 1`` floats, the downlink empty."""
    algo, settings, state0, state, info = _run(3)
    d = _client(state.server.distilled, 0)
    theta = jax.jit(lambda p, d: replay(linear_loss, p, d, settings.num_epochs, None))(
        state0.server.params, d
    )
    fed = _federation(3)
    rows = np.asarray(fed.client_indices)[0]
    real = Batch(fed.x[rows], fed.y[rows], jnp.ones(rows.shape[0]))
    np.testing.assert_allclose(
        float(linear_loss(theta, real, None)), float(info.clients.extra.loss_last[0, 0]), rtol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(info.uplink_bits[0]), 32 * distilled_floats(settings, (1,)))
    assert distilled_floats(settings, (1,)) == 3 * 4 * (1 + 1) + 1
    np.testing.assert_array_equal(np.asarray(info.downlink_bits[0]), 0)
    assert not tree_equal(theta, state0.server.params)


def test_several_clients_are_replayed_in_sequence_in_client_id_order():
    algo, settings, state0, state, info = _run(3)
    step = jax.jit(lambda p, d: replay(linear_loss, p, d, settings.num_epochs, None))
    theta = state0.server.params
    for m in range(3):
        theta = step(theta, _client(state.server.distilled, m))
    for a, b in zip(jax.tree.leaves(state.server.params), jax.tree.leaves(theta), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(info.included), True)


@pytest.mark.parametrize("num_steps, num_epochs", [(1, 1), (2, 1)])
def test_outer_gradient_through_the_unroll_matches_float64_finite_differences(num_steps, num_epochs):
    with enable_x64():
        rng = np.random.default_rng(1)
        params = {"w": jnp.asarray(0.4), "b": jnp.asarray(0.1)}
        d = Distilled(
            jnp.asarray(rng.normal(size=(num_steps, 3, 1))),
            jnp.asarray(rng.normal(size=(num_steps, 3))),
            jnp.asarray(0.3),
        )
        x = rng.uniform(-1, 1, (8, 1))
        real = Batch(jnp.asarray(x), jnp.asarray(1.5 * x[:, 0] - 0.2), jnp.ones(8))

        def objective(flat):
            n = d.inputs.size
            dd = Distilled(flat[:n].reshape(d.inputs.shape), flat[n:-1].reshape(d.labels.shape), flat[-1])
            return distillation_loss(linear_loss, params, dd, real, num_epochs, None)

        flat = jnp.concatenate([d.inputs.ravel(), d.labels.ravel(), d.lr[None]])
        grad = np.asarray(jax.jit(jax.grad(objective))(flat))
        h, eye = 1e-6, jnp.eye(flat.shape[0])
        values = jax.jit(jax.vmap(objective))(jnp.concatenate([flat + h * eye, flat - h * eye]))
        fd = np.asarray(values[: flat.shape[0]] - values[flat.shape[0] :]) / (2 * h)
        assert grad.dtype == np.float64
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
        assert np.abs(grad).max() > 1e-3  # the objective depends on every part


def test_distillation_lowers_the_real_loss_regression_and_classification():
    """Regression (inputs and labels learned, η̃ fixed; the engine's round) and classification (hard labels
    fixed, η̃ learned by Adam; :func:`distill` alone): the uploaded data's real loss is well below that of
    its initialisation, and η̃ moves only when it is learned."""
    _, settings, _, _, info = _run(3)
    first, last = np.asarray(info.clients.extra.loss_first[0]), np.asarray(info.clients.extra.loss_last[0])
    assert (last < 0.1 * first).all(), (first, last)
    np.testing.assert_array_equal(np.asarray(info.clients.extra.lr[0]), np.float32(settings.init_lr))
    settings = _settings(num_classes=2, label_optimizer=None, lr_optimizer=optax.adam(1e-2))
    fed = _federation(1, classes=True)
    real = Batch(fed.x, fed.y, jnp.ones(fed.x.shape[0]))
    start = Distilled(
        jnp.asarray(np.random.default_rng(2).normal(size=(3, 4, 1)), jnp.float32),
        jnp.tile(jnp.arange(2, dtype=jnp.int32), (3, 2)),
        jnp.asarray(settings.init_lr, jnp.float32),
    )
    run = jax.jit(lambda d: distill(logistic_loss, settings, PARAMS, d, real, None))
    out, losses, final = run(start)
    assert float(final) < 0.8 * float(losses[0]), (losses[0], final)
    assert float(out.lr) != np.float32(settings.init_lr)
    np.testing.assert_array_equal(np.asarray(out.labels), np.asarray(start.labels))


def test_a_nan_client_is_excluded_and_the_others_are_replayed():
    algo, settings, state0, clean, _ = _run(3)
    fed = _federation(3)
    x = np.array(fed.x)
    x[np.asarray(fed.client_indices)[1]] = np.nan
    _, rounds_key = run_keys(0)
    new, info = run_rounds(algo, rounds_key, state0, fed._replace(x=jnp.asarray(x)), 1)
    info = jax.tree.map(lambda a: a[0], info)
    np.testing.assert_array_equal(np.asarray(info.included), [True, False, True])
    assert not bool(info.clients.finite[1])
    d = new.server.distilled
    np.testing.assert_array_equal(np.asarray(d.inputs[1]), 0)
    replayed = jax.jit(lambda p, d: replay(linear_loss, p, d, settings.num_epochs, None))
    theta = replayed(replayed(state0.server.params, _client(d, 0)), _client(d, 2))
    for a, b in zip(jax.tree.leaves(new.server.params), jax.tree.leaves(theta), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    assert tree_equal(_client(d, 0), _client(clean.server.distilled, 0))
    # every client poisoned: the server keeps its state
    x[:] = np.nan
    kept, info = run_rounds(algo, rounds_key, state0, fed._replace(x=jnp.asarray(x)), 1)
    assert not np.asarray(info.included).any()
    assert tree_equal(kept.server, state0.server)


def test_unpack_inverts_the_upload_layout():
    s = _settings(num_steps=2, batch_size=3, num_classes=4, label_optimizer=None)
    values = jnp.arange(distilled_floats(s, (2,)), dtype=jnp.float32)
    d = unpack_distilled(values, s, (2,))
    assert d.inputs.shape == (2, 3, 2) and d.labels.shape == (2, 3) and d.labels.dtype == jnp.int32
    assert float(d.lr) == values[-1]
    np.testing.assert_array_equal(np.asarray(d.labels).ravel(), np.arange(12, 18))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_steps=0), "settings.num_steps"),
        (dict(num_epochs=1.5), "settings.num_epochs"),
        (dict(batch_size=True), "settings.batch_size"),
        (dict(num_updates=-1), "settings.num_updates"),
        (dict(num_classes=1), "settings.num_classes"),
        (dict(input_optimizer=None), "settings.input_optimizer"),
        (dict(lr_optimizer="adam"), "settings.lr_optimizer"),
        (dict(num_classes=3), "settings.label_optimizer must be None for classification"),
        (dict(init_lr=float("nan")), "settings.init_lr"),
        (dict(init_std=0.0), "settings.init_std"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        dosfl(linear_loss, input_shape=(1,), num_clients=2, settings=_settings(**change))


def test_bad_builder_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match="settings must be a DOSFLSettings"):
        dosfl(linear_loss, input_shape=(1,), num_clients=2, settings=dict(num_steps=1))
    with pytest.raises(ValueError, match="num_clients"):
        dosfl(linear_loss, input_shape=(1,), num_clients=0, settings=_settings())
    for shape in ((), (0,), 3):
        with pytest.raises(ValueError, match="input_shape"):
            dosfl(linear_loss, input_shape=shape, num_clients=2, settings=_settings())
    with pytest.raises(ValueError, match="coder"):
        dosfl(linear_loss, input_shape=(1,), num_clients=2, settings=_settings(), coder="float32")
    algo = dosfl(linear_loss, input_shape=(1,), num_clients=2, settings=_settings())
    with pytest.raises(ValueError, match=r"one-shot.*clients_per_round \(2\) must equal num_clients \(3\)"):
        algo.init(jax.random.key(0), PARAMS, 3)
