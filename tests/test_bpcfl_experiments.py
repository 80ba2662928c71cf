"""The BPC-FL suite (experiments.bpcfl, run by experiments.suite): presets, the bpcfl method section's checks,
the table (NLL / accuracy / ECE / measured floats, communication to match), the FedAvg warm start from a
BPC-FL run's final model, and the fault paths (one-shot rounds, K larger than a client's data, a missing
or mismatched warm start)."""

from __future__ import annotations

import json

import pytest
from suite_helpers import assert_shipped_presets, use_configs

from experiments.bpcfl import METHODS, SETTINGS, SUITE, suite_config
from experiments.config import load_preset
from experiments.driver import run_experiment
from experiments.suite import main

preset_name = SUITE.preset_name

# a tiny moons federation and BPC-FL (a few updates, short chains): the tooling, not the method's quality
_TINY_BPC = {
    "method.num_updates": 3,
    "method.pairs_per_update": 2,
    "method.num_noise": 2,
    "method.num_trajectories": 2,
    "method.pretrain_steps": 20,
    "method.data_chain_length": 10,
    "method.coreset_chain_length": 3,
    "method.map_steps": 20,
    "method.hmc_burnin": 2,
    "method.hmc_samples": 3,
    "method.hmc_integration_steps": 3,
}
_TINY_FL = {"run.rounds": 4, "run.eval_every": 2}


def _run_quietly(cfg, out):
    """``run_experiment`` without a progress bar or log lines."""
    return run_experiment(cfg, out, progress=False, verbose=False)


def _tiny(method: str):
    cfg = suite_config("moons", method)
    return cfg.override(_TINY_BPC if cfg.method.name == "bpcfl" else _TINY_FL)


def test_the_shipped_presets_are_the_suite_definitions(tmp_path):
    assert_shipped_presets(SUITE, SETTINGS, METHODS, tmp_path)
    # the paper's moons column (docs/papers/bpcfl.md#table-2, docs/papers/bpcfl.md#table-3,
    # docs/papers/bpcfl.md#table-7) and EMNIST's (Table 2)
    hmc = load_preset("bpcfl_moons_bpcfl_hmc")
    m = hmc.method
    assert (hmc.run.rounds, hmc.data.num_clients, hmc.data.train_subset, hmc.data.model) == (
        1,
        5,
        100,
        "moons_mlp",
    )
    assert (m.num_points, m.prior_precision, m.init_std, m.num_updates, m.step_size_inputs) == (
        5,
        0.1,
        0.6,
        700,
        1e-1,  # the one stated change to Table 2's moons column (the printed 1e-3: the bpcfl defaults)
    )
    assert (m.pairs_per_update, m.num_trajectories, m.pretrain_steps, m.data_chain_length) == (
        20,
        100,
        400,
        150,
    )
    assert (m.coreset_chain_length, m.num_noise, m.noise_std, m.sampler) == (200, 10, 1e-2, "adam")
    assert (m.hmc_step_size, m.hmc_inverse_mass, m.hmc_integration_steps, m.hmc_burnin, m.hmc_samples) == (
        2e-3,
        100.0,
        30,
        40,
        50,
    )
    emnist = load_preset("bpcfl_emnist_bpcfl_sgd")
    e = emnist.method
    assert (emnist.data.subset, emnist.data.model, emnist.data.num_clients, e.num_points) == (
        "byclass",
        "bpcfl_convnet",
        100,
        62,
    )
    assert (e.step_size_inputs, e.init_std, e.noise_std, e.sampler, e.coreset_chain_length) == (
        100.0,
        1e-3,
        1e-4,
        "sgd",
        250,
    )
    assert load_preset("bpcfl_moons_bpcfl_fedavg").run.init_from == "bpcfl_moons_bpcfl_sgd"
    # DOSFL: Table 4's 2-D classification column (docs/papers/bpcfl.md#table-4), one round
    dosfl = load_preset("bpcfl_moons_dosfl")
    d = dosfl.method
    assert (dosfl.run.rounds, d.distill_steps, d.distill_epochs, d.distill_batch_size, d.init_lr) == (
        1,
        30,
        20,
        30,
        0.01,
    )
    assert (d.input_optimizer, d.input_lr, d.lr_optimizer, d.lr_step_size) == ("momentum", 0.01, "adam", 1e-4)
    assert load_preset("bpcfl_moons_fedavg_oneshot").run.rounds == 1


def test_bad_configs_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="unknown method"):
        suite_config("moons", "bpcfl_nuts")
    with pytest.raises(ValueError, match="run.rounds must be 1 for bpcfl: it is one-shot"):
        suite_config("moons", "bpcfl_sgd").override({"run.rounds": 3})
    with pytest.raises(ValueError, match="data.participation must be 1 for bpcfl"):
        suite_config("moons", "bpcfl_sgd").override({"data.participation": 0.4})
    with pytest.raises(ValueError, match="pretrain_steps"):
        suite_config("moons", "bpcfl_sgd").override({"method.pretrain_steps": 200})
    # K larger than a client's 20 points: refused before anything is written
    out = tmp_path / "big_k"
    with pytest.raises(ValueError, match="num_points=25 .* exceeds the data of client"):
        _run_quietly(_tiny("bpcfl_sgd").override({"method.num_points": 25}), out)
    assert not out.exists()
    # a warm start from a folder without a finished run
    with pytest.raises(FileNotFoundError, match="run.init_from=.*no final_params"):
        _run_quietly(_tiny("fedavg").override({"run.init_from": str(tmp_path)}), tmp_path / "w")


@pytest.mark.slow  # the paper suite's table command end to end (runs, resume, table, plot): 20-30 s cold
def test_table_runs_bpcfl_and_warm_started_fedavg(tmp_path, monkeypatch, capsys):
    """End to end on a tiny moons federation: BPC-FL + SGD, FedAvg and the warm start over one seed; the
    table has NLL / accuracy / ECE, measured floats (BPC-FL: the streams' bits / 32), FedAvg's floats to
    reach BPC-FL's NLL, and the warm start counts BPC-FL's upload; a second call skips finished runs."""
    chosen = ("bpcfl_sgd", "fedavg", "bpcfl_fedavg")
    use_configs(monkeypatch, SUITE, {preset_name("moons", m): _tiny(m) for m in chosen})
    args = ["bpcfl", "run", str(tmp_path), "--setting", "moons", "--only", *chosen, "--seeds", "0"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.count("finished run found") == 3
    md = (tmp_path / "table.md").read_text()
    assert md.splitlines()[0].startswith("| method | NLL | acc (%) | ECE | uplink floats | total floats |")
    lines = {line.split("|")[1].strip(): line.split("|") for line in md.splitlines()[2:]}
    assert set(lines) == {"BPC-FL + SGD", "FedAvg", "BPC-FL + SGD, then FedAvg"}
    bpc_run = tmp_path / (preset_name("moons", "bpcfl_sgd") + "_s0")
    rows = [json.loads(line) for line in (bpc_run / "metrics.jsonl").read_text().splitlines()]
    # 5 clients x (32 x 5 x 2 + 5 x 1 + 32) bits = 5 x 357 bits, nothing downlink
    assert len(rows) == 1 and rows[0]["uplink_bits"] == 5 * 357 and rows[0]["downlink_bits"] == 0
    assert rows[0]["test_ece"] is not None and rows[0]["test_loss"] is not None
    bpc_floats = 5 * 357 / 32
    assert float(lines["BPC-FL + SGD"][5]) == pytest.approx(bpc_floats, rel=1e-3)
    # the warm start: its FedAvg rounds plus BPC-FL's upload
    warm = tmp_path / (preset_name("moons", "bpcfl_fedavg") + "_s0")
    config = json.loads((warm / "config.json").read_text())
    assert config["run"]["init_from"] == str(bpc_run)
    fed_rows = [json.loads(line) for line in (warm / "metrics.jsonl").read_text().splitlines()]
    assert float(lines["BPC-FL + SGD, then FedAvg"][6]) == pytest.approx(
        bpc_floats + fed_rows[-1]["cumulative_bits"] / 32, rel=1e-3
    )
    assert (tmp_path / "accuracy_vs_floats.png").stat().st_size > 1000


@pytest.mark.slow  # a DOSFL run through the driver: about 15 s cold
def test_dosfl_runs_through_the_driver_and_the_table(tmp_path, monkeypatch):
    """A tiny moons DOSFL (2 steps x 4 points, 2 epochs, 2 updates): one round, the measured upload is the
    paper's S·B·(D + 1) + 1 floats per client, nothing downlink, its row in the table."""
    tiny = {"method.distill_steps": 2, "method.distill_epochs": 2, "method.distill_batch_size": 4}
    tiny["method.num_updates"] = 2
    use_configs(
        monkeypatch, SUITE, {preset_name("moons", "dosfl"): suite_config("moons", "dosfl").override(tiny)}
    )
    assert main(["bpcfl", "run", str(tmp_path), "--setting", "moons", "--only", "dosfl", "--seeds", "0"]) == 0
    rows = [
        json.loads(x) for x in (tmp_path / "bpcfl_moons_dosfl_s0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert (
        len(rows) == 1
        and rows[0]["uplink_bits"] == 5 * 32 * (2 * 4 * 3 + 1)
        and rows[0]["downlink_bits"] == 0
    )
    assert rows[0]["distill_loss_last"] < rows[0]["distill_loss_first"]
    md = (tmp_path / "table.md").read_text().splitlines()
    (row,) = [line.split("|") for line in md[2:] if line.split("|")[1].strip() == "DOSFL"]
    assert float(row[5]) == pytest.approx(5 * (2 * 4 * 3 + 1), rel=1e-3)


@pytest.mark.slow  # a BPC-FL run with HMC through the driver: about 17 s cold
def test_divergent_hmc_is_reported_by_the_driver(tmp_path, capsys):
    """An HMC step far past stability on the server: the run finishes, its metrics count the divergent
    transitions and the driver says so on stderr, with what to change."""
    out = tmp_path / "hmc"
    _run_quietly(_tiny("bpcfl_hmc").override({"method.hmc_step_size": 5.0}), out)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["hmc_divergent"] > 0
    err = capsys.readouterr().err
    assert "divergent transitions (hmc_divergent)" in err and "method.hmc_step_size, now 5.0" in err


def _trace_emnist_round(preset: str):
    """One round of ``preset``'s algorithm (EMNIST-62, the ConvNet, 100 clients) on a stand-in federation of
    the right shapes (EMNIST's files are not here), traced (shapes only, nothing runs): ``(algorithm, new
    state, round info)``."""
    import jax
    import numpy as np

    from experiments.algorithms import ModelContext, build_algorithm
    from sidejax.data import make_federated_data
    from sidejax.fl import build_round_step, classification_loss
    from sidejax.keys import round_key, run_keys
    from sidejax.models import get_model, init_params

    config = load_preset(preset)
    spec = get_model(config.data.model, num_classes=62, input_shape=(28, 28, 1))
    model = ModelContext(lambda key: init_params(key, spec), (28, 28, 1), 62)
    algo = build_algorithm(config, classification_loss(spec.module.apply), model=model)
    x = np.zeros((100 * 70, 28, 28, 1), np.float32)
    y = np.arange(100 * 70, dtype=np.int32) % 62
    fed = make_federated_data(x, y, [np.arange(70 * c, 70 * (c + 1)) for c in range(100)])
    init_key, rounds_key = run_keys(0)
    state = jax.eval_shape(lambda k: algo.init(k, init_params(k, spec), 100), init_key)
    new_state, info = jax.eval_shape(
        build_round_step(algo, client_map="map"), round_key(rounds_key, 0), state, fed
    )
    return algo, new_state, info


@pytest.mark.slow  # a paper-scale trace (100 clients, DOSFL's unroll through the EMNIST ConvNet)
def test_the_emnist_dosfl_preset_traces_one_round_of_the_convnet():
    """DOSFL on EMNIST is not run (the paper: out of memory; here a GPU setting): its preset's algorithm
    traces one round of 100 clients on the ConvNet, the global model has the ConvNet's shapes and the server
    holds 30 x 30 distilled images per client."""
    from sidejax.models import count_params

    algo, new_state, info = _trace_emnist_round("bpcfl_emnist_dosfl")
    assert count_params(algo.eval_params(new_state)) == 1_206_590
    assert new_state.server.distilled.inputs.shape == (100, 30, 30, 28, 28, 1)
    assert info.uplink_bits.shape == (100,)


@pytest.mark.slow  # a paper-scale trace (100 clients, the EMNIST ConvNet)
def test_the_emnist_preset_traces_one_round_of_the_convnet():
    """The GPU preset's algorithm (EMNIST-62, the ConvNet, K = 62, 100 clients) on a stand-in federation of
    the right shapes (EMNIST's files are not here): one round traces (shapes only, nothing runs), the
    posterior samples have the ConvNet's shapes (the upload's length at these sizes:
    tests/algorithms/test_bpcfl.py::test_emnist_stream_length_is_measured_from_the_message)."""
    import jax
    import numpy as np

    from sidejax.bits import BITS_DTYPE
    from sidejax.keys import run_keys
    from sidejax.models import count_params, get_model, init_params

    algo, new_state, info = _trace_emnist_round("bpcfl_emnist_bpcfl_sgd")
    spec = get_model("bpcfl_convnet", num_classes=62, input_shape=(28, 28, 1))
    init_key, _ = run_keys(0)
    samples = algo.eval_params(new_state)
    assert (
        sum(int(np.prod(a.shape[1:])) for a in jax.tree.leaves(samples))
        == count_params(jax.eval_shape(lambda k: init_params(k, spec), init_key))
        == 1_206_590
    )
    assert new_state.server.coreset.inputs.shape == (100 * 62, 28, 28, 1)
    assert info.uplink_bits.shape == (100,) and info.uplink_bits.dtype == BITS_DTYPE  # exact lengths


def test_a_warm_start_from_another_model_or_a_damaged_file_is_refused(tmp_path):
    """run.init_from must hold a finished run of the same model; a damaged final model is refused by its
    checksum; neither leaves a run folder behind."""
    source = tmp_path / "fedavg"
    _run_quietly(_tiny("fedavg").override({"run.rounds": 1, "run.eval_every": 1}), source)
    other = suite_config("fmnist_cpu", "fedavg").override(
        {"data.dataset": "digits", "data.model": "mlp_32_16", "data.train_subset": 200, "run.rounds": 1}
    )
    with pytest.raises(ValueError, match="cannot initialise this run .* same data.model"):
        _run_quietly(other.override({"run.init_from": str(source)}), tmp_path / "a")
    ckpt = source / "final_params" / "state.ckpt"
    ckpt.write_bytes(ckpt.read_bytes() + b"x")
    with pytest.raises(ValueError, match="is damaged"):
        _run_quietly(_tiny("fedavg").override({"run.init_from": str(source)}), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
