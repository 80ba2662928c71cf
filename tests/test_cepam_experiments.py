"""The CEPAM suite (experiments.cepam, run by experiments.suite): presets, the privacy columns, the table."""

from __future__ import annotations

import json

import pytest
from suite_helpers import SMALL_FEDERATION, assert_shipped_presets, use_configs

from experiments.cepam import SCHEMES, SETTINGS, SUITE, guarantee, suite_config
from experiments.config import default_config, load_preset
from experiments.suite import main

preset_name = SUITE.preset_name

_SMALL = {
    **SMALL_FEDERATION,
    "data.model": "mlp_32_16",
    "data.examples_per_client": 100,
    "method.local_steps": 5,
}


def test_the_shipped_presets_are_the_suite_definitions(tmp_path):
    assert_shipped_presets(SUITE, SETTINGS, SCHEMES, tmp_path)
    # the paper's setting (docs/papers/cepam.md#s3): 30 clients x 1,666, tau = 15, batch 1, momentum 0.9,
    # lr 0.01, 80 rounds
    cfg = load_preset("cepam_mnist_mlp_cepam_gauss_z3")
    assert (cfg.data.dataset, cfg.data.model, cfg.data.num_clients, cfg.data.examples_per_client) == (
        "mnist",
        "mlp_32_16",
        30,
        1666,
    )
    assert (cfg.method.local_steps, cfg.method.batch_size, cfg.method.momentum, cfg.method.client_lr) == (
        15,
        1,
        0.9,
        0.01,
    )
    assert (cfg.run.rounds, cfg.coder.lattice, cfg.coder.level, cfg.coder.gamma) == (80, "z3", (0.1,), 1.0)


def test_privacy_columns_reproduce_the_papers_numbers():
    """The paper's per-round guarantees (docs/papers/cepam.md#s4): Gaussian sigma = 0.1, eps_tilde = 5.9 ->
    (1.4502, 9.6887e-3), vacuous (delta >= p); Laplace b = 0.1, eps_tilde = 5000 -> eps = 4995.2857; none for
    FL."""
    g = guarantee(suite_config("mnist_cnn", "cepam_gauss_z1").to_dict())
    assert g.epsilon == pytest.approx(1.4501871413572687, rel=1e-9)
    assert g.delta == pytest.approx(0.009688739711522966, rel=1e-9)
    assert g.vacuous
    assert guarantee(suite_config("mnist_cnn", "fl_gauss_sdq").to_dict()).delta == pytest.approx(
        g.delta, rel=1e-12
    )
    lap = guarantee(suite_config("mnist_mlp", "cepam_laplace").to_dict())
    assert lap.epsilon == pytest.approx(4995.285669800896, rel=1e-9) and lap.delta == 0
    assert guarantee(suite_config("mnist_cnn", "fl").to_dict()) is None
    assert guarantee(suite_config("mnist_cnn", "fl_sdq").to_dict()) is None


def test_bad_settings_say_what_to_do():
    with pytest.raises(ValueError, match="lattice"):
        default_config("cepam+lrsuq", **{"coder.noise": "laplace", "coder.lattice": "z2"})
    with pytest.raises(ValueError, match="level"):
        default_config("cepam+noise", **{"coder.level": 0.0})
    with pytest.raises(ValueError, match="unknown scheme"):
        suite_config("mnist_cnn", "cepam")


@pytest.mark.slow  # the paper suite's table command end to end (runs, resume, table, plot): 20-30 s cold
def test_table_command_runs_the_schemes_and_writes_the_columns(tmp_path, monkeypatch, capsys):
    """End to end on digits (2 rounds, 4 clients): CEPAM on Z^2 and FL+Gaussian+SDQ run through the
    driver (real streams under jit), a second call skips them, the table has accuracy, (epsilon, delta) and
    the measured rate, and a damaged folder is skipped with a warning."""
    chosen = ("cepam_gauss_z2", "fl_gauss_sdq")
    small = {
        preset_name("fmnist_cnn_cpu", v): suite_config("fmnist_cnn_cpu", v).override(_SMALL) for v in chosen
    }
    use_configs(monkeypatch, SUITE, small)
    args = ["cepam", "run", str(tmp_path), "--setting", "fmnist_cnn_cpu", "--only", *chosen]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert main(args) == 0
    assert "finished run found" in capsys.readouterr().out
    md = (tmp_path / "table.md").read_text()
    assert md.splitlines()[0].startswith("| scheme | acc (%) | final acc (%) | epsilon | delta | vacuous |")
    assert "| CEPAM-Gaussian (n=2) |" in md and "| FL+Gaussian+SDQ |" in md and "| FL+Gaussian+SDQ |" in out
    assert (tmp_path / "accuracy_vs_round.png").stat().st_size > 1000
    run = tmp_path / preset_name("fmnist_cnn_cpu", "cepam_gauss_z2")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # a variable-length stream: far below 32 bits per parameter, above the 32-bit norm
    assert all(0 < r["uplink_bpp"] < 4 for r in rows)
    (run / "summary.json").write_text("{not json")
    capsys.readouterr()
    assert main(["cepam", "table", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert f"skipped {run}" in captured.err and "CEPAM-Gaussian" not in (tmp_path / "table.md").read_text()
    assert main(["cepam", "table", str(tmp_path / "nothing")]) == 2


def test_the_noise_level_has_one_home_read_by_the_algorithm_and_the_accountant(monkeypatch, capsys):
    """``[coder] level`` is a list: one value is every client's level (the coder's own, no per-client
    levels), several are given to the clients in turn; the algorithm's per-client levels and the accountant
    read that one field, from a preset, the command line (several values after the flag) or TOML."""
    import functools

    import sidejax.algorithms
    from experiments.algorithms import build_algorithm
    from experiments.run import build_parser, resolve

    one = suite_config("mnist_cnn", "cepam_gauss_z1")
    several = one.override({"coder.level": [0.05, 0.1, 0.2]})
    assert one.coder.client_levels(30) is None and one.coder.mechanism_noise().sigma == 0.1
    assert several.coder.client_levels(4) == [0.05, 0.1, 0.2, 0.05]
    seen = {}

    @functools.wraps(sidejax.algorithms.cepam)
    def record(loss, **kwargs):
        seen["levels"] = kwargs["noise_levels"]

    monkeypatch.setattr(sidejax.algorithms, "cepam", record)
    build_algorithm(several, "loss")
    assert seen["levels"] == [0.05, 0.1, 0.2] * 10
    g = guarantee(several.to_dict())
    assert g.scale == tuple([0.05, 0.1, 0.2] * 10)
    assert guarantee(one.to_dict()).scale == 0.1
    args = build_parser().parse_args(
        ["--preset", "cepam_mnist_cnn_cepam_gauss_z1", "--coder.level", "0.05", "0.1", "0.2"]
    )
    assert resolve(args)[0] == several
    from experiments.run import main

    assert main(["--method.name", "cepam", "--help"]) == 0  # a method without a shortcut: its coder's flags
    assert "--coder.level FLOAT [FLOAT ...]" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"level must be in \(0, inf\); got \(0.1, -1.0\)"):
        one.override({"coder.level": [0.1, -1.0]})


def test_a_config_json_with_the_old_comma_separated_levels_is_converted_or_refused():
    """A run folder's config.json from before (``[method] noise_levels = "0.05,0.1,0.2"`` beside a scalar
    ``[coder] level``) loads with the levels as ``[coder] level`` (so it resumes and is tabulated as before);
    levels for a coder without noise are refused with what to do."""
    from experiments.config import config_from_dict
    from experiments.driver_folder import run_config

    saved = suite_config("mnist_cnn", "cepam_gauss_z1").to_dict()
    saved["coder"]["level"] = 0.1
    saved["method"]["noise_levels"] = "0.05,0.1,0.2"
    assert run_config(saved).coder.level == (0.05, 0.1, 0.2)
    assert guarantee(saved).scale == tuple([0.05, 0.1, 0.2] * 10)
    saved["method"]["noise_levels"] = ""
    assert run_config(saved).coder.level == (0.1,)
    fl = suite_config("mnist_cnn", "fl").to_dict()
    fl["method"]["noise_levels"] = "0.1,0.2"
    with pytest.raises(ValueError, match=r"noise_levels .* is no longer a field.*\[coder\] level"):
        config_from_dict(fl)
