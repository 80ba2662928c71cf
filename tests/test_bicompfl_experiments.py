"""The BICompFL suite (experiments.bicompfl, run by experiments.suite): presets, configs, table, plot."""

from __future__ import annotations

import json

import pytest
from suite_helpers import SMALL_FEDERATION, assert_shipped_presets, use_configs

from experiments.bicompfl import SETTINGS, SUITE, VARIANTS, suite_config, variant_label
from experiments.config import default_config, load_preset
from experiments.suite import main
from sidejax.algorithms import fixed_rates

preset_name = SUITE.preset_name

_SMALL = {
    **SMALL_FEDERATION,
    "data.model": "mlp_32_16",
    "data.train_subset": 400,
    "method.batch_size": 32,
    "method.local_epochs": 1,
}


def test_the_shipped_presets_are_the_suite_definitions(tmp_path):
    """Every (setting, variant) preset exists and is exactly what ``python -m experiments.suite bicompfl
    presets`` writes (so the presets and the table's definitions cannot drift apart)."""
    assert_shipped_presets(SUITE, SETTINGS, VARIANTS, tmp_path)
    # the paper's settings: 10 clients, every one each round, 200 rounds (CIFAR 400), b = 256, n_IS = 256
    cfg = load_preset("bicompfl_mnist_conv4_dir01_pr_fixed")
    assert (cfg.data.partition, cfg.data.alpha, cfg.data.num_clients, cfg.run.rounds) == (
        "dirichlet",
        0.1,
        10,
        200,
    )
    assert (cfg.method.downlink_num_candidates, cfg.coder.block_size, cfg.coder.log2_num_candidates) == (
        256,
        256,
        8,
    )
    assert (cfg.method.local_epochs, cfg.method.batch_size, cfg.method.client_lr) == (3, 128, 0.1)
    assert load_preset("bicompfl_cifar10_conv6_iid_gr_fixed").run.rounds == 400


def test_labels_name_the_papers_rows():
    want = {v: label for v, (label, _, _) in VARIANTS.items()}
    for variant, label in want.items():
        cfg = suite_config("fmnist_lenet5_cpu", variant)
        assert variant_label("run", json.loads(json.dumps(cfg.to_dict()))) == label, variant


def test_mirror_descent_is_a_mask_optimizer():
    """App. B's reading (plain SGD in logit space on the gradient w.r.t. theta) is a config choice for the
    mask methods: the local optimizer is sidejax.algorithms.mirror.mirror_descent."""
    import jax.numpy as jnp
    import optax

    from experiments.algorithms import build_algorithm
    from sidejax.algorithms.mirror import kl_prox_step
    from sidejax.fl import LocalTraining

    cfg = default_config("bicompfl_gr+klms", **{"method.client_optimizer": "mirror", "method.client_lr": 0.5})
    algo = build_algorithm(cfg, lambda *a: 0.0)
    assert algo.clients_per_round == cfg.data.num_clients
    opt = cfg.method.extras(LocalTraining)["optimizer"]  # what MethodConfig.call puts in LocalTraining
    s = jnp.array([-1.0, 0.3, 2.0])
    g_theta = jnp.array([0.2, -0.4, 0.1])
    theta = 1 / (1 + jnp.exp(-s))
    updates, _ = opt.update(g_theta * theta * (1 - theta), opt.init(s), s)  # grads w.r.t. the scores
    got = 1 / (1 + jnp.exp(-optax.apply_updates(s, updates)))
    assert jnp.allclose(got, kl_prox_step(theta, g_theta, 0.5), rtol=1e-5)


def test_bad_settings_say_what_to_do():
    with pytest.raises(ValueError, match="downlink_num_candidates must be a power of two"):
        default_config("bicompfl_pr+klms", **{"method.downlink_num_candidates": 100})
    with pytest.raises(ValueError, match="needs every client in every round"):
        from experiments.algorithms import build_algorithm

        build_algorithm(default_config("bicompfl_gr+klms", **{"data.participation": 0.5}), lambda *a: 0.0)
    with pytest.raises(ValueError, match="unknown setting"):
        suite_config("mnist", "gr_fixed")


@pytest.mark.slow  # the paper suite's table command end to end (runs, resume, table, plot): 20-30 s cold
def test_table_command_runs_the_methods_and_writes_the_papers_columns(tmp_path, monkeypatch, capsys):
    """End to end on digits (2 rounds): the command runs presets (here: the suite's configs shrunk to the
    test federation), skips finished runs on a second call, and writes table.md/csv with the paper's columns
    and the plot; the measured uplink equals the Fixed formula and GR's downlink is (n - 1) uplinks."""
    chosen = ("gr_fixed", "pr_fixed_splitdl")
    use_configs(
        monkeypatch,
        SUITE,
        {
            preset_name("fmnist_lenet5_cpu", v): suite_config("fmnist_lenet5_cpu", v).override(_SMALL)
            for v in chosen
        },
    )
    args = [
        "bicompfl",
        "run",
        str(tmp_path),
        "--setting",
        "fmnist_lenet5_cpu",
        "--only",
        "gr_fixed",
        "pr_fixed_splitdl",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert main(args) == 0
    assert "finished run found" in capsys.readouterr().out
    md = (tmp_path / "table.md").read_text()
    header = (
        "| method | acc (%) | last-5 acc (%) | bpp | bpp (BC) | uplink | downlink | rounds | seeds | runs |"
    )
    assert md.splitlines()[0] == header
    assert "| GR-Fixed |" in md and "| PR-Fixed-SplitDL |" in md and "| GR-Fixed |" in out
    assert (tmp_path / "accuracy_vs_total_bpp.png").stat().st_size > 1000
    run = tmp_path / preset_name("fmnist_lenet5_cpu", "gr_fixed")
    d = json.loads((run / "config.json").read_text())["num_params"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    want = fixed_rates(d, num_clients=4, block_size=128, log2_num_candidates=4)["gr"]
    assert rows[0]["uplink_bpp"] == pytest.approx(want["uplink"], rel=1e-9)
    assert rows[0]["downlink_bpp"] == 0.0 and rows[1]["downlink_bpp"] == pytest.approx(
        3 * want["uplink"], rel=1e-9
    )
    # the broadcast channel: every stream sent once to all 4 clients
    assert rows[1]["broadcast_bpp"] == pytest.approx(want["uplink"] + 4 * want["uplink"] / 4, rel=1e-9)
    assert main(["bicompfl", "table", str(tmp_path / "nothing")]) == 2
    # a damaged results folder is skipped with a warning naming it; the table is written from the others
    capsys.readouterr()
    (run / "summary.json").write_text("{not json")
    assert main(["bicompfl", "table", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert f"skipped {run}" in captured.err and "| GR-Fixed |" not in (tmp_path / "table.md").read_text()
