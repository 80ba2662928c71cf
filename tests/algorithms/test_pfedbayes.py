"""pFedBayes, RandomSubset and CoreSet-PFedBayes (sidejax.algorithms.pfedbayes;
docs/papers/coreset_pfedbayes.md).

Properties: one client with a frozen global posterior is mean-field variational inference on its data (a
conjugate Gaussian model, against the closed-form mean-field optimum, docs/papers/coreset_pfedbayes.md#t3 and
docs/papers/coreset_pfedbayes.md#t4 in practice); the server's aggregation
(docs/papers/coreset_pfedbayes.md#t5); the localized global's gradient vanishes at ``z = q``
(docs/papers/coreset_pfedbayes.md#t4); the minibatch slots are uniform over the support (the unbiasedness of
Eq. 9's ``m/b`` scale); CoreSet-PFedBayes' coresets stay k-sparse and non-negative, the uplink is ``2P``
float32 words, runs are deterministic; bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_equal
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.pfedbayes import (
    CoresetSettings,
    MeanField,
    PFedBayesSettings,
    _uniform_slots,
    coreset_pfedbayes,
    pfedbayes,
    pfedbayes_subset,
)
from sidejax.bayes import mean_field_kl
from sidejax.coding import encode_float32
from sidejax.data import make_federated_data
from sidejax.fl import masked_mean, run_rounds
from sidejax.keys import client_keys, round_key

SMALL = PFedBayesSettings(local_iters=3, personal_steps=2, batch_size=16)


# --------------------------------------------------------------------------------------------------------
# one client = variational inference
# --------------------------------------------------------------------------------------------------------

NOISE = 0.7  # the regression noise std s


def _linear_apply(params, x):
    return x @ params["w"] + params["b"]


def _gaussian_nll(params, batch, key):
    del key
    r = batch.y - _linear_apply(params, batch.x)
    nll = 0.5 * (r / NOISE) ** 2 + 0.5 * jnp.log(2 * jnp.pi * NOISE**2)
    return masked_mean(nll, batch.mask)


def test_one_client_pfedbayes_is_mean_field_variational_inference_on_its_data():
    """One client, ζ = 1, the localized global frozen (``global_optimizer = sgd(0)``: the server keeps
    ``z = v⁰``): the personal posterior must reach the mean-field optimum of the exact posterior of a
    conjugate Bayesian linear regression with prior ``z``: the exact posterior mean, and
    ``σ_m² = 1/Λ_mm`` (``Λ`` the posterior precision). Full-batch steps (``b = n``), 32 MC samples, Adam
    with a decaying rate; the tolerance (5% of each posterior std) is far above the optimiser's remaining
    noise (measured: 3.2% for the means, 0.2% for the scales) and far below the distance from the prior."""
    rng = np.random.default_rng(0)
    n, d = 40, 2
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x @ np.array([1.5, -0.8]) + 0.3 + NOISE * rng.normal(size=n)).astype(np.float32)
    fed = make_federated_data(x, y, [np.arange(n)])
    params = {"w": jnp.zeros((d,)), "b": jnp.zeros(())}
    schedule = optax.exponential_decay(0.05, transition_steps=3000, decay_rate=0.01)
    settings = PFedBayesSettings(
        zeta=1.0,
        local_iters=50,
        personal_steps=4,
        batch_size=n,
        mc_samples=32,
        personal_optimizer=optax.adam(schedule),
        global_optimizer=optax.sgd(0.0),
        init_weight_scale=0.5,
        init_rho=1.0,
    )
    algo = pfedbayes(_gaussian_nll, clients_per_round=1, settings=settings)
    state = algo.init(jax.random.key(3), params, 1)
    final, infos = run_rounds(algo, jax.random.key(4), state, fed, 15, client_map="map")
    assert bool(np.all(infos.clients.finite))

    v0 = state.server.posterior
    # float64 closed form, coordinates ordered as ravel_pytree orders {"b", "w"}
    mu0 = np.asarray(ravel_pytree(v0.mu)[0], np.float64)
    s0 = np.log1p(np.exp(np.asarray(ravel_pytree(v0.rho)[0], np.float64)))
    a = np.concatenate([np.ones((n, 1)), x.astype(np.float64)], axis=1)  # b first, then w
    prec = np.diag(1 / s0**2) + a.T @ a / NOISE**2
    mean = np.linalg.solve(prec, mu0 / s0**2 + a.T @ y.astype(np.float64) / NOISE**2)
    sd = 1 / np.sqrt(np.diag(prec))

    q = jax.tree.map(lambda t: t[0], final.clients.personal.posterior)
    mu = np.asarray(ravel_pytree(q.mu)[0], np.float64)
    sigma = np.log1p(np.exp(np.asarray(ravel_pytree(q.rho)[0], np.float64)))
    assert np.max(np.abs(mean - mu0) / sd) > 5  # the data moved the posterior far from the prior
    np.testing.assert_array_less(np.abs(mu - mean), 0.05 * sd)
    np.testing.assert_array_less(np.abs(sigma - sd), 0.05 * sd)
    # the server's global posterior is the frozen prior, bit for bit (one client, β = 1)
    assert tree_equal(final.server.posterior, v0)


# --------------------------------------------------------------------------------------------------------
# server, localized global, sampler
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_server_mixes_the_mean_of_the_decoded_mu_and_rho(small_model, beta):
    """T5 (docs/papers/coreset_pfedbayes.md#t5): ``v ← (1 − β) v + β · mean_i v_i`` on (μ, ρ) (not σ), from
    the decoded uplink streams."""
    _, params, loss = small_model
    algo = pfedbayes(loss, clients_per_round=3, settings=SMALL._replace(beta=beta))
    server = algo.init(jax.random.key(0), params, 3).server
    flat = np.concatenate([ravel_pytree(server.posterior.mu)[0], ravel_pytree(server.posterior.rho)[0]])
    sent = np.stack([flat + i + 1.0 for i in range(3)]).astype(np.float32)
    messages = jax.vmap(encode_float32)(jnp.asarray(sent))
    shared = jax.vmap(lambda i: client_keys(round_key(jax.random.key(0), 0), i).shared)(jnp.arange(3))
    new, _, errors = algo.server_update(jax.random.key(0), server, jnp.arange(3), shared, messages, None)
    np.testing.assert_array_equal(errors, 0)
    got = np.concatenate([ravel_pytree(new.posterior.mu)[0], ravel_pytree(new.posterior.rho)[0]])
    np.testing.assert_allclose(got, (1 - beta) * flat + beta * sent.mean(axis=0), rtol=1e-6, atol=1e-6)
    assert int(new.round) == 1


def test_localized_global_gradient_vanishes_at_the_personal_posterior():
    """T4 (docs/papers/coreset_pfedbayes.md#t4): ``∇_{v_z} KL(q ‖ z)`` at ``z = q`` is exactly zero, and
    gradient steps on it alone reach ``q``."""
    q = MeanField({"a": jnp.array([0.3, -1.0, 2.0])}, {"a": jnp.array([-1.0, 0.5, -3.0])})
    grad = jax.grad(lambda z: mean_field_kl(q, z))
    g = grad(q)
    assert all(float(jnp.max(jnp.abs(leaf))) == 0.0 for leaf in jax.tree.leaves(g))
    z = MeanField({"a": jnp.zeros(3)}, {"a": jnp.zeros(3)})
    opt = optax.adam(0.05)
    st = opt.init(z)
    for _ in range(600):
        up, st = opt.update(grad(z), st, z)
        z = optax.apply_updates(z, up)
    assert float(mean_field_kl(q, z)) < 1e-3


def test_minibatch_slots_are_uniform_over_the_support():
    """Eq. 9's scale ``m/b`` is unbiased iff every one of the ``m`` support slots is in the batch with
    probability ``b/m``: 20,000 draws of 3 of the first 7 of 10 slots (inclusion 3/7, standard error
    0.0035: tolerance 5 SE), never a slot past the support, never twice; with fewer slots than the batch
    (2 < 3) the draw is with replacement within the support."""
    keys = jax.random.split(jax.random.key(0), 20_000)
    slots = np.asarray(jax.vmap(lambda k: _uniform_slots(k, jnp.int32(7), 10, 3))(keys))
    assert slots.max() < 7
    assert all(len(set(row)) == 3 for row in slots[:500])
    freq = np.bincount(slots.ravel(), minlength=7) / len(keys)
    np.testing.assert_allclose(freq, 3 / 7, atol=5 * np.sqrt((3 / 7) * (4 / 7) / len(keys)))
    few = np.asarray(jax.vmap(lambda k: _uniform_slots(k, jnp.int32(2), 10, 3))(keys[:200]))
    assert set(np.unique(few)) == {0, 1}


# --------------------------------------------------------------------------------------------------------
# CoreSet-PFedBayes and RandomSubset on digits
# --------------------------------------------------------------------------------------------------------

CORESET = CoresetSettings(projection_samples=40, every=2)


@pytest.fixture(scope="module")
def coreset_run(small_model, digits_fed):
    """3 rounds of CoreSet-PFedBayes (k = 20, J = 40, weights recomputed in rounds 0 and 2), 4 of 10 clients
    per round, twice from the same keys."""
    _, params, loss = small_model
    algo = coreset_pfedbayes(loss, clients_per_round=4, coreset_size=20, settings=SMALL, coreset=CORESET)
    state = algo.init(jax.random.key(0), params, 10)
    runs = [run_rounds(algo, jax.random.key(1), state, digits_fed, 3, client_map="map") for _ in range(2)]
    return algo, state, runs


def test_coreset_pfedbayes_is_deterministic_and_its_coresets_are_sparse_and_nonnegative(
    coreset_run, small_model, digits_fed
):
    algo, state, ((final, infos), (final2, infos2)) = coreset_run
    assert tree_equal(final, final2) and tree_equal(infos, infos2)
    assert bool(np.all(infos.clients.finite)) and bool(np.all(infos.server_finite))
    np.testing.assert_array_equal(infos.uplink_errors, 0)
    # the uplink: the coreset-localized global (μ, ρ) as 2P float32 words
    num_params = ravel_pytree(small_model[1])[0].shape[0]
    np.testing.assert_array_equal(infos.uplink_bits, 64 * num_params)
    np.testing.assert_array_equal(infos.downlink_bits, 64 * num_params)
    cs = final.clients.coreset
    participated = np.asarray(final.clients.started)
    assert participated.any() and not participated.all()
    w = np.asarray(cs.weights)[participated]
    assert np.all(w >= 0) and np.all(np.sum(w > 0, axis=1) <= 20) and np.all(w.sum(axis=1) > 0)
    # positions of nonzero weights index the clients' own valid examples
    pos = np.asarray(cs.positions)[participated]
    n = np.asarray(digits_fed.num_examples)[participated]
    assert np.all(np.where(w > 0, pos < n[:, None], True))
    # A-IHT ran in rounds 0 and 2 (every = 2), not in round 1
    iters = np.asarray(infos.clients.extra.aiht_iterations)
    assert np.all(iters[[0, 2]] >= 1) and np.all(iters[1] == 0)
    metrics = algo.metrics(infos)
    assert np.isnan(np.asarray(metrics["coreset_objective"])[1])
    assert np.all(np.asarray(metrics["coreset_objective"])[[0, 2]] < 1)
    # personal models: one per client (the coreset tracks' means); non-participants keep the initial one
    personal = algo.evaluation.personal(final)
    assert jax.tree.leaves(personal)[0].shape[0] == 10
    idle = int(np.flatnonzero(~participated)[0])
    assert tree_equal(
        jax.tree.map(lambda a: a[idle], personal),
        jax.tree.map(lambda a: a[idle], algo.evaluation.personal(state)),
    )


def test_random_subset_is_fixed_after_the_first_round(small_model, digits_fed):
    _, params, loss = small_model
    algo = pfedbayes_subset(loss, clients_per_round=10, subset_size=12, settings=SMALL)
    state = algo.init(jax.random.key(0), params, 10)
    one, _ = run_rounds(algo, jax.random.key(1), state, digits_fed, 1, client_map="map")
    two, infos = run_rounds(algo, jax.random.key(1), one, digits_fed, 1, client_map="map")
    assert tree_equal(one.clients.subset, two.clients.subset)
    pos = np.asarray(one.clients.subset.positions)
    n = np.asarray(digits_fed.num_examples)
    assert all(len(set(row)) == 12 for row in pos)
    assert np.all(pos < n[:, None])
    np.testing.assert_array_equal(one.clients.subset.weights, 1.0)
    assert bool(np.all(infos.clients.finite))


# --------------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------------


def test_bad_input_gives_clear_errors(small_model, digits_fed):
    _, params, loss = small_model
    with pytest.raises(ValueError, match="coreset_size must be an integer >= 1"):
        coreset_pfedbayes(loss, clients_per_round=2, coreset_size=0)
    with pytest.raises(ValueError, match="subset_size must be an integer >= 1"):
        pfedbayes_subset(loss, clients_per_round=2, subset_size=-3)
    with pytest.raises(ValueError, match="projection_samples=10 must exceed coreset_size=20"):
        coreset_pfedbayes(
            loss, clients_per_round=2, coreset_size=20, coreset=CoresetSettings(projection_samples=10)
        )
    with pytest.raises(ValueError, match="settings.beta must be in"):
        pfedbayes(loss, clients_per_round=2, settings=SMALL._replace(beta=0.0))
    with pytest.raises(ValueError, match="settings.kl_scale_mode"):
        pfedbayes(loss, clients_per_round=2, settings=SMALL._replace(kl_scale_mode="paper"))
    with pytest.raises(ValueError, match="settings.zeta must be a finite number > 0"):
        pfedbayes(loss, clients_per_round=2, settings=SMALL._replace(zeta=float("nan")))
    # k larger than the number of points a client holds: refused when the round is traced
    size = digits_fed.client_indices.shape[1]
    algo = coreset_pfedbayes(loss, clients_per_round=2, coreset_size=size + 1, settings=SMALL)
    state = algo.init(jax.random.key(0), params, 10)
    with pytest.raises(ValueError, match=f"coreset_size={size + 1} exceeds the number of points"):
        run_rounds(algo, jax.random.key(1), state, digits_fed, 1, client_map="map")
