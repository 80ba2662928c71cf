"""The CoreSet-PFedBayes suite (experiments.coreset_pfedbayes, run by experiments.suite): presets, the table
with seeds (mean ± std per method, personal and global accuracy, rounds to 99%, measured uplink floats)."""

from __future__ import annotations

import json

import pytest
from suite_helpers import SMALL_FEDERATION, assert_shipped_presets, use_configs

from experiments.config import load_preset
from experiments.coreset_pfedbayes import METHODS, SETTINGS, SUITE, rounds_to_fraction, suite_config
from experiments.suite import main

preset_name = SUITE.preset_name

_SMALL = {
    **SMALL_FEDERATION,
    "data.examples_per_label": 20,
    "data.train_fraction": 0.5,
    "method.local_iters": 2,
    "method.personal_steps": 1,
    "method.batch_size": 16,
}


def test_the_shipped_presets_are_the_suite_definitions(tmp_path):
    assert_shipped_presets(SUITE, SETTINGS, METHODS, tmp_path)
    # the paper's setting (docs/papers/coreset_pfedbayes.md#s3-1): pFedMe's split, 10 clients x 5 labels x
    # 1,000, 20% train, MLP 784-100-10, zeta 10, Adam 1e-3 both tracks, R = 20, R_p = 5, b = 100; coreset
    # sizes: fractions of 1,000
    cfg = load_preset("coreset_pfedbayes_fmnist_mlp_coreset_30")
    data, method = cfg.data, cfg.method
    assert (data.partition, data.num_clients, data.labels_per_client, data.examples_per_label) == (
        "pfedme",
        10,
        5,
        1000,
    )
    assert (data.train_fraction, data.model, cfg.run.rounds) == (0.2, "mlp_100", 200)
    assert (method.zeta, method.personal_lr, method.global_lr, method.local_iters, method.personal_steps) == (
        10.0,
        0.001,
        0.001,
        20,
        5,
    )
    assert (method.batch_size, method.coreset_size, method.coreset_every, method.eps_std) == (
        100,
        300,
        1,
        1.0,
    )
    assert load_preset("coreset_pfedbayes_fmnist_mlp_cpu_coreset_50").method.coreset_every == 10
    assert load_preset("coreset_pfedbayes_fmnist_mlp_cpu_random_50").method.subset_size == 500


@pytest.mark.parametrize("dataset", ["mnist", "fmnist"])
def test_the_personalized_baselines_presets_trace_one_round_at_the_papers_size(dataset):
    """pFedMe and Per-FedAvg at the tables' settings (pFedMe's code, docs/papers/coreset_pfedbayes.md#pfedme):
    the presets carry them, and each builds and traces one round (shapes only, nothing runs: MNIST is not
    available offline) on a stand-in federation of pFedMe's split (10 clients x 1,000 training examples,
    28 x 28 inputs, the MLP 784-100-10): every client's personal model, a 79,510-float upload each."""
    import jax
    import numpy as np

    from experiments.algorithms import build_algorithm
    from sidejax.data import make_federated_data
    from sidejax.fl import build_round_step, classification_loss
    from sidejax.keys import round_key, run_keys
    from sidejax.models import get_model, init_params

    pfedme_cfg = load_preset(preset_name(f"{dataset}_mlp", "pfedme"))
    perfedavg_cfg = load_preset(preset_name(f"{dataset}_mlp", "perfedavg"))
    m = pfedme_cfg.method
    assert (m.lr, m.personal_lr, m.lam, m.inner_steps, m.local_iters, m.batch_size, m.beta) == (
        0.005,
        0.1,
        15.0,
        5,
        20,
        20,
        1.0,
    )
    m = perfedavg_cfg.method
    assert (m.alpha, m.beta, m.local_iters, m.batch_size, m.variant) == (0.005, 0.001, 20, 20, "fo")
    assert pfedme_cfg.data.partition == perfedavg_cfg.data.partition == "pfedme"
    spec = get_model("mlp_100", num_classes=10, input_shape=(28, 28, 1))
    x = np.zeros((10 * 1000, 28, 28, 1), np.float32)
    fed = make_federated_data(x, np.arange(10 * 1000, dtype=np.int32) % 10, np.arange(10_000).reshape(10, -1))
    init_key, rounds_key = run_keys(0)
    for config in (pfedme_cfg, perfedavg_cfg):
        algo = build_algorithm(config, classification_loss(spec.module.apply))
        state = jax.eval_shape(lambda k, algo=algo: algo.init(k, init_params(k, spec), 10), init_key)
        new, info = jax.eval_shape(
            build_round_step(algo, client_map="map"), round_key(rounds_key, 0), state, fed
        )
        personal = algo.evaluation.personal(new)
        assert {a.shape[0] for a in jax.tree.leaves(personal)} == {10}
        assert sum(int(np.prod(a.shape[1:])) for a in jax.tree.leaves(personal)) == 79_510
        assert info.uplink_bits.shape == (10,)


def test_bad_names_and_configs_say_what_to_do():
    with pytest.raises(ValueError, match="unknown method"):
        suite_config("fmnist_mlp", "coreset_5")
    with pytest.raises(ValueError, match="projection_samples"):
        suite_config("fmnist_mlp", "coreset_50").override({"method.projection_samples": 400})


def test_rounds_to_fraction():
    rows = [{"round": r, "personal_accuracy": a} for r, a in [(5, 0.5), (10, None), (15, 0.95), (20, 0.9)]]
    assert rounds_to_fraction(rows) == 15
    assert rounds_to_fraction(rows, fraction=0.5) == 5
    assert rounds_to_fraction([{"round": 1, "personal_accuracy": None}]) is None


@pytest.mark.slow  # the paper suite's table command end to end (runs, resume, table, plot): 20-30 s cold
def test_table_command_runs_seeds_and_averages_them(tmp_path, monkeypatch, capsys):
    """End to end on digits (2 rounds, 4 clients, pFedMe's split with 20 examples per label): CoreSet-
    PFedBayes and RandomSubset over two seeds, a second call skips the finished runs, the table has one row
    per method with mean ± std of the personal and global accuracy, the measured floats per client per
    round (2P), and a damaged folder is skipped with a warning."""
    chosen = ("coreset_50", "random_50")
    sizes = {"coreset_50": {"method.coreset_size": 25}, "random_50": {"method.subset_size": 25}}  # of 50
    small = {
        preset_name("fmnist_mlp_cpu", m): suite_config("fmnist_mlp_cpu", m).override({**_SMALL, **sizes[m]})
        for m in chosen
    }
    use_configs(monkeypatch, SUITE, small)
    args = [
        "coreset_pfedbayes",
        "run",
        str(tmp_path),
        "--setting",
        "fmnist_mlp_cpu",
        "--only",
        *chosen,
        "--seeds",
        "0",
        "1",
    ]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.count("finished run found") == 4
    md = (tmp_path / "table.md").read_text()
    assert md.splitlines()[0].startswith(
        "| method | personal acc (%) | final personal (%) | global acc (%) |"
    )
    lines = {line.split("|")[1].strip(): line for line in md.splitlines()[2:]}
    assert set(lines) == {"CoreSet-PFedBayes (50%)", "RandomSubset (50%)"}
    assert all("±" in line and "| 0, 1 |" in line for line in lines.values())
    run = tmp_path / (preset_name("fmnist_mlp_cpu", "coreset_50") + "_s1")
    config = json.loads((run / "config.json").read_text())
    assert config["run"]["seed"] == 1
    two_p = 2 * config["num_params"]
    assert (
        f"| {two_p} |" in lines["CoreSet-PFedBayes (50%)"]
    )  # the same on both seeds: printed once, no "± 0"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["personal_accuracy"] is not None and r["test_accuracy"] is not None for r in rows)
    assert all(r["uplink_bpp"] == 64.0 for r in rows)
    assert (tmp_path / "accuracy_vs_round.png").stat().st_size > 1000
    (run / "summary.json").write_text("{not json")
    capsys.readouterr()
    assert main(["coreset_pfedbayes", "table", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert f"skipped {run}" in captured.err
    assert (
        main(["coreset_pfedbayes", "run", str(tmp_path), "--setting", "fmnist_mlp_cpu", "--seeds", "1", "1"])
        == 2
    )
