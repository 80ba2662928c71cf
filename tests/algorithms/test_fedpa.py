"""FedPA (sidejax.algorithms.fedpa): the DP delta against a dense solve, FedAvg in burn-in, real messages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_equal
from jax.flatten_util import ravel_pytree

from sidejax.algorithms import FedPASettings, fedavg, fedpa, fedpa_delta
from sidejax.algorithms.fedpa import effective_shrinkage
from sidejax.coding import decode_float32
from sidejax.fl import Batch, ClientData, LocalTraining, build_sampling_trainer, run_rounds
from sidejax.keys import client_keys, client_streams
from sidejax.utils import enable_x64

# A tiny FedPA: 4 of 10 clients, batches of 16, 1 local burn-in step then 3 windows of 2 steps (7 steps), two
# FedAvg rounds. Server SGD 0.1 with momentum 0.9: with Table 5's 0.5 and rho = 0.1 (deltas up to 1/rho = 10
# times FedAvg's) this tiny MLP's loss jumps in the first FedPA round.
SETTINGS = FedPASettings(
    burn_in_rounds=2, num_samples=3, shrinkage=0.1, local_burnin_steps=1, steps_per_sample=2
)
CLIENT_LR, SERVER_LR, BATCH = 0.05, 0.1, 16


def _dense_delta(samples: np.ndarray, x: np.ndarray, rho: float) -> np.ndarray:
    """``solve(rho I + (1 - rho) S, x - mu)`` in float64, ``S`` the unbiased sample covariance (0 for one
    sample)."""
    num, dim = samples.shape
    mu = samples.mean(axis=0)
    cov = np.cov(samples, rowvar=False, ddof=1) if num > 1 else np.zeros((dim, dim))
    return np.linalg.solve(rho * np.eye(dim) + (1 - rho) * cov, x - mu)


@pytest.mark.parametrize("num_samples", [5, 1, 12])
def test_fedpa_delta_equals_the_dense_solve(num_samples):
    """P = 7 with ℓ = 5, ℓ = 1 (no covariance) and ℓ = 12 > P (a full-rank sample covariance), float64."""
    rng = np.random.default_rng(num_samples)
    dim = 7
    with enable_x64():
        delta = jax.jit(fedpa_delta)
        for rho in (0.1, 0.5, 0.9):
            # correlated samples with unequal scales, around a mean away from x
            samples = rng.normal(size=(num_samples, dim)) @ rng.normal(size=(dim, dim)) + 3.0
            x = rng.normal(size=dim)
            got = np.asarray(delta(jnp.asarray(samples), jnp.asarray(x), rho))
            assert got.dtype == np.float64
            want = _dense_delta(samples, x, rho)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_fedpa_delta_with_shrinkage_one_is_x_minus_the_sample_mean():
    """rho = 1: Σ̂ = I whatever the spread of the samples, so Δ = x − μ̂ (FedAvg's delta at the iterate
    mean)."""
    rng = np.random.default_rng(3)
    samples, x = 5.0 * rng.normal(size=(6, 9)), rng.normal(size=9)
    with enable_x64():
        got = np.asarray(jax.jit(fedpa_delta)(jnp.asarray(samples), jnp.asarray(x), 1.0))
    np.testing.assert_allclose(got, x - samples.mean(axis=0), rtol=1e-14, atol=1e-14)


def test_fedpa_shrinkage_form_is_the_reference_codes():
    """``shrinkage_form="fedpa"``: the FedPA reference code's ρ_ℓ = 1/(1 + (ℓ − 1)ρ), under which Δ is
    ``(1 + (ℓ − 1)ρ) (I + ρ M)⁻¹ (x − μ̂)`` with the scatter matrix M = (ℓ − 1)Ŝ."""
    settings = FedPASettings(num_samples=10, shrinkage=0.1, shrinkage_form="fedpa")
    assert effective_shrinkage(settings) == 1 / 1.9
    assert effective_shrinkage(settings._replace(shrinkage_form="direct")) == 0.1
    rng = np.random.default_rng(4)
    samples, x, rho = rng.normal(size=(10, 7)), rng.normal(size=7), 0.1
    scatter = 9 * np.cov(samples, rowvar=False, ddof=1)
    want = (1 + 9 * rho) * np.linalg.solve(np.eye(7) + rho * scatter, x - samples.mean(axis=0))
    with enable_x64():
        got = np.asarray(
            jax.jit(fedpa_delta)(jnp.asarray(samples), jnp.asarray(x), effective_shrinkage(settings))
        )
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def _quadratic_posterior(rng, dim: int):
    """A quadratic loss ½ (θ − m)ᵀ A (θ − m) with eigenvalues of A in [0.5, 5]: its Gaussian posterior
    N(m, A⁻¹) (a draw is m + L ε with L Lᵀ = A⁻¹) and the exact FedPA delta A (x − m) at a point x."""
    q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
    hessian = q @ np.diag(np.linspace(0.5, 5.0, dim)) @ q.T
    mean, x = rng.normal(size=dim) + 2.0, rng.normal(size=dim)
    return mean, np.linalg.cholesky(np.linalg.inv(hessian)), x, hessian @ (x - mean)


@pytest.mark.parametrize("num_samples", [2, 10, 40])
def test_the_fedpa_papers_form_on_a_gaussian_posterior_equals_the_dense_solve(num_samples):
    """``shrinkage_form="fedpa"`` on exact samples of a quadratic's Gaussian posterior: the DP's Δ equals the
    dense (ρ_ℓ I + (1 − ρ_ℓ) Ŝ)⁻¹ (x − μ̂), ρ_ℓ = 1/(1 + (ℓ − 1)ρ), solved in float64, for the paper's
    ρ = 0.01, 0.1 and 1."""
    rng = np.random.default_rng(10 + num_samples)
    mean, chol, x, _ = _quadratic_posterior(rng, 8)
    with enable_x64():
        delta = jax.jit(fedpa_delta)
        for rho in (0.01, 0.1, 1.0):
            samples = mean + rng.normal(size=(num_samples, 8)) @ chol.T
            settings = FedPASettings(num_samples=num_samples, shrinkage=rho, shrinkage_form="fedpa")
            rho_l = effective_shrinkage(settings)
            got = np.asarray(delta(jnp.asarray(samples), jnp.asarray(x), rho_l))
            want = _dense_delta(samples, x, rho_l)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_the_fedpa_papers_form_approaches_the_exact_delta_with_many_samples():
    """ρ_ℓ = 1/(1 + (ℓ − 1)ρ) → 0 as ℓ grows, so Σ̂ → Ŝ → A⁻¹ and Δ → A (x − m), the exact delta of the
    quadratic: relative error 3.6 % at ℓ = 2,000 (P = 4, ρ = 1; sampling error ~ √(P/ℓ) = 4.5 %), against
    67 % at ℓ = 10, where Σ̂ is still 0.1 I + 0.9 Ŝ with Ŝ of rank ≤ 9 estimated from 10 draws."""
    rng = np.random.default_rng(7)
    mean, chol, x, exact = _quadratic_posterior(rng, 4)
    errors = []
    with enable_x64():
        for num_samples in (10, 2000):
            samples = mean + rng.normal(size=(num_samples, 4)) @ chol.T
            rho_l = effective_shrinkage(
                FedPASettings(num_samples=num_samples, shrinkage=1.0, shrinkage_form="fedpa")
            )
            got = np.asarray(jax.jit(fedpa_delta)(jnp.asarray(samples), jnp.asarray(x), rho_l))
            errors.append(np.linalg.norm(got - exact) / np.linalg.norm(exact))
    assert errors[1] < 2 * np.sqrt(4 / 2000) and errors[0] > 0.3, errors


def _fedpa(loss):
    return fedpa(
        loss,
        clients_per_round=4,
        client_optimizer=optax.sgd(CLIENT_LR, momentum=0.9),
        batch_size=BATCH,
        settings=SETTINGS,
        server_optimizer=optax.sgd(SERVER_LR, momentum=0.9),
    )


@pytest.fixture(scope="module")
def fedpa_runs(small_model, digits_fed):
    """FedPA's 2 burn-in rounds, then 2 FedPA rounds (the same compiled program), and FedAvg's 2 rounds with
    the same optimizers and 7 local steps, all from the same keys."""
    _, params, loss = small_model
    algo = _fedpa(loss)
    state0 = algo.init(jax.random.key(0), params, 10)
    burn = run_rounds(algo, jax.random.key(1), state0, digits_fed, 2, client_map="map")
    after = run_rounds(algo, jax.random.key(1), burn[0], digits_fed, 2, client_map="map")
    avg = fedavg(
        loss,
        LocalTraining(optax.sgd(CLIENT_LR, momentum=0.9), batch_size=BATCH, num_steps=SETTINGS.local_steps),
        clients_per_round=4,
        server_optimizer=optax.sgd(SERVER_LR, momentum=0.9),
    )
    avg_state0 = avg.init(jax.random.key(0), params, 10)
    fedavg_run = run_rounds(avg, jax.random.key(1), avg_state0, digits_fed, 2, client_map="map")
    return algo, state0, burn, after, fedavg_run


@pytest.mark.slow  # two programs agree bit for bit with XLA's default emitters only (Makefile)
def test_burn_in_rounds_are_fedavg_rounds_bit_for_bit(fedpa_runs):
    _, state0, (burn_state, burn_info), _, (avg_state, avg_info) = fedpa_runs
    assert SETTINGS.local_steps == 7
    assert int(state0.server.round) == 0 and int(burn_state.server.round) == 2
    server = burn_state.server
    assert tree_equal((server.params, server.opt_state, server.coder), tuple(avg_state.server))
    assert tree_equal(burn_info, avg_info)  # the same clients, losses, step counts, bits and server norms


@pytest.mark.slow  # two programs agree bit for bit with XLA's default emitters only (Makefile)
def test_the_message_is_y_in_burn_in_and_x_minus_the_fedpa_delta_after(fedpa_runs, small_model, digits_fed):
    """One client's kernel around the round switch: in round 1 (< burn_in_rounds) it sends its final iterate
    y_i (FedAvg's message), in round 2 the point x_t − Δ_i with Δ_i = fedpa_delta of its own samples."""
    algo, _, (burn_state, _), _, _ = fedpa_runs
    _, _, loss = small_model
    data = ClientData(digits_fed.x, digits_fed.y, digits_fed.client_indices[3], digits_fed.num_examples[3])
    keys = client_keys(jax.random.key(5), 3)
    train = build_sampling_trainer(
        loss,
        optax.sgd(CLIENT_LR, momentum=0.9),
        batch_size=BATCH,
        burnin_steps=SETTINGS.local_burnin_steps,
        steps_per_sample=SETTINGS.steps_per_sample,
        num_samples=SETTINGS.num_samples,
    )

    @jax.jit
    def sent_and_expected(server):
        _, message, info = algo.client_update(keys, server, (), data)
        final, samples, _ = train(client_streams(keys.private).train, server.params, data)
        x = ravel_pytree(server.params)[0]
        fedpa_point = x - fedpa_delta(samples, x, SETTINGS.shrinkage)
        return decode_float32(message), message.num_bits, ravel_pytree(final)[0], fedpa_point, info

    server = burn_state.server  # round 2: FedPA
    sent, bits, final, fedpa_point, info = sent_and_expected(server._replace(round=jnp.int32(1)))
    np.testing.assert_array_equal(sent, final)
    assert float(bits) == 32 * sent.shape[0] and int(info.extra) == SETTINGS.local_steps
    sent, bits, final, fedpa_point, _ = sent_and_expected(server)
    np.testing.assert_array_equal(sent, fedpa_point)
    assert not np.array_equal(sent, final) and float(bits) == 32 * sent.shape[0]


def test_fedpa_rounds_reduce_the_loss_with_real_message_lengths(fedpa_runs, small_model, digits_fed):
    _, state0, (burn_state, _), (final, info), (avg_state, _) = fedpa_runs
    _, params, loss = small_model
    dim = ravel_pytree(params)[0].size
    assert int(final.server.round) == 4 and int(final.round_index) == 4
    assert not tree_equal(final.server.params, avg_state.server.params)
    # bits read from the messages: 32 P up and down per participant
    assert info.uplink_bits.shape == (2, 4)
    np.testing.assert_array_equal(info.uplink_bits, 32.0 * dim)
    np.testing.assert_array_equal(info.downlink_bits, 32.0 * dim)
    np.testing.assert_array_equal(info.uplink_errors, 0)
    assert np.asarray(info.clients.valid).all() and np.asarray(info.clients.finite).all()
    assert np.asarray(info.server_finite).all()
    # the federation's loss falls over the burn-in and again over the FedPA rounds
    full = Batch(digits_fed.x, digits_fed.y, jnp.ones(digits_fed.y.shape[0]))
    loss_of = jax.jit(lambda p: loss(p, full, None))
    losses = [float(loss_of(s.server.params)) for s in (state0, burn_state, final)]
    assert losses[2] < losses[1] < losses[0], losses


def test_same_seed_same_bits(fedpa_runs, digits_fed):
    algo, _, (burn_state, _), after, _ = fedpa_runs
    again = run_rounds(algo, jax.random.key(1), burn_state, digits_fed, 2, client_map="map")
    assert tree_equal(again, after)
    other = run_rounds(algo, jax.random.key(2), burn_state, digits_fed, 2, client_map="map")
    assert not tree_equal(other[0].server.params, after[0].server.params)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(shrinkage=0.0), r"shrinkage must be a number in \(0, 1\]"),
        (dict(shrinkage=1.5), r"shrinkage must be a number in \(0, 1\]"),
        (dict(shrinkage=float("nan")), r"shrinkage must be a number in \(0, 1\]"),
        (dict(shrinkage=-0.1, shrinkage_form="fedpa"), "shrinkage must be a finite number >= 0"),
        (dict(shrinkage_form="ledoit"), "shrinkage_form must be one of"),
        (dict(num_samples=0), "num_samples must be an integer >= 1"),
        (dict(num_samples=2.5), "num_samples must be an integer >= 1"),
        (dict(burn_in_rounds=-1), "burn_in_rounds must be an integer >= 0"),
        (dict(local_burnin_steps=-1), "local_burnin_steps must be an integer >= 0"),
        (dict(steps_per_sample=0), "steps_per_sample must be an integer >= 1"),
        (dict(average_iterates=1), "average_iterates must be a bool"),
    ],
)
def test_bad_settings_name_the_argument(small_model, change, match):
    _, _, loss = small_model
    with pytest.raises(ValueError, match=match):
        fedpa(
            loss,
            clients_per_round=2,
            client_optimizer=optax.sgd(0.1),
            batch_size=4,
            settings=SETTINGS._replace(**change),
        )


def test_builder_argument_errors(small_model):
    _, _, loss = small_model
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        fedpa(loss, clients_per_round=2, client_optimizer=optax.sgd(0.1), batch_size=0)
    with pytest.raises(ValueError, match="settings must be a FedPASettings"):
        fedpa(loss, clients_per_round=2, client_optimizer=optax.sgd(0.1), batch_size=4, settings=(1, 2))
    # ℓ = 1 and burn_in_rounds = 0 are valid (FedPA from the first round)
    fedpa(
        loss,
        clients_per_round=2,
        client_optimizer=optax.sgd(0.1),
        batch_size=4,
        settings=FedPASettings(burn_in_rounds=0, num_samples=1),
    )
