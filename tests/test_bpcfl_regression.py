"""BPC-FL's 1-D regression suite (experiments.bpcfl_regression, run by experiments.suite): one run of the
``quick`` setting (module fixture) checked for its files, its JSON fields, the measured uplink (the
pseudocoreset stream formula), finite numbers and the suite's table; bad input exits with code 2 and one
line, writing nothing; a finished run is skipped, one of another configuration refused."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest

from experiments.bpcfl_regression import (
    PAPER,
    QUICK,
    SUITE,
    RegressionConfig,
    gaussian_nll_loss,
    predictive_numbers,
    suite_config,
)
from experiments.suite import main

METHODS = ("bpcfl_map", "bpcfl_hmc", "fedavg", "fedavg_one_shot")
_QUICK_RUN = "--setting quick --only sigma03 --seeds 1".split()


# The quick run trains BPC-FL, HMC and FedAvg end to end (about 19 s from an empty compilation cache): the
# three tests that read it are slow; the settings, the loss and the bad-input tests are not.
_quick_run_is_slow = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    suite_dir = tmp_path_factory.mktemp("bpcfl_regression")
    assert main(["bpcfl_regression", "run", str(suite_dir), *_QUICK_RUN]) == 0
    out = suite_dir / f"{SUITE.preset_name('quick', 'sigma03')}_s1"
    return out, json.loads((out / "results.json").read_text())


@_quick_run_is_slow
def test_files_and_fields(quick_run):
    out, report = quick_run
    assert (out / "predictive.png").stat().st_size > 10_000
    assert report["quick"] is True and report["clients"] == 5 and report["num_params"] == 16_897
    assert set(report["methods"]) == set(METHODS)
    fields = (
        "test_rmse",
        "test_nll",
        "test_nll_eval_sigma",
        "epistemic_std_inside",
        "epistemic_std_gaps",
        "epistemic_std_outside",
        "predictive_std_inside",
        "predictive_std_gaps",
        "uplink_bits_per_client_round",
        "uplink_floats_total",
        "downlink_floats_total",
        "wall_s",
    )
    for name in METHODS:
        entry = report["methods"][name]
        for field in fields:
            assert field in entry, (name, field)
        for field in fields:
            values = np.atleast_1d(np.asarray(entry[field], np.float64))
            assert np.all(np.isfinite(values)), (name, field)
    hmc = report["methods"]["bpcfl_hmc"]
    assert 0.0 <= hmc["hmc_acceptance"] <= 1.0 and hmc["hmc_finite"]
    fed = report["methods"]["fedavg"]
    assert fed["rounds"] == QUICK["fedavg_rounds"] and len(fed["test_rmse_per_round"]) == fed["rounds"]
    # point estimates carry no epistemic std; their predictive std is the likelihood's sigma
    for name in ("bpcfl_map", "fedavg", "fedavg_one_shot"):
        assert report["methods"][name]["epistemic_std_gaps"] == 0.0
        assert report["methods"][name]["predictive_std_gaps"] == pytest.approx(report["sigma"])
    # (whether HMC moves at all on the tiny quick coreset is not checked: quick is a smoke run)
    assert hmc["epistemic_std_gaps"] >= 0.0 and hmc["hmc_divergent"] >= 0


@_quick_run_is_slow
def test_bpcfl_uplink_is_the_stream_formula(quick_run):
    _, report = quick_run
    k = QUICK["num_points"]
    formula = 32 * k * 1 + 32 * k + 32  # [Z: K x 1 float32][labels: K float32][n_m: 32 bits]
    assert report["bpcfl_uplink_formula_bits"] == formula
    for name in ("bpcfl_map", "bpcfl_hmc"):
        entry = report["methods"][name]
        assert entry["uplink_bits_per_client_round"] == [formula] * 5
        assert entry["uplink_floats_total"] == 5 * (2 * k + 1)
        assert entry["downlink_floats_total"] == 0
    assert report["bpcfl_diagnostics"]["uplink_errors"] == [0] * 5
    # FedAvg sends (at least) the P float32 parameters up per client per round
    fed = report["methods"]["fedavg"]
    assert min(fed["uplink_bits_per_client_round"]) >= 32 * 16_897
    assert fed["uplink_floats_total"] >= 5 * fed["rounds"] * 16_897
    one = report["methods"]["fedavg_one_shot"]
    assert one["rounds"] == 1 and one["uplink_floats_total"] == pytest.approx(fed["uplink_floats_total"] / 3)


@_quick_run_is_slow
def test_pseudocoreset_is_reported(quick_run):
    _, report = quick_run
    pc = report["pseudocoreset"]
    k = QUICK["num_points"]
    assert np.asarray(pc["inputs"]).shape == (5, k) and np.asarray(pc["labels"]).shape == (5, k)
    np.testing.assert_allclose(pc["weights"], 1.0, rtol=1e-6)  # equal n_m: w_m = M n_m / N = 1
    assert np.all(np.isfinite(pc["inputs"])) and np.all(np.isfinite(pc["labels"]))


def test_paper_settings_are_table_2_3_7():
    p = PAPER
    assert (p["num_points"], p["prior_precision"], p["init_std"], p["step_size_inputs"]) == (
        6,
        1e-2,
        1.0,
        1e-2,
    )
    assert (p["step_size_labels"], p["pairs_per_update"], p["num_noise"], p["noise_std"]) == (
        1.0,
        10,
        10,
        1e-2,
    )
    assert (p["num_trajectories"], p["pretrain_steps"], p["save_interval"], p["pretrain_batch_size"]) == (
        100,
        300,
        5,
        20,
    )
    assert (p["data_chain_length"], p["coreset_chain_length"], p["num_updates"]) == (150, 200, 400)
    assert (p["map_lr"], p["map_steps"]) == (1e-2, 300)
    assert (p["hmc_step_size"], p["hmc_inverse_mass"], p["hmc_integration_steps"]) == (1e-3, 50.0, 20)
    assert (p["hmc_burnin"], p["hmc_samples"]) == (200, 40)
    assert (p["fedavg_client_lr"], p["fedavg_server_lr"], p["fedavg_local_steps"], p["fedavg_rounds"]) == (
        1e-2,
        0.1,
        10,
        100,
    )


def test_gaussian_nll_loss_and_predictive_numbers():
    import jax.numpy as jnp

    from sidejax.fl import Batch

    def apply_fn(variables, x):
        return x * variables["params"]["w"]

    loss = gaussian_nll_loss(apply_fn, 0.5)
    x = jnp.array([[1.0], [2.0], [3.0]])
    y = jnp.array([1.0, 1.0, 100.0])
    value = loss({"w": jnp.float32(1.0)}, Batch(x, y, jnp.array([1.0, 1.0, 0.0])), None)
    want = np.mean([0.0, 0.5 * (1.0 / 0.5) ** 2]) + math.log(0.5) + 0.5 * math.log(2 * math.pi)
    assert float(value) == pytest.approx(want, rel=1e-6)
    # S identical samples: the mixture NLL is the single-model NLL (docs/papers/bpcfl.md#t12)
    grid = np.linspace(-1.2, 1.2, 25)
    f = np.array([[0.0, 1.0]])
    a = predictive_numbers(f, np.array([0.3, 0.7]), np.zeros((1, 25)), grid, 0.3)
    b = predictive_numbers(np.repeat(f, 4, axis=0), np.array([0.3, 0.7]), np.zeros((4, 25)), grid, 0.3)
    assert a["test_nll"] == pytest.approx(b["test_nll"]) and a["test_rmse"] == pytest.approx(0.3)
    assert a["test_nll_eval_sigma"] == a["test_nll"]
    c = predictive_numbers(f, np.array([0.3, 0.7]), np.zeros((1, 25)), grid, 1.0, eval_sigma=0.3)
    assert c["test_nll_eval_sigma"] == pytest.approx(a["test_nll"]) and c["test_nll"] != a["test_nll"]


@_quick_run_is_slow
def test_the_suite_skips_the_finished_run_refuses_another_and_tabulates(quick_run, capsys):
    """Run again with the same configuration: skipped; with another (more FedAvg rounds): refused, untouched;
    the table has a row per method with the run's numbers, and ``plot`` redraws the run's figure."""
    out, report = quick_run
    args = ["bpcfl_regression", "run", str(out.parent), *_QUICK_RUN]
    capsys.readouterr()
    assert main(args) == 0
    assert "finished run found" in capsys.readouterr().out
    before = (out / "results.json").read_bytes()
    assert main([*args, "--rounds", "4"]) == 2
    assert (
        "another configuration" in capsys.readouterr().err and (out / "results.json").read_bytes() == before
    )
    md = (out.parent / "table.md").read_text().splitlines()
    assert md[0].startswith("| method | sigma | RMSE | NLL |") and len(md) == 2 + len(METHODS)
    fed = next(line for line in md if line.startswith("| FedAvg |"))
    assert f"| {report['methods']['fedavg']['test_rmse']:.4f} |" in fed
    (out / "predictive.png").unlink()
    assert main(["bpcfl_regression", "plot", str(out.parent)]) == 0
    assert (out / "predictive.png").stat().st_size > 10_000


def test_the_suite_configs_are_the_papers_and_the_variants():
    assert suite_config("fig2", "sigma03") == RegressionConfig()
    assert (suite_config("fig4", "sigma1").per_client, suite_config("fig4", "sigma1").sigma) == (20, 1.0)
    quick = suite_config("quick", "sigma1_hmc_map")
    assert (quick.quick, quick.hmc_start, quick.hp["num_points"], quick.hp["fedavg_rounds"]) == (
        True,
        "map",
        3,
        3,
    )
    with pytest.raises(ValueError, match="unknown variant"):
        suite_config("fig2", "sigma2")


@pytest.mark.parametrize(
    "sets, message",
    [
        (["per_client=4"], "per_client 4 is smaller than the pseudocoreset size K = 6"),
        (["clients=0"], "clients must be >= 1"),
        (["sigma=0"], "sigma must be"),
        (["hmc_start=nuts"], "hmc_start must be"),
        (["steps=fast"], "steps must be"),
        (["sigmaa=1"], "--set sigmaa: not a field of the regression"),
        (["clients=two"], "--set clients=two: expected a value of type int"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, sets, message):
    out = tmp_path / "out"
    argv = ["bpcfl_regression", "run", str(out), "--setting", "fig2"]
    assert main([*argv, *(x for s in sets for x in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    with pytest.raises(ValueError, match="per_client 2 is smaller than the pseudocoreset size K = 3"):
        RegressionConfig(quick=True, per_client=2)


def test_unit_sigma_steps_keep_the_label_gain_of_sigma_1():
    """docs/papers/bpcfl.md#dep-regression-sigma on a linear-Gaussian coreset (closed form): ``f(z, θ) =
    φ(z)ᵀθ``, ``K = 6 < P = 8`` points, the client's mean-reduced ``ℓ̄ + λ/2‖θ‖²`` at σ = 0.3, exact samples
    of ``π_D`` and of the current ``π_C``. One label update is affine in ŷ; its gain matrix ``I − ∂ŷ'/∂ŷ``
    (differences with common keys) is ``ψ_y S/(Kσ²)`` with ``S = Φ Σ_C Φᵀ/(Kσ²)``, the coreset posterior's
    hat matrix (eigenvalues just below 1: the coreset fits its labels). Table 2's ψ_y = 1 has gain 1.85, an
    overshooting step next to the limit 2 that multiplies the sampling noise's variance by g/(2 − g) = 12;
    the rescaled ψ_y σ² has gain 1/K, as at σ = 1. Over 3,000 updates the labels' spread about their mean
    follows g/(2 − g). σ = 1 keeps Table 2 (and its bits)."""
    import jax
    import jax.numpy as jnp
    import optax

    from sidejax.bayes.pseudocoresets import Pseudocoreset, learn_pseudocoreset

    printed, scaled = RegressionConfig(steps="printed").hp, RegressionConfig().hp
    assert RegressionConfig(sigma=1.0).hp == printed
    assert (scaled["step_size_inputs"], scaled["hmc_step_size"]) == pytest.approx((0.01 * 0.09, 1e-3 * 0.3))
    k, p, sigma, lam = PAPER["num_points"], 8, 0.3, PAPER["prior_precision"]
    rng = np.random.default_rng(0)
    phi = rng.normal(size=(k, p)) / np.sqrt(p)
    cov_c = np.linalg.inv(phi.T @ phi / (k * sigma**2) + lam * np.eye(p))
    hat = phi @ cov_c @ phi.T / (k * sigma**2)
    mu_d, chol_d = rng.normal(size=p), 0.05 * np.eye(p)
    chol_c = np.linalg.cholesky(cov_c)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)

    def loss_fn(c, theta):  # the client's coreset loss: mean NLL (σ = 0.3) plus the prior
        return jnp.mean((c.labels - c.inputs @ theta) ** 2) / (2 * sigma**2) + 0.5 * lam * theta @ theta

    def exact_pairs(key, c):  # θ_D ~ π_D, θ_C ~ π_C(ŷ), B = 1
        mu_c = f32(cov_c) @ (f32(phi).T @ c.labels) / (k * sigma**2)
        e = jax.random.normal(key, (2, 1, p))
        return f32(mu_d) + e[0] @ f32(chol_d).T, mu_c + e[1] @ f32(chol_c).T

    @functools.partial(jax.jit, static_argnums=0)
    def learn(psi_y, labels, key):  # one update
        return learn_pseudocoreset(
            loss_fn, Pseudocoreset(f32(phi), labels), key, sample_pairs=exact_pairs, num_updates=1,
            optimizer=optax.sgd(0.0), chain_length=0, step_size_inputs=0.0, step_size_labels=psi_y,
        )[0].labels  # fmt: skip

    @functools.partial(jax.jit, static_argnums=0)
    def trace(psi_y, labels, key):  # the labels after each of 3,000 updates
        def step(y, u):
            y = learn(psi_y, y, jax.random.fold_in(key, u))
            return y, y

        return jax.lax.scan(step, labels, jnp.arange(3000))[1]

    y0 = f32(rng.normal(size=k))
    shifted = y0 + 0.5 * jnp.eye(k)  # row i: ŷ with label i moved by 0.5
    for hp in (printed, scaled):
        psi = hp["step_size_labels"]
        base = np.asarray(learn(psi, y0, jax.random.key(1)), np.float64)
        moved = np.asarray(jax.vmap(lambda y, psi=psi: learn(psi, y, jax.random.key(1)))(shifted), np.float64)
        gain = np.eye(k) - (moved.T - base[:, None]) / 0.5
        np.testing.assert_allclose(gain, psi * hat / (k * sigma**2), atol=2e-3)
    g_printed = printed["step_size_labels"] / (k * sigma**2)
    g_scaled = scaled["step_size_labels"] / (k * sigma**2)
    assert g_printed == pytest.approx(1.852, abs=1e-3) and g_scaled == pytest.approx(1 / k)
    # the stationary spread of the labels: variance amplification g/(2 − g), 12.3 against 0.091
    spreads = [
        np.mean(np.var(np.asarray(trace(hp["step_size_labels"], y0, jax.random.key(2)))[1000:], axis=0))
        for hp in (printed, scaled)
    ]
    want = (g_printed / (2 - g_printed)) / (g_scaled / (2 - g_scaled))
    assert 0.7 * want < spreads[0] / spreads[1] < 1.4 * want, (spreads, want)


def test_the_dosfl_variants_are_table_4_as_printed_and_read_at_unit_variance():
    """``dosfl``: Table 4's regression column as printed (docs/papers/bpcfl.md#table-4); ``dosfl_unit_sigma``:
    its three SGD steps times σ² (docs/papers/bpcfl.md#dosfl), nothing else changed; both train DOSFL
    alone at σ = 0.3."""
    printed, unit = suite_config("fig2", "dosfl"), suite_config("fig2", "dosfl_unit_sigma")
    assert (printed.methods, printed.steps, printed.sigma) == ("dosfl", "printed", 0.3)
    assert (unit.methods, unit.steps, unit.sigma) == ("dosfl", "unit_sigma", 0.3)
    hp = printed.hp
    assert (hp["dosfl_steps"], hp["dosfl_epochs"], hp["dosfl_batch_size"]) == (20, 1, 10)
    assert (hp["dosfl_input_lr"], hp["dosfl_label_lr"], hp["dosfl_init_lr"]) == (0.1, 0.1, 0.01)
    for name in ("dosfl_input_lr", "dosfl_label_lr", "dosfl_init_lr"):
        assert unit.hp[name] == pytest.approx(hp[name] * 0.09)
    assert {k for k in hp if unit.hp[k] != hp[k]} == {
        "dosfl_input_lr",
        "dosfl_label_lr",
        "dosfl_init_lr",
        "step_size_inputs",
        "step_size_labels",
        "hmc_step_size",
    }
    assert suite_config("fig2", "sigma03").methods == "bpcfl"


def test_a_run_saved_before_the_methods_field_is_the_same_run(tmp_path):
    """A finished run whose saved config predates ``methods`` (a BPC-FL run) is skipped, not refused."""
    import dataclasses

    from experiments.bpcfl_regression import RegressionRunner

    config = suite_config("fig2", "sigma03")
    saved = {k: v for k, v in dataclasses.asdict(config).items() if k != "methods"}
    (tmp_path / "results.json").write_text(json.dumps({"config": saved}))
    assert RegressionRunner().plan(tmp_path, config, False)[0] == "skip"
    assert RegressionRunner().plan(tmp_path, suite_config("fig2", "dosfl"), False)[0] == "refuse"


@pytest.mark.slow  # DOSFL's unroll through the regression MLP: about 45 s cold
def test_a_quick_dosfl_run_writes_its_results_and_table(tmp_path):
    assert main(["bpcfl_regression", "run", str(tmp_path), "--setting", "quick", "--only", "dosfl"]) == 0
    out = tmp_path / SUITE.preset_name("quick", "dosfl")
    report = json.loads((out / "results.json").read_text())
    assert set(report["methods"]) == {"dosfl"}
    dosfl = report["methods"]["dosfl"]
    # 3 steps x 4 points x (1 + 1) + 1 floats per client (QUICK), float32
    assert dosfl["uplink_bits_per_client_round"] == [32 * 25] * 5 and dosfl["downlink_floats_total"] == 0
    assert report["dosfl_uplink_formula_floats"] == 5 * 25
    diagnostics = report["dosfl_diagnostics"]
    assert len(diagnostics["own_replay_test_rmse"]) == 5 and len(report["dosfl_distilled"]["lr"]) == 5
    assert math.isfinite(dosfl["test_rmse"])
    assert (out / "predictive.png").stat().st_size > 10_000
    md = (tmp_path / "table.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in md[2:]] == ["DOSFL"]
