"""The experiment layer: CLI, results folder, resume, NaN stop, presets and bad-input errors."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.algorithms import ALGORITHMS, build_algorithm, client_map, default_config, klms_config
from experiments.checkpoint import (
    CheckpointError,
    checkpoint_exists,
    checkpoint_path,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
)
from experiments.coders import CODERS
from experiments.config import (
    PRESET_DIR,
    DataConfig,
    ExperimentConfig,
    RunConfig,
    config_from_dict,
    field_docs,
    list_presets,
    load_preset,
    preset_description,
    preset_toml,
)
from experiments.driver import (
    METRIC_COLUMNS,
    PERSONAL_TABLE_HEADER,
    PLOT_FILES,
    TABLE_HEADER,
    NonFiniteError,
    accuracy_figures,
    check_new_output,
    prepare,
    run_experiment,
)
from experiments.driver_records import format_row
from experiments.mask_eval import evaluate_final_mask
from experiments.methods import METHODS
from experiments.run import build_parser, resolve
from experiments.run import main as cli_main
from experiments.suite import main as suite_main
from sidejax.data import label_split_train_test, load_dataset, partition
from sidejax.fl import Evaluation
from sidejax.models import get_model

ROOT = Path(__file__).resolve().parents[1]

SMALL = {
    "data.dataset": "digits",
    "data.model": "mlp_32_16",
    "data.num_clients": 4,
    "data.train_subset": 400,
    "run.rounds": 4,
    "run.eval_every": 2,
    "method.batch_size": 32,
    "method.client_optimizer": "sgd",
    "method.client_lr": 0.1,
}


def small(algorithm: str = "fedavg", **changes) -> ExperimentConfig:
    """The small test federation (``changes``: dotted keys)."""
    return default_config(algorithm, **{**SMALL, **changes})


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    code = cli_main(
        [
            "fedavg",
            *(f"--{k}={v}" for k, v in SMALL.items()),
            "--output",
            str(out),
            "--no-progress",
            "--quiet",
        ]
    )
    assert code == 0
    return out


def test_cli_writes_results_folder(full_run):
    for name in (
        "config.json",
        "metrics.jsonl",
        "metrics.csv",
        "summary.json",
        "accuracy_vs_round.png",
        "accuracy_vs_bits.png",
        "accuracy_vs_uplink_bits.png",
    ):
        assert (full_run / name).is_file(), name
    assert checkpoint_exists(full_run / "checkpoint")
    rows = _rows(full_run)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["test_accuracy"] is None and rows[1]["test_accuracy"] is not None  # eval every 2 rounds
    cfg = json.loads((full_run / "config.json").read_text())
    d = cfg["num_params"]
    assert d == 64 * 32 + 32 + 32 * 16 + 16 + 16 * 10 + 10
    assert all(r["uplink_bpp"] == 32.0 and r["downlink_bpp"] == 32.0 for r in rows)
    assert rows[0]["uplink_bits"] == 4 * 32 * d
    assert rows[-1]["cumulative_bits"] == 4 * 2 * 4 * 32 * d
    assert [r["cumulative_uplink_bits"] for r in rows] == [k * 4 * 32 * d for k in (1, 2, 3, 4)]
    csv_lines = (full_run / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].startswith("round,test_accuracy") and len(csv_lines) == 5
    summary = json.loads((full_run / "summary.json").read_text())
    accs = [rows[1]["test_accuracy"], rows[3]["test_accuracy"]]
    assert summary["final_accuracy"] == accs[-1] and summary["best_accuracy"] == max(accs)
    assert summary["tail_accuracy"] == pytest.approx(np.mean(accs)) and summary["tail_evals"] == 2


def test_results_table_lists_runs_with_bits_and_compression(full_run, tmp_path):
    run_dir = tmp_path / "runs" / "fedavg_small"
    shutil.copytree(full_run, run_dir)
    assert suite_main(["klms", "table", str(tmp_path / "runs")]) == 0
    assert suite_main(["klms", "plot", str(tmp_path / "runs")]) == 0
    lines = (tmp_path / "runs" / "table.md").read_text().splitlines()
    assert lines[0].startswith("| preset | algorithm |") and len(lines) == 3

    def table_row():
        lines = (tmp_path / "runs" / "table.md").read_text().splitlines()
        cells = [c.strip() for c in lines[2].strip("|").split("|")]
        return len(lines), dict(zip([c.strip() for c in lines[0].strip("|").split("|")], cells, strict=True))

    summary = json.loads((full_run / "summary.json").read_text())
    config = json.loads((full_run / "config.json").read_text())
    _, row = table_row()
    assert row["preset"] == "fedavg_small" and row["uplink bpp"] == "32.0000" and row["x vs 32-bit"] == "1"
    assert row["last-5 mean acc (%)"] == f"{100 * summary['tail_accuracy']:.2f}"
    assert row["seeds"] == str(config["run"]["seed"]) and row["runs"] == "fedavg_small"
    assert (tmp_path / "runs" / "table.csv").is_file()
    for name in PLOT_FILES:  # the runs of one dataset and model, plotted together
        assert (tmp_path / "runs" / "plots" / "digits_mlp_32_16" / name).is_file()
    # another seed of the preset (the folder --seeds names <preset>_s<seed>) joins its row: mean ± std
    other = tmp_path / "runs" / "fedavg_small_s7"
    shutil.copytree(full_run, other)
    (other / "config.json").write_text(json.dumps({**config, "run": {**config["run"], "seed": 7}}))
    (other / "summary.json").write_text(
        json.dumps({**summary, "final_accuracy": summary["final_accuracy"] - 0.1})
    )
    assert suite_main(["klms", "table", str(tmp_path / "runs")]) == 0
    n, row = table_row()
    final = [100 * summary["final_accuracy"], 100 * summary["final_accuracy"] - 10]
    assert n == 3 and row["seeds"] == f"{config['run']['seed']}, 7" and row["uplink bpp"] == "32.0000"
    assert row["final acc (%)"] == f"{np.mean(final):.2f} ± {np.std(final, ddof=1):.2f}"
    assert suite_main(["klms", "table", str(tmp_path / "empty_dir_that_does_not_exist")]) == 2


def test_resume_continues_exactly(full_run, tmp_path):
    config = small()
    run_experiment(config.override({"run.rounds": 2}), tmp_path, progress=False, verbose=False)
    run_experiment(config, tmp_path, resume=True, progress=False, verbose=False)
    a, b = _rows(full_run), _rows(tmp_path)
    keys = ("round", "test_accuracy", "test_loss", "train_loss", "uplink_bits", "cumulative_bits")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]


def test_resume_refuses_a_different_config(full_run):
    with pytest.raises(ValueError, match="client_lr"):
        run_experiment(
            small(**{"method.client_lr": 0.2}),
            full_run,
            resume=True,
            progress=False,
            verbose=False,
        )


def test_nan_stops_with_round_and_client_after_last_good_checkpoint(tmp_path):
    config = small(**{"method.client_lr": 1e30, "run.eval_every": 1})
    with pytest.raises(NonFiniteError, match=r"round \d+, in client\(s\) \[") as err:
        run_experiment(config, tmp_path, progress=False, verbose=False)
    assert "checkpoint" in str(err.value)
    meta = read_checkpoint_meta(tmp_path / "checkpoint")
    bad_round = int(str(err.value).split("round ")[1].split(",")[0])
    assert meta["round_index"] == bad_round  # the last good state is the one before the bad round
    assert len(_rows(tmp_path)) == bad_round
    # the advice: change something and start again; a resume repeats the same rounds and meets the same NaN
    assert "start the run again with --overwrite" in str(err.value)
    with pytest.raises(NonFiniteError, match=rf"round {bad_round}, in client"):
        run_experiment(config, tmp_path, resume=True, progress=False, verbose=False)


def test_cli_client_strategy_auto_resolves_by_backend():
    from sidejax.fl import default_client_strategy

    assert default_config("fedavg").run.client_strategy == "auto"
    for algorithm in ("fedavg", "fedpm_klms"):
        assert client_map(default_config(algorithm)).strategy == default_client_strategy()
    forced = default_config("fedpm_klms", **{"run.client_strategy": "vmap"})
    assert client_map(forced).strategy == "vmap"
    # KLMS buckets each client's update rounds only when the clients run one after another
    assert not klms_config(forced).bucket_update_rounds
    assert klms_config(forced.override({"run.client_strategy": "map"})).bucket_update_rounds


def test_presets_load_and_are_typed():
    names = list_presets()
    assert {"demo_digits_fedavg", "demo_digits_fedavg_noniid", "fedavg_fmnist_lenet5_iid"} <= set(names)
    for name in names:
        cfg = load_preset(name)
        get_model(cfg.data.model)  # the model name is valid
        # the client strategy is the library's backend default unless a user forces one (issue 12: presets
        # pinned "vmap", 2.2x slower than "map" on CPU)
        # One exception, for memory: BPC-FL's EMNIST clients each hold 19.5 GB of trajectory checkpoints, so
        # its presets run the 100 clients one at a time on any backend.
        forced = "map" if name.startswith("bpcfl_emnist_bpcfl_") and cfg.method.name == "bpcfl" else "auto"
        assert cfg.run.client_strategy == forced, name
    with pytest.raises(ValueError, match="unknown preset"):
        load_preset("nope")
    method = {"method": {"name": "fedavg"}}
    with pytest.raises(ValueError, match=r"\[run\] key 'rounds' must be int, got 'ten'"):
        config_from_dict({"run": {"rounds": "ten"}, **method})
    with pytest.raises(ValueError, match=r"\[run\] unknown key 'round'; valid keys: seed, rounds"):
        config_from_dict({"run": {"round": 3}, **method})
    with pytest.raises(ValueError, match="participation must be in"):
        default_config("fedavg", **{"data.participation": 1.5})


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: load_dataset("mnits"), "fashion_mnist"),
        (lambda: get_model("lenet"), "lenet5"),
        (
            lambda: small("fedsgd"),
            "fedavg",
        ),
        (lambda: partition("shards", np.arange(100) % 10, 5, seed=0, c_max=11), "c_max"),
        (lambda: partition("iid", np.arange(10) % 2, 11, seed=0), "num_clients"),
        (lambda: partition("dirichlet", np.arange(100) % 10, 5, seed=0, alpha=0.0), "alpha"),
    ],
)
def test_bad_names_and_impossible_partitions_say_what_is_valid(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_cli_reports_bad_input_without_traceback(capsys, tmp_path):
    assert cli_main(["fedavg", "--data.dataset", "nope", "--output", str(tmp_path), "--no-progress"]) == 2
    assert "fashion_mnist" in capsys.readouterr().err  # the valid names are listed
    assert cli_main([]) == 2


@pytest.mark.slow  # two CLI runs of FedPM end to end
def test_mask_eval_reports_sampled_and_threshold_accuracy(tmp_path):
    config = small("fedpm", **{"run.rounds": 2, "method.client_optimizer": "adam"})
    run_experiment(config, tmp_path, progress=False, verbose=False)
    result = evaluate_final_mask(tmp_path, num_samples=3)
    assert result["round"] == 2 and result["num_samples"] == 3
    assert 0.0 <= result["sampled_mean"] <= 1.0 and 0.0 <= result["threshold"] <= 1.0
    assert result["sampled_se"] == pytest.approx(result["sampled_std"] / 3**0.5)
    assert json.loads((tmp_path / "mask_eval.json").read_text()) == result
    with pytest.raises(ValueError, match="no probability mask"):
        (tmp_path / "fedavg").mkdir()
        (tmp_path / "fedavg" / "config.json").write_text(json.dumps(small().to_dict()))
        evaluate_final_mask(tmp_path / "fedavg")


def _interrupted_at_write(monkeypatch, out, config, round_index, k):
    """Runs ``config`` into ``out``, raising KeyboardInterrupt at the ``k``-th ``os.replace`` of the
    checkpoint save of ``round_index`` (a power cut or Ctrl-C part-way through writing it). Returns False if
    that save makes fewer than ``k`` replacements (so the run completed)."""
    import experiments.driver_records as records

    real_save, real_replace = records.save_checkpoint, os.replace
    hit = {"calls": 0, "raised": False}

    def replace(src, dst):
        hit["calls"] += 1
        if hit["calls"] == k:
            hit["raised"] = True
            raise KeyboardInterrupt
        real_replace(src, dst)

    def save(directory, state, meta):
        if int(state.round_index) != round_index:
            return real_save(directory, state, meta)
        with monkeypatch.context() as m:
            m.setattr(os, "replace", replace)
            real_save(directory, state, meta)

    with monkeypatch.context() as m:
        m.setattr(records, "save_checkpoint", save)
        try:
            run_experiment(config, out, progress=False, verbose=False)
        except KeyboardInterrupt:
            pass
    return hit["raised"]


def test_interrupt_while_checkpointing_then_resume_loses_nothing(full_run, tmp_path, monkeypatch):
    """An interrupt at any write of the last checkpoint, then --resume, gives the uninterrupted run's metrics.

    Before the fix (two files: state.msgpack then state.json), an interrupt between them resumed from the new
    state with the old round index: rounds 3-4 vanished from metrics.jsonl and total bits fell by half."""
    config = small()
    keys = ("round", "test_accuracy", "train_loss", "uplink_bits", "cumulative_bits")
    want = [[r[k] for k in keys] for r in _rows(full_run)]
    want_total = json.loads((full_run / "summary.json").read_text())["total_bits"]
    for k in range(1, 10):
        out = tmp_path / f"cut{k}"
        if not _interrupted_at_write(monkeypatch, out, config, config.run.rounds, k):
            break
        summary = run_experiment(config, out, resume=True, progress=False, verbose=False)
        assert [[r[key] for key in keys] for r in _rows(out)] == want, f"interrupted at write {k}"
        assert summary.total_bits == want_total, f"interrupted at write {k}"
    assert k > 1  # at least one interrupted write was exercised


@pytest.fixture()
def small_checkpoint(tmp_path):
    state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "round_index": np.int32(7)}
    save_checkpoint(tmp_path, state, {"round_index": 7, "rows": [{"round": 1}]})
    return tmp_path, state


def test_checkpoint_round_trips(small_checkpoint):
    d, state = small_checkpoint
    restored, meta = load_checkpoint(d, {"w": np.zeros((3, 4), np.float32), "round_index": np.int32(0)})
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert int(restored["round_index"]) == 7 and meta == {"round_index": 7, "rows": [{"round": 1}]}
    assert read_checkpoint_meta(d) == meta
    assert sorted(p.name for p in d.iterdir()) == ["state.ckpt"]  # one file, no temporary left behind


@pytest.mark.parametrize("where", ["magic", "header", "meta", "state_first", "state_last"])
def test_bit_flipped_checkpoint_is_rejected_naming_the_file(small_checkpoint, where):
    """Before the fix a flipped bit in the weights loaded silently (no checksum)."""
    d, state = small_checkpoint
    path = checkpoint_path(d)
    data = bytearray(path.read_bytes())
    header_end = data.index(b"\n", data.index(b"\n") + 1)
    offset = {
        "magic": 3,
        "header": data.index(b"\n") + 12,
        "meta": header_end + 5,
        "state_first": len(data) - 60,
        "state_last": len(data) - 1,
    }[where]
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    target = {"w": np.zeros((3, 4), np.float32), "round_index": np.int32(0)}
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(d, target)


@pytest.mark.parametrize("keep", [0, 10, 40, -1])
def test_truncated_checkpoint_is_rejected_naming_the_file(small_checkpoint, keep):
    d, state = small_checkpoint
    path = checkpoint_path(d)
    data = path.read_bytes()
    path.write_bytes(data[: keep if keep >= 0 else len(data) + keep])
    target = {"w": np.zeros((3, 4), np.float32), "round_index": np.int32(0)}
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(d, target)


def test_checkpoint_of_another_structure_is_rejected(small_checkpoint):
    d, _ = small_checkpoint
    with pytest.raises(CheckpointError, match="structure|shapes"):
        load_checkpoint(d, {"w": np.zeros((4, 3), np.float32), "round_index": np.int32(0)})


def test_resume_from_a_damaged_checkpoint_fails_without_resuming(full_run, tmp_path):
    """A bit flip in the run's checkpoint: resume stops with an error naming the file; the run is kept."""
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    path = checkpoint_path(run / "checkpoint")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match="checksum") as err:
        run_experiment(small(), run, resume=True, progress=False, verbose=False)
    assert str(path) in str(err.value)
    assert (run / "metrics.jsonl").read_text() == before


FLAGS = [  # the full_run's configuration as CLI flags (rounds aside)
    *(f"--{k}={v}" for k, v in SMALL.items() if k != "run.rounds"),
    "--no-progress",
    "--quiet",
]


def _snapshot(run):
    return {
        p.name: p.read_bytes() for p in [run / "config.json", run / "metrics.jsonl", run / "summary.json"]
    }


def test_output_on_an_existing_run_is_refused_unless_resume_or_overwrite(full_run, tmp_path, capsys):
    """Before: a second run into the same --output silently replaced the first (rc 0)."""
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    before = _snapshot(run)
    assert cli_main(["fedavg", *FLAGS, "--run.rounds", "2", "--output", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(run) in err and "--resume" in err and "--overwrite" in err
    assert _snapshot(run) == before
    assert (
        cli_main(["fedavg", *FLAGS, "--run.rounds", "2", "--output", str(run), "--resume", "--overwrite"])
        == 2
    )
    assert _snapshot(run) == before
    assert cli_main(["fedavg", *FLAGS, "--run.rounds", "2", "--output", str(run), "--overwrite"]) == 0
    assert [r["round"] for r in _rows(run)] == [1, 2]
    assert json.loads((run / "config.json").read_text())["run"]["rounds"] == 2


def test_resume_with_more_rounds_keeps_the_saved_config(full_run, tmp_path):
    """Before: --resume --rounds 6 rewrote config.json (rounds 4 -> 6)."""
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    saved = (run / "config.json").read_bytes()
    assert cli_main(["--output", str(run), "--resume", "--run.rounds", "6", "--no-progress", "--quiet"]) == 0
    assert (run / "config.json").read_bytes() == saved
    assert [r["round"] for r in _rows(run)] == [1, 2, 3, 4, 5, 6]
    log = [json.loads(line) for line in (run / "resume_log.jsonl").read_text().splitlines()]
    assert [(e["from_round"], e["rounds"]) for e in log] == [(4, 6)]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_run"] == 6 and summary["rounds_target"] == 6
    # a plain --resume keeps the extended target (nothing to do); fewer rounds than done is refused
    assert cli_main(["--output", str(run), "--resume", "--no-progress", "--quiet"]) == 0
    assert len(_rows(run)) == 6
    assert cli_main(["--output", str(run), "--resume", "--run.rounds", "5", "--no-progress", "--quiet"]) == 2
    assert len(_rows(run)) == 6 and (run / "config.json").read_bytes() == saved


def test_resume_of_a_missing_run_fails_before_any_work(tmp_path, monkeypatch, capsys):
    """Before: the folder was created and the data loaded before the missing checkpoint was noticed."""
    import experiments.driver as driver

    def no_work(*args, **kwargs):
        raise AssertionError("prepared data and model before noticing there is nothing to resume")

    monkeypatch.setattr(driver, "prepare", no_work)
    missing = tmp_path / "missing"
    assert cli_main(["fedavg", *FLAGS, "--output", str(missing), "--resume"]) == 2
    assert "--resume" in capsys.readouterr().err and not missing.exists()
    with pytest.raises(FileNotFoundError, match="no run to resume"):
        run_experiment(small(), missing, resume=True, progress=False, verbose=False)
    assert not missing.exists()
    (tmp_path / "empty").mkdir()
    assert cli_main(["fedavg", *FLAGS, "--output", str(tmp_path / "empty"), "--resume"]) == 2
    assert list((tmp_path / "empty").iterdir()) == []


def test_ctrl_c_prints_the_resume_command_and_exits_130(full_run, tmp_path, monkeypatch, capsys):
    """Before: KeyboardInterrupt propagated as a traceback. The printed command continues the run exactly."""
    import shlex

    import experiments.driver_loop as driver_loop

    real_run_rounds, calls = driver_loop.run_rounds, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run_rounds(*args, **kwargs)

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(driver_loop, "run_rounds", interrupted)
        assert cli_main(["fedavg", *FLAGS, "--run.rounds", "4", "--output", str(run)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "round 2" in err
    command = shlex.split(next(line for line in err.splitlines() if "--resume" in line).strip())
    assert command[1:3] == ["-m", "experiments.run"]
    assert cli_main([*command[3:], "--no-progress", "--quiet"]) == 0
    keys = ("round", "test_accuracy", "train_loss", "uplink_bits", "cumulative_bits")
    assert [[r[k] for k in keys] for r in _rows(run)] == [[r[k] for k in keys] for r in _rows(full_run)]


def test_model_that_does_not_fit_the_input_is_refused_up_front(tmp_path, capsys):
    """Before: --model lenet5 on 8x8 digits died in parameter init with a ZeroDivisionError traceback."""
    with pytest.raises(ValueError, match=r"'lenet5'.*\(8, 8, 1\)") as err:
        get_model("lenet5", num_classes=10, input_shape=(8, 8, 1))
    fits = str(err.value).split("models that fit")[1]
    assert "mlp_100" in fits and "conv4" in fits and "cepam_cnn" not in fits and "klms_lenet" not in fits
    assert get_model("conv4", input_shape=(8, 8, 1)).input_shape == (8, 8, 1)  # a model that fits passes
    out = tmp_path / "run"
    assert cli_main(["fedavg", "--data.model", "lenet5", "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "lenet5" in err and "(8, 8, 1)" in err and "mlp_100" in err
    assert not out.exists()


# The command line's tuned defaults as the flat config's ALGORITHM_DEFAULTS held them (commit 6219271), in
# dotted keys: the method and coder defaults must keep them.
_KLMS_TUNED = {
    "coder.log2_num_candidates": 8,
    "coder.overhead_bits": 3.0,
    "coder.max_block_size": 1024,
    "coder.dbar_min": 3.33,
    "coder.dbar_max": 10.0,
}
_DENSE = {"method.client_optimizer": "momentum", "method.client_lr": 0.05}
_MASK = {"method.client_optimizer": "adam", "method.client_lr": 0.1}
_LANGEVIN = {
    "method.batch_size": 64,
    "method.step_size": 1e-5,
    "method.weight_decay": 5.0,
    "run.rounds": 200,
    "run.eval_every": 20,
}
TUNED_DEFAULTS = {
    "fedavg": _DENSE,
    "fedpm": _MASK,
    "fedpm_klms": {**_MASK, **_KLMS_TUNED},
    "qsgd": {**_DENSE, "method.server_lr": 1.0},
    "qsgd_klms": {**_DENSE, "method.server_lr": 1.0, **_KLMS_TUNED},
    "signsgd": {**_DENSE, "method.server_lr": 0.02},
    "signsgd_klms": {**_DENSE, "method.server_lr": 0.02, **_KLMS_TUNED},
    "qlsd": {**_LANGEVIN, "method.levels": 5},
    "sgld_klms": {**_LANGEVIN, "coder.max_block_size": 16, "coder.log2_num_candidates": 2},
}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_has_cli_defaults_and_a_digits_preset(algorithm, small_model):
    """The command line without a preset applies the algorithm's tuned defaults; flags override them."""
    config, out = resolve(build_parser().parse_args([algorithm]))
    assert config == default_config(algorithm) and config.algorithm == algorithm
    assert {k: config.flat()[k] for k in TUNED_DEFAULTS[algorithm]} == TUNED_DEFAULTS[algorithm]
    assert out.name == f"{algorithm}_digits_mlp_100_s0"
    build_algorithm(config, small_model[2])  # the defaults build the algorithm
    argv = [algorithm, "--method.batch_size", "7", "--run.rounds", "7"]
    config, _ = resolve(build_parser().parse_args(argv))
    assert config.method.batch_size == 7 and config.run.rounds == 7
    # the shortcut is a method and coder pair: the same config from --method.name and --coder.name
    method, coder = ALGORITHMS[algorithm]
    argv = ["--method.name", method, "--coder.name", coder, "--method.batch_size", "7", "--run.rounds", "7"]
    assert resolve(build_parser().parse_args(argv))[0] == config
    # each method has a small digits preset, which sets its fields itself
    preset = load_preset(f"demo_digits_{algorithm}")
    assert preset.algorithm == algorithm and preset.data.dataset == "digits"
    config, _ = resolve(build_parser().parse_args(["--preset", f"demo_digits_{algorithm}"]))
    assert config == preset


def test_signsgd_learns_with_the_cli_defaults(tmp_path):
    """Before (ExperimentConfig's defaults: plain SGD, server lr 1): 7.78% after 5 rounds on digits."""
    out = tmp_path / "run"
    assert cli_main(["signsgd", "--run.rounds", "5", "--output", str(out), "--no-progress", "--quiet"]) == 0
    assert json.loads((out / "summary.json").read_text())["final_accuracy"] > 0.6


def test_list_presets_prints_every_description(capsys):
    assert cli_main(["--list-presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(list_presets())
    for name, line in zip(list_presets(), lines, strict=True):
        assert line.split()[0] == name and line.endswith(preset_description(name))


def test_help_shows_the_chosen_methods_and_coders_flags_and_help_all_every_flag(capsys):
    """Before: --help was 518 lines of every method's and coder's flags."""
    assert cli_main(["--help"]) == 0
    bare = capsys.readouterr().out
    assert "--run.rounds" in bare and "--help-all" in bare
    assert "--coder.log2_num_candidates NUM" not in bare and "--coder.log2_num_candidates INT" not in bare
    assert cli_main(["fedpm_klms", "--help"]) == 0
    chosen = capsys.readouterr().out
    assert "--coder.log2_num_candidates INT" in chosen and "--method.client_lr FLOAT" in chosen
    assert "method 'fedpm' and coder 'klms'" in " ".join(chosen.split())
    assert "--coder.lattice" not in chosen  # CEPAM's coder
    assert cli_main(["--preset", "demo_digits_qsgd_klms", "--help"]) == 0
    assert "method 'qsgd' and coder 'klms'" in " ".join(capsys.readouterr().out.split())
    assert len(bare.splitlines()) < len(chosen.splitlines()) < 300


def test_help_explains_every_flag_and_lists_choices(capsys):
    assert cli_main(["--help-all"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # undo the line wrapping
    docs = field_docs()
    fields = {
        f"{table}.{name}"
        for table, classes in (("run", [RunConfig]), ("data", [DataConfig]), ("method", METHODS.values()))
        for cls in classes
        for name in cls.field_names()
    } | {f"coder.{name}" for cls in CODERS.values() for name in cls.field_names()}
    assert set(docs) == fields
    for field, doc in docs.items():
        assert f"--{field} " in text and " ".join(doc.rstrip(".").split()) in text, field
    for name in ("fashion_mnist", "lenet5", "dirichlet", "adam", "vmap", "rho", "ste", *ALGORITHMS, *METHODS):
        assert name in text, name
    assert "--method.name NAME" in text and "--coder.name NAME" in text and "float32, signs, elias" in text
    assert "--resume" in text and "--overwrite" in text
    # method and coder flags say who has them and the defaults, per method
    assert (
        "(methods fedavg, qsgd, signsgd, memsgd, doublesqueeze, neolithic, cser, liec, m3, fedpa; default "
        "unset for fedavg; 1.0 for qsgd; 0.02 for signsgd, m3; 0.1 for memsgd, doublesqueeze, neolithic, "
        "cser, liec; 0.5 for fedpa)" in text
    )
    assert (
        "(coders klms, klms_avg; default 2 for klms; 8 for klms_avg; without a preset, as tuned for the "
        "method: 8 for fedpm, qsgd, signsgd" in text
    )
    assert cli_main(["fedavg", "--data.model", "nope"]) == 2  # not a choice: argparse's error, no traceback


def test_plots_have_titles_integer_rounds_an_uplink_plot_and_legends_off_the_data(full_run):
    """Before: no titles, round ticks at 1.5, 2.5, ..., legends inside the axes, no uplink-bits plot."""
    import matplotlib.pyplot as plt

    rows = _rows(full_run)
    compressed = [  # a second run with 845x fewer uplink bits
        {
            **r,
            "uplink_bits": r["uplink_bits"] / 845,
            "cumulative_uplink_bits": r["cumulative_uplink_bits"] / 845,
        }
        for r in rows
    ]
    figures = accuracy_figures({"fedavg": rows, "compressed": compressed}, title="digits / mlp_32_16")
    assert (
        set(figures)
        == set(PLOT_FILES)
        == {
            "accuracy_vs_round.png",
            "accuracy_vs_bits.png",
            "accuracy_vs_uplink_bits.png",
        }
    )
    for name, fig in figures.items():
        ax = fig.axes[0]
        assert "Test accuracy" in ax.get_title() and "digits / mlp_32_16" in ax.get_title(), name
        fig.canvas.draw()
        legend = ax.get_legend().get_window_extent()
        assert legend.y1 <= ax.get_window_extent().y0, f"{name}: the legend overlaps the axes"
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["fedavg", "compressed"]
    ticks = [t for t in figures["accuracy_vs_round.png"].axes[0].get_xticks() if 1 <= t <= 4]
    assert ticks and all(float(t).is_integer() for t in ticks)
    uplink = figures["accuracy_vs_uplink_bits.png"].axes[0]
    assert uplink.get_xscale() == "log"
    evaluated = [r["cumulative_uplink_bits"] for r in rows if r["test_accuracy"] is not None]
    np.testing.assert_array_equal(uplink.lines[0].get_xdata(), evaluated)
    np.testing.assert_allclose(uplink.lines[1].get_xdata(), np.array(evaluated) / 845, rtol=1e-15)
    for fig in figures.values():
        plt.close(fig)


def test_table_run_ctrl_c_says_how_to_resume(tmp_path, monkeypatch, capsys):
    import experiments.driver as driver

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "run_experiment", interrupted)
    assert suite_main(["klms", "run", str(tmp_path), "--preset", "demo_digits_fedavg", "--force"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"python -m experiments.suite klms resume {tmp_path}" in err
    saved = json.loads((tmp_path / "suite.json").read_text())
    assert saved == {"suite": "klms", "argv": ["run", str(tmp_path), "--preset", "demo_digits_fedavg"]}


def test_a_run_interrupted_before_its_first_checkpoint_says_to_overwrite(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(small().to_dict()))  # no checkpoint yet
    assert cli_main(["fedavg", *FLAGS, "--output", str(run), "--resume"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(["fedavg", *FLAGS, "--run.rounds", "1", "--output", str(run)]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "--resume" not in err


@pytest.mark.slow  # two KLMS runs through the driver
def test_invalid_klms_stream_excludes_the_client_and_says_so(tmp_path, monkeypatch, capsys):
    """Fault injection on the wire: client 0's message loses its last word in round 0 (garbage there, and a
    length that no longer covers it). The real decoder flags the stream invalid; the server leaves client 0
    out of its aggregates (``RoundInfo.included``) and the driver says so on stderr, naming the round, the
    client and the decoder's reason, and goes on. With every participant's stream corrupted there is nothing
    to aggregate: the run stops like NaN and keeps nothing from that round."""
    import jax

    import experiments.coders as coders
    from experiments.driver import InvalidStreamError
    from sidejax.keys import client_keys, round_key, run_keys

    config = small("fedpm_klms", **{"run.rounds": 2, "run.eval_every": 1})
    key0 = round_key(run_keys(config.run.seed)[1], 0)
    targets = jnp.stack([jax.random.key_data(client_keys(key0, c).shared) for c in range(4)])
    real_klms_coder = coders.klms_coder
    hit_clients = [0]

    def corrupting_klms_coder(klms_config):
        coder = real_klms_coder(klms_config)

        def decode(shared_key, p, state, message):
            data = jax.random.key_data(shared_key)
            hit = jnp.any(jnp.all(data == targets[jnp.asarray(hit_clients)], axis=-1))  # round 0 only
            last = jnp.ceil(message.num_bits / 32).astype(jnp.int32) - 1
            garbage = hit & (jnp.arange(message.payload.shape[-1]) == last)
            payload = jnp.where(garbage, jnp.uint32(0xFFFFFFFF), message.payload)
            corrupt = message._replace(payload=payload, num_bits=message.num_bits - 32 * hit)
            return coder.decode(shared_key, p, state, corrupt)

        return coder._replace(decode=decode)

    monkeypatch.setattr(coders, "klms_coder", corrupting_klms_coder)
    summary = run_experiment(config, tmp_path / "one", progress=False, verbose=False)
    assert summary.rounds_run == 2
    err = capsys.readouterr().err
    assert re.search(r"warning: round 1: excluded from the server's aggregates: client 0: [^;\n]*length", err)
    assert "round 2:" not in err  # only round 0 (the first) was corrupted

    hit_clients[:] = [0, 1, 2, 3]
    with pytest.raises(InvalidStreamError, match=r"round 0 \(client 0: [^;]*length[^;]*;") as err:
        run_experiment(config, tmp_path / "all", progress=False, verbose=False)
    assert "checkpoint" in str(err.value)
    metrics = tmp_path / "all" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # nothing from the bad round was kept


def test_flagged_clients_are_reported_and_a_round_without_any_stops(tmp_path):
    """Inside jit a client given an invalid ``q``/``p`` (probability 1.5, NaN) cannot raise; its coder flags
    ``ClientInfo.valid``, and the server's decoder flags a malformed stream in ``RoundInfo.uplink_errors``.
    The server leaves such a client out (``RoundInfo.included``); the driver returns one warning per round
    naming the clients and the reasons, and stops only at a round in which no participant was included
    (round-stacked diagnostics as ``run_rounds`` returns them, built by hand)."""
    from types import SimpleNamespace

    from experiments.driver import InvalidStreamError
    from experiments.driver_loop import _check_streams
    from sidejax.coding import ERR_LENGTH
    from sidejax.fl import ClientInfo

    z = np.zeros((2, 3), np.float32)
    valid = np.array([[True, True, True], [True, False, True]])
    errors = np.zeros((2, 3), np.int32)
    infos = SimpleNamespace(
        round_index=np.array([4, 5]),
        client_ids=np.array([[0, 2, 7], [1, 3, 8]]),
        clients=ClientInfo(loss=z, finite=np.ones_like(valid), valid=valid),
        uplink_errors=errors,
        included=valid,
        server=(),
    )
    warnings_ = _check_streams(infos, tmp_path / "checkpoint", 5)
    assert warnings_ == [
        "warning: round 6: excluded from the server's aggregates: client 3: invalid q or p, "
        "or a non-finite KL"
    ]
    all_valid = ClientInfo(z, np.ones_like(valid), valid=np.ones_like(valid))
    clean = SimpleNamespace(**{**vars(infos), "clients": all_valid, "included": np.ones_like(valid)})
    assert _check_streams(clean, tmp_path, 5) == []
    errors = errors.copy()
    errors[0, 2] = ERR_LENGTH
    included = np.array([[True, True, False], [True, True, True]])
    corrupt = SimpleNamespace(**{**vars(clean), "uplink_errors": errors, "included": included})
    (only,) = _check_streams(corrupt, tmp_path, 4)
    assert re.match(r"warning: round 5: [^:]*: client 7: [^;]*length", only)
    nobody = SimpleNamespace(**{**vars(corrupt), "included": np.array([[False] * 3, [True] * 3])})
    with pytest.raises(InvalidStreamError, match=r"round 4 \(client 0: excluded by the server; client 2: "):
        _check_streams(nobody, tmp_path / "checkpoint", 4)


def _effective_run(config: ExperimentConfig, monkeypatch) -> dict:
    """What a run of ``config`` is: the sidejax builder the driver calls and every argument it gets (defaults
    applied; optimizers as (name, lr), coders as their factory and arguments, the KLMSConfig in full), and
    the data and run values, in the format of ``tests/data/preset_equivalence.json``."""
    import dataclasses
    import functools
    import inspect

    import experiments.algorithms as algorithms
    import experiments.coders as coders
    import experiments.methods as methods
    import sidejax.algorithms

    calls = []

    def recorder(name):
        real = getattr(sidejax.algorithms, name)
        signature = inspect.signature(real)

        @functools.wraps(real)  # the builder's signature, which experiments.methods reads
        def record(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            calls.append((name, {k: v for k, v in bound.arguments.items() if k != "loss_fn"}))

        return record

    with monkeypatch.context() as m:
        for name in ("fedavg", "fedpm", "qsgd", "signsgd", "qlsd", "sgld"):
            m.setattr(sidejax.algorithms, name, recorder(name))
        m.setattr(methods, "make_optimizer", lambda name, lr: {"optimizer": name, "lr": lr})
        m.setattr(coders, "klms_coder", lambda cfg: {"coder": "klms", "config": dataclasses.asdict(cfg)})
        m.setattr(coders, "elias_coder", lambda levels: {"coder": "elias", "max_level": levels})
        m.setattr(coders, "mask_coder", lambda: {"coder": "mask"})
        m.setattr(coders, "float32_coder", lambda: {"coder": "float32"})
        m.setattr(
            coders, "fixed_width_coder", lambda alphabet: {"coder": "fixed_width", "alphabet": alphabet}
        )
        m.setattr(algorithms, "default_client_strategy", lambda: "map")  # the fixture's (CPU) resolution
        build_algorithm(config, "the loss")
    ((builder, kwargs),) = calls
    # the fixture was recorded when the builders took these as separate keywords; the builders now take
    # them as one LocalTraining / LangevinSettings argument, with the same values
    local = kwargs.pop("local", None)
    if local is not None:
        kwargs.update(
            client_optimizer=local.optimizer,
            batch_size=local.batch_size,
            local_epochs=local.num_epochs,
            local_steps=local.num_steps,
        )
    settings = kwargs.pop("settings", None)
    if settings is not None:
        kwargs.update(settings._asdict())
    data = config.data
    return json.loads(
        json.dumps(
            {
                "algorithm": config.algorithm,
                "builder": builder,
                "builder_kwargs": kwargs,
                "data": {
                    "dataset": data.dataset,
                    "model": data.model,
                    "num_clients": data.num_clients,
                    "participation": data.participation,
                    "clients_per_round": config.clients_per_round,
                    "partition": data.partition,
                    "partition_kwargs": data.partition_kwargs(),
                    "train_subset": data.train_subset,
                },
                # fields added since, at the defaults that keep the run as it was: run.init_from, run.devices,
                # the process settings and run.clients_per_step
                "run": {k: v for k, v in config.run.to_dict().items() if (k, v) not in ADDED_RUN_DEFAULTS},
            }
        )
    )


ADDED_RUN_DEFAULTS = {
    ("init_from", None),
    ("devices", 1),
    ("processes", 1),
    ("coordinator", None),
    ("process_id", 0),
    ("clients_per_step", None),
}


def test_every_preset_builds_the_run_it_built_before_the_sectioned_config(monkeypatch):
    """``tests/data/preset_equivalence.json`` was recorded once with the flat-config experiments code of
    commit 6219271 (its ``build_algorithm`` with the same recording builders, its ``_partition_kwargs``,
    ``train_subset or None`` and ``stop_at_accuracy or None``), before the presets were converted: every
    preset still calls the same sidejax builder with the same arguments (coder and KLMSConfig included) on
    the same data, partition and run settings."""
    from pathlib import Path

    want = json.loads((Path(__file__).parent / "data" / "preset_equivalence.json").read_text())
    # every preset of that time still exists (presets added since, e.g. bicompfl_*, are held to their
    # generator by tests/test_bicompfl_experiments.py)
    assert set(want) <= set(list_presets())
    for name in sorted(want):
        assert _effective_run(load_preset(name), monkeypatch) == want[name], name
    # the check sees a change: one KLMS field
    changed = load_preset("demo_digits_fedpm_klms").override({"coder.overhead_bits": 1.0})
    assert _effective_run(changed, monkeypatch) != want["demo_digits_fedpm_klms"]


def test_presets_are_written_out_in_full_and_round_trip():
    """Each shipped preset is exactly the canonical TOML of its config (every field it sets, in order), so
    no preset leans on a default that might change; and that TOML loads back to the same config."""
    import tomllib

    for name in list_presets():
        config = load_preset(name)
        text = preset_toml(config, preset_description(name))
        assert (PRESET_DIR / f"{name}.toml").read_text() == text, name
        values = tomllib.loads(text)
        values.pop("description")
        assert config_from_dict(values) == config, name


def _write_preset(directory, name, text):
    (directory / f"{name}.toml").write_text('description = "test"\n' + text)


@pytest.mark.parametrize(
    "text, match",
    [
        ("[run]\nrounds = 3\n", r"\[method\] needs a name; valid names: fedavg, fedpm"),
        ("[method]\nname = 'fedsgd'\n", r"\[method\] unknown name 'fedsgd'; valid names: fedavg"),
        ("[runs]\n[method]\nname = 'fedavg'\n", r"unknown key\(s\) 'runs'; valid tables: run, data"),
        (
            "[method]\nname = 'fedpm'\nserver_lr = 0.1\n",
            r"\[method\] key 'server_lr' is not a field of method 'fedpm' \(methods with it: fedavg, qsgd, "
            r"signsgd, memsgd, doublesqueeze, neolithic, cser, liec, m3, fedpa\); valid keys: name, "
            r"batch_size, local_epochs, local_steps, client_optimizer, client_lr, estimator$",
        ),
        ("[method]\nname = 'fedpm'\nclient_lrr = 0.1\n", r"\[method\] unknown key 'client_lrr' for method"),
        ("[method]\nname = 'qsgd'\nlevels = 2.0\n", r"\[method\] key 'levels' must be int, got 2.0"),
        ("[method]\nname = 'qsgd'\n[coder]\nname = 'mask'\n", r"method 'qsgd' does not take coder 'mask'"),
        ("[method]\nname = 'qsgd'\nlevels = 2\n[coder]\nname = 'klms'\n", r"needs levels = 1"),
        (
            "[method]\nname = 'fedpm'\n[coder]\nname = 'mask'\nblock_size = 4\n",
            r"\[coder\] key 'block_size' is not a field of coder 'mask' \(coders with it: klms, klms_avg\); "
            r"valid keys: name, crc32$",
        ),
        (
            "[data]\nalpha = 0.5\n[method]\nname = 'fedavg'\n",
            r"alpha is only used with partition 'dirichlet'",
        ),
        (
            "[data]\npartition = 'fixed'\n[method]\nname = 'fedavg'\n",
            r"partition 'fixed' needs examples_per_client",
        ),
        (
            "[method]\nname = 'fedavg'\nserver_optimizer = 'adam'\n",
            r"server_optimizer 'adam' needs server_lr",
        ),
        ("[method]\nname = 'fedavg'\nserver_lr = 0.5\n", r"server_lr is only used with server_optimizer"),
        (
            "[method]\nname = 'sgld'\n[coder]\nname = 'klms'\ntrigger = 'rho'\ndbar_min = 1.0\n",
            r"dbar_min is only used with trigger 'thresholds'",
        ),
        ("[method]\nname = 'fedavg'\nlocal_epochs = 2\nlocal_steps = 5\n", r"give one of local_epochs and"),
    ],
)
def test_a_bad_preset_names_the_file_table_and_key(tmp_path, monkeypatch, text, match):
    import experiments.config as config_module

    monkeypatch.setattr(config_module, "PRESET_DIR", tmp_path)
    _write_preset(tmp_path, "bad", text)
    with pytest.raises(ValueError, match=match) as err:
        load_preset("bad")
    assert str(err.value).startswith(str(tmp_path / "bad.toml"))


def test_a_preset_leaves_out_what_it_does_not_set(tmp_path, monkeypatch):
    """Left-out fields take their class's defaults (the method's tuned ones; sidejax's for the coder, not the
    method's tuning of it); a missing [coder] is the method's default coder; local_steps replaces epochs."""
    import experiments.config as config_module

    monkeypatch.setattr(config_module, "PRESET_DIR", tmp_path)
    _write_preset(tmp_path, "p", "[method]\nname = 'fedpm'\nlocal_steps = 5\n[coder]\nname = 'klms'\n")
    config = load_preset("p")
    assert (config.method.local_epochs, config.method.local_steps) == (None, 5)
    assert (config.method.client_optimizer, config.method.client_lr) == ("adam", 0.1)
    assert config.coder == CODERS["klms"]() and config.coder.dbar_min is None
    assert config.run == RunConfig() and config.data == DataConfig()
    _write_preset(tmp_path, "q", "[method]\nname = 'signsgd'\n")
    assert load_preset("q").algorithm == "signsgd" and load_preset("q").coder.name == "signs"


def test_overrides_follow_the_sections(small_model):
    config = default_config("fedpm_klms")
    # a new method keeps a coder it takes, with its fields; else the method's default coder
    assert config.override({"method.name": "qsgd"}).algorithm == "qsgd_klms"
    assert config.override({"method.name": "qsgd"}).coder == config.coder
    assert config.override({"method.name": "fedavg"}).algorithm == "fedavg"
    # a new coder starts from its defaults as tuned for the method
    assert default_config("fedpm").override({"coder.name": "klms"}).coder == config.coder
    # giving local_steps unsets local_epochs (and back); a new partition drops the old one's field
    steps = config.override({"method.local_steps": 3})
    assert (steps.method.local_epochs, steps.method.local_steps) == (None, 3)
    assert steps.override({"method.local_epochs": 2}).method.local_steps is None
    shards = config.override({"data.partition": "shards", "data.c_max": 3})
    assert shards.data.partition_kwargs() == {"c_max": 3}
    assert shards.override({"data.partition": "iid"}).data.c_max is None
    adam = default_config("fedavg", **{"method.server_optimizer": "adam", "method.server_lr": 0.01})
    assert adam.override({"method.server_optimizer": "none"}).method.server_lr is None
    with pytest.raises(ValueError, match=r"'method\.levels' .*|has no key|is not a field of method 'fedpm'"):
        config.override({"method.levels": 2})
    with pytest.raises(ValueError, match="not a dotted key"):
        config.override({"rounds": 2})
    # a pair without a shortcut is named method+coder, and builds
    pair = default_config("sgld+float32")
    assert pair.algorithm == "sgld+float32" and pair.coder.name == "float32"
    assert default_config(**{"method.name": "sgld", "coder.name": "float32"}) == pair
    build_algorithm(pair, small_model[2])
    with pytest.raises(ValueError, match=r"unknown algorithm 'sgld\+elias'.*sgld\+float32"):
        default_config("sgld+elias")


def test_cli_flag_of_another_method_is_an_argparse_error(capsys):
    """A flag for a field the chosen method or coder does not have is refused (not silently ignored)."""
    assert cli_main(["fedpm", "--method.server_lr", "0.1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and "--method.server_lr: method 'fedpm' has no field 'server_lr'" in err
    methods = "fedavg, qsgd, signsgd, memsgd, doublesqueeze, neolithic, cser, liec, m3, fedpa"
    assert f"(methods with it: {methods})" in err
    assert cli_main(["--preset", "demo_digits_fedpm", "--coder.log2_num_candidates", "4"]) == 2
    err = capsys.readouterr().err
    assert "coder 'mask' has no field 'log2_num_candidates' (coders with it: klms, klms_avg)" in err
    # the same flag is fine once the coder is one that has it; "none" unsets an optional field
    argv = ["--preset", "demo_digits_fedpm", "--coder.name", "klms", "--coder.log2_num_candidates", "4"]
    assert resolve(build_parser().parse_args(argv))[0].algorithm == "fedpm_klms"
    argv = ["fedpm_klms", "--coder.dbar_min", "none", "--run.stop_at_accuracy", "0.5"]
    config = resolve(build_parser().parse_args(argv))[0]
    assert config.coder.dbar_min is None and config.run.stop_at_accuracy == 0.5
    assert cli_main(["fedpm", "--method.name", "qsgd"]) == 2  # the positional is method fedpm
    assert cli_main(["qsgd", "--method.levels", "2.5"]) == 2  # argparse's type error


def test_resume_of_a_run_written_by_an_older_version_says_so(full_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    saved = json.loads((run / "config.json").read_text())
    assert (
        saved["algorithm"] == "fedavg" and saved["method"]["name"] == "fedavg" and saved["run"]["rounds"] == 4
    )
    flat = {"algorithm": "fedavg", "dataset": "digits", "model": "mlp_32_16", "rounds": 4, "client_lr": 0.1}
    (run / "config.json").write_text(json.dumps(flat))
    assert cli_main(["--output", str(run), "--resume", "--run.rounds", "6", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "older sidejax version" in err and str(run / "config.json") in err and "Traceback" not in err
    with pytest.raises(ValueError, match="older sidejax version"):
        run_experiment(small(), run, resume=True, progress=False, verbose=False)


# --------------------------------------------------------------------------------------------------
# data.partition = "pfedme": per-client test sets, and the personal models of a personalized method
# --------------------------------------------------------------------------------------------------

PFEDME = {  # 10 clients x 5 labels x 20 digits: 25 train and 75 test examples each, 750 pooled test examples
    "data.dataset": "digits",
    "data.model": "mlp_32_16",
    "data.partition": "pfedme",
    "data.labels_per_client": 5,
    "data.examples_per_label": 20,
    "data.train_fraction": 0.25,
    "run.rounds": 3,
    "run.eval_every": 1,
    "method.batch_size": 25,
    "method.client_optimizer": "sgd",
    "method.client_lr": 0.1,
}


def _as_personal(m: pytest.MonkeyPatch) -> None:
    """Within ``m``, FedAvg is a personalized method: its algorithm's evaluation broadcasts the global model
    to every client as its personal model (the driver reads that from the algorithm, nothing else)."""
    import experiments.driver as driver

    m.setattr(driver, "build_algorithm", _with_personal(build_algorithm))


def _with_personal(build):
    """``build`` (build_algorithm), with the global model broadcast to every client as its personal model."""

    def build_personal(config, loss_fn):
        algorithm = build(config, loss_fn)
        n = config.data.num_clients

        def personal(state):
            return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), algorithm.eval_params(state))

        return algorithm._replace(evaluation=algorithm.evaluation._replace(personal=personal))

    return build_personal


@pytest.fixture(scope="module")
def personal_run(tmp_path_factory):
    """FedAvg with its global model as every client's personal model, on the pfedme split: 2 rounds, then
    resumed to 3. Returns the folder, the rows before the resume and the summary."""
    out = tmp_path_factory.mktemp("personal")
    config = default_config("fedavg", **PFEDME)
    with pytest.MonkeyPatch.context() as m:
        _as_personal(m)
        run_experiment(config.override({"run.rounds": 2}), out, progress=False, verbose=False)
        before = _rows(out)
        summary = run_experiment(config, out, resume=True, progress=False, verbose=False)
    return out, before, summary


def test_pfedme_prepare_pools_train_and_test_into_per_client_sets():
    config = default_config("fedavg", **PFEDME)
    prep = prepare(config)
    splits = [load_dataset("digits", s) for s in ("train", "test")]
    x = np.concatenate([d.x for d in splits])
    y = np.concatenate([d.y for d in splits])
    train, test = label_split_train_test(
        y, 10, labels_per_client=5, examples_per_label=20, train_fraction=0.25, seed=config.run.seed
    )
    assert any(int(t.max()) >= len(splits[0].y) for t in test)  # the pooled set: examples of both splits
    fed, ct = prep.fed, prep.client_test
    assert fed.num_examples.tolist() == [25] * 10
    np.testing.assert_array_equal(np.asarray(fed.x), x)  # the pooled examples, indexed by the train parts
    np.testing.assert_array_equal(np.asarray(fed.client_indices), np.stack(train))
    assert ct.x.shape == (10, 75, 8, 8, 1) and ct.y.shape == ct.mask.shape == (10, 75)
    assert bool(ct.mask.all())  # every client has 75 test examples: no padding
    for u in range(10):
        np.testing.assert_array_equal(np.asarray(ct.x[u]), x[test[u]])
        np.testing.assert_array_equal(np.asarray(ct.y[u]), y[test[u]])
        assert set(np.asarray(ct.y[u]).tolist()) == {(5 * u + j) % 10 for j in range(5)}
    # the global test set is the union of the clients' test sets
    x_test, y_test = prep.test
    np.testing.assert_array_equal(np.asarray(x_test), x[np.concatenate(test)])
    np.testing.assert_array_equal(np.asarray(y_test), y[np.concatenate(test)])


def test_pfedme_config_fields_and_errors():
    data = default_config("fedavg", **PFEDME).data
    assert data.partition_kwargs() == {
        "labels_per_client": 5,
        "examples_per_label": 20,
        "train_fraction": 0.25,
    }
    assert data.per_client_test and not DataConfig().per_client_test
    with pytest.raises(ValueError, match="partition 'pfedme' needs labels_per_client"):
        DataConfig(partition="pfedme", examples_per_label=20, train_fraction=0.25)
    with pytest.raises(ValueError, match="train_fraction is only used with partition 'pfedme'"):
        DataConfig(partition="iid", train_fraction=0.25)
    with pytest.raises(ValueError, match=r"train_fraction must be in \(0, 1\)"):
        DataConfig(partition="pfedme", labels_per_client=5, examples_per_label=20, train_fraction=1.0)
    with pytest.raises(ValueError, match="examples_per_label must be >= 1"):
        DataConfig(partition="pfedme", labels_per_client=5, examples_per_label=0, train_fraction=0.5)
    with pytest.raises(ValueError, match="train_subset is not used with partition pfedme"):
        default_config("fedavg", **PFEDME, **{"data.train_subset": 400})
    # a new partition drops the pfedme fields
    assert default_config("fedavg", **PFEDME).override({"data.partition": "iid"}).data == DataConfig(
        dataset="digits", model="mlp_32_16"
    )
    # an impossible split is the partition's error, naming the label
    with pytest.raises(ValueError, match=r"label \d has \d+ examples .* lower examples_per_label"):
        prepare(default_config("fedavg", **{**PFEDME, "data.examples_per_label": 100}))


def test_personal_models_are_evaluated_on_each_clients_test_set(personal_run):
    out, _, summary = personal_run
    rows = _rows(out)
    assert [r["round"] for r in rows] == [1, 2, 3]
    for r in rows:
        # every client's personal model is the global model, so the pooled personal accuracy over the
        # clients' test sets is the global model's accuracy on their union
        assert r["personal_accuracy"] == pytest.approx(r["test_accuracy"], rel=1e-6, abs=1e-7)
        assert r["personal_loss"] == pytest.approx(r["test_loss"], rel=1e-5)
        assert r["test_accuracy"] * 750 == pytest.approx(round(r["test_accuracy"] * 750), abs=1e-3)
    personal = [r["personal_accuracy"] for r in rows]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["final_personal_accuracy"] == summary.final_personal_accuracy == personal[-1]
    assert saved["best_personal_accuracy"] == summary.best_personal_accuracy == max(personal)
    assert saved["tail_personal_accuracy"] == pytest.approx(np.mean(personal))
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[: len(METRIC_COLUMNS) + 2] == [*METRIC_COLUMNS, "personal_accuracy", "personal_loss"]


def test_resume_keeps_the_personal_columns(personal_run):
    out, before, _ = personal_run
    rows = _rows(out)
    assert rows[:2] == before and all("personal_accuracy" in r and "personal_loss" in r for r in before)
    meta = read_checkpoint_meta(out / "checkpoint")
    assert meta["rows"] == rows and rows[2]["personal_accuracy"] is not None


def test_a_plain_method_on_the_pfedme_split_tests_on_the_pooled_test_set(personal_run, tmp_path):
    out, _, _ = personal_run
    summary = run_experiment(
        default_config("fedavg", **{**PFEDME, "run.rounds": 1}), tmp_path, progress=False, verbose=False
    )
    (row,) = _rows(tmp_path)
    assert "personal_accuracy" not in row and summary.final_personal_accuracy is None
    assert "final_personal_accuracy" not in json.loads((tmp_path / "summary.json").read_text())
    # the same training and the same pooled test set as the personalized run's first round
    first = _rows(out)[0]
    for key in ("test_accuracy", "test_loss", "train_loss", "cumulative_bits"):
        assert row[key] == first[key], key


def test_a_personalized_method_needs_per_client_test_sets(tmp_path, monkeypatch):
    _as_personal(monkeypatch)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"personalized method.*'iid'.*data.partition = \"pfedme\""):
        run_experiment(small(), out, progress=False, verbose=False)
    assert not out.exists()  # refused before any file is written


def test_every_method_builds_an_algorithm_that_declares_its_evaluation():
    """The driver evaluates what the built algorithm's ``evaluation`` says (nothing is declared beside it):
    only BPC-FL's is an ensemble (its posterior samples), only the pFedBayes family and the personalized
    baselines (pFedMe, Per-FedAvg) have personal models. Only the one-shot methods (BPC-FL and its baseline
    DOSFL) are one-shot and need the model context."""
    declared = {}
    for name, cls in METHODS.items():
        config = default_config(f"{name}+{cls.default_coder}", **{"data.num_clients": 4})
        evaluation = prepare(config).algorithm.evaluation
        assert isinstance(evaluation, Evaluation) and callable(evaluation.params), name
        declared[name] = (evaluation.ensemble, evaluation.personal is not None, cls.one_shot, cls.needs_model)
    assert {n for n, (ensemble, *_) in declared.items() if ensemble} == {"bpcfl"}
    assert {n for n, (_, personal, *_) in declared.items() if personal} == {
        "pfedbayes",
        "pfedbayes_subset",
        "coreset_pfedbayes",
        "pfedme",
        "perfedavg",
    }
    one_shot = {n for n, (*_, one_shot, needs_model) in declared.items() if one_shot or needs_model}
    assert one_shot == {"bpcfl", "dosfl"}


def test_a_configuration_refused_when_traced_writes_no_run_folder(tmp_path):
    """The driver traces one round (shapes only) before writing anything: a coreset larger than a client's
    25 training examples is refused with the algorithm's message and no folder is left behind."""
    config = default_config(
        "coreset_pfedbayes+float32",
        **{k: v for k, v in PFEDME.items() if not k.startswith("method.")},
        **{"method.coreset_size": 26},
    )
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="coreset_size=26 exceeds the number of points a client holds"):
        run_experiment(config, out, progress=False, verbose=False)
    assert not out.exists()


def test_the_round_table_shows_personal_accuracy():
    row = {"round": 3, "test_accuracy": 0.5, "train_loss": 1.0, "uplink_bpp": 32.0, "downlink_bpp": 32.0}
    row["cumulative_bits"] = 1e6
    assert "50.00%" in format_row(row) and format_row(row).count("%") == 1
    assert format_row({**row, "personal_accuracy": 0.75}).count("%") == 2
    assert "75.00%" in format_row({**row, "personal_accuracy": 0.75})
    assert format_row({**row, "personal_accuracy": None}).startswith("    3 |    50.00% |         - |")
    assert PERSONAL_TABLE_HEADER.count("|") == TABLE_HEADER.count("|") + 1
    # the columns line up under the header
    header_bars = [i for i, c in enumerate(PERSONAL_TABLE_HEADER) if c == "|"]
    row_bars = [i for i, c in enumerate(format_row({**row, "personal_accuracy": 0.75})) if c == "|"]
    assert row_bars == header_bars


def test_fedpa_config_defaults_are_table_5_and_its_fields_are_checked(small_model):
    """``[method] name = "fedpa"`` (BPC-FL's baseline): Table 5's values by default, built into the algorithm
    with FedPASettings; a bad value names the field."""
    from sidejax.algorithms import FedPASettings

    method_name = "fedpa+float32"
    config = default_config(method_name)
    method = config.method
    assert config.algorithm == method_name and config.coder.name == "float32"
    assert (method.client_optimizer, method.client_lr, method.server_optimizer, method.server_lr) == (
        "momentum",
        0.01,
        "momentum",
        0.5,
    )
    assert method.settings() == FedPASettings(burn_in_rounds=500, num_samples=10, shrinkage=0.1)
    algo = build_algorithm(config, small_model[2])
    assert algo.clients_per_round == config.clients_per_round
    for field, value, rule in [
        ("shrinkage", 1.5, r"shrinkage must be a number in \(0, 1\]"),
        ("num_samples", 0, "num_samples must be an integer >= 1"),
        ("burn_in_rounds", -1, "burn_in_rounds must be an integer >= 0"),
        ("server_lr", 0.0, "server_lr must be > 0"),
    ]:
        with pytest.raises(ValueError, match=rule):
            default_config(method_name, **{f"method.{field}": value})
    fedpa_form = default_config(method_name, **{"method.shrinkage_form": "fedpa", "method.shrinkage": 2.0})
    assert fedpa_form.method.settings().shrinkage_form == "fedpa"


def test_more_devices_than_this_machine_has_is_refused_before_anything_is_written(tmp_path, capsys):
    """``run.devices`` splits the participants over a mesh; asking for more devices than there are (this test
    process has one) is one line naming the flag that simulates more, and no folder is left behind."""
    out = tmp_path / "run"
    code = cli_main(
        ["fedavg", "--output", str(out), "--run.devices", "2", "--run.rounds", "1", "--no-progress"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "devices=2 but this run has 1 device" in err, err
    assert "xla_force_host_platform_device_count" in err and "Traceback" not in err
    assert not out.exists()
    with pytest.raises(ValueError, match=r"\[run\]: devices must be >= 1; got 0"):
        default_config("fedavg", **{"run.devices": 0})


def test_importing_the_library_and_the_driver_does_not_start_jax(tmp_path):
    """jax.distributed.initialize must come before JAX starts its backend; the command line joins the other
    processes after importing everything and parsing its flags."""
    code = (
        "from jax._src import xla_bridge as xb\n"
        "import sidejax, sidejax.algorithms, sidejax.bayes, experiments.run, experiments.driver\n"
        "from experiments.run import build_parser, resolve\n"
        "resolve(build_parser().parse_args(['fedavg', '--run.rounds', '3']))\n"
        "print('started' if xb._backends else 'not started')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "not started", proc.stderr[-2000:]


def test_process_settings_are_checked_and_launch_settings_are_not_fingerprinted():
    from experiments.distributed import fingerprint

    with pytest.raises(ValueError, match=r"coordinator is needed with processes > 1.*host:port"):
        default_config("fedavg", **{"run.processes": 2, "run.devices": 2})
    with pytest.raises(ValueError, match=r"process_id must be in \[0, processes\); got 2"):
        default_config(
            "fedavg", **{"run.processes": 2, "run.devices": 2, "run.process_id": 2, "run.coordinator": "h:1"}
        )
    with pytest.raises(ValueError, match=r"devices must count every device of every process"):
        default_config("fedavg", **{"run.processes": 2, "run.devices": 1, "run.coordinator": "h:1"})
    two = {"run.processes": 2, "run.devices": 8, "run.coordinator": "127.0.0.1:1"}
    a = default_config("fedavg", **two)
    b = default_config("fedavg", **{**two, "run.process_id": 1, "run.coordinator": "10.0.0.1:2"})
    c = default_config("fedavg", **{**two, "run.seed": 1})
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)


def test_a_process_that_cannot_reach_process_0_stops_naming_the_address(monkeypatch):
    """Checked before jax.distributed.initialize, whose own timeout aborts the interpreter."""
    import socket

    from experiments import distributed

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(distributed, "INIT_TIMEOUT_S", 1)
    run = default_config(
        "fedavg",
        **{"run.processes": 2, "run.devices": 2, "run.process_id": 1, "run.coordinator": f"127.0.0.1:{port}"},
    ).run
    with pytest.raises(
        ValueError, match=rf"process 1 of 2 could not reach process 0 at run.coordinator='127.0.0.1:{port}'"
    ):
        distributed.start(run)
    bad = default_config(
        "fedavg", **{"run.processes": 2, "run.devices": 2, "run.process_id": 1, "run.coordinator": "nohost"}
    ).run
    with pytest.raises(ValueError, match="run.coordinator must be host:port"):
        distributed.start(bad)


class _Store:
    """A stand-in for the coordination service's key-value store, shared by the watches of one test."""

    def __init__(self):
        self.values, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def _watch(monkeypatch, store, process_id, processes=3):
    """One process's watch of signs of life on ``store``; ``lost`` records why instead of ending the
    process."""
    from experiments import distributed

    monkeypatch.setattr(distributed, "LOST_AFTER_S", 1.0)
    monkeypatch.setattr(distributed, "BEAT_S", 0.02)
    run = default_config(
        "fedavg",
        **{
            "run.processes": processes,
            "run.devices": processes,
            "run.process_id": process_id,
            "run.coordinator": "127.0.0.1:1",
        },
    ).run
    watch = distributed._Watch(run, lambda: "the last checkpoint is at round 7", store)
    watch.reasons = []

    def lost(why):
        watch.reasons.append(why)
        watch.closed.set()

    watch.lost = lost
    return watch


def test_the_watch_of_signs_of_life_names_a_silent_process_and_spares_one_that_left(monkeypatch):
    """Process 0 watches 1 (alive, then done: "left") and 2 (never a sign of life): only 2 is lost, after
    LOST_AFTER_S; then a store that cannot be reached is lost too."""
    store = _Store()
    zero, one = _watch(monkeypatch, store, 0), _watch(monkeypatch, store, 1)
    one.thread.start()
    while store.values.get("sidejax/alive/1") in (None, "1"):  # process 1 is counting
        time.sleep(0.01)
    t0 = time.monotonic()
    zero.thread.start()
    time.sleep(0.1)
    one.close(left=True)  # written at once, well inside LOST_AFTER_S of its last count
    zero.thread.join(timeout=30)
    assert not zero.thread.is_alive() and time.monotonic() - t0 >= 1.0
    assert zero.reasons == ["process(es) [2] gave no sign of life for 1 s"]
    assert store.values["sidejax/alive/1"] == "left"

    store.down = True
    two = _watch(monkeypatch, store, 2)
    two.thread.start()
    two.thread.join(timeout=30)
    assert len(two.reasons) == 1
    assert two.reasons[0].startswith("the run's coordinator (process 0 at 127.0.0.1:1) could not be reached")


def test_a_lost_process_ends_this_one_with_the_message_and_status_4(tmp_path):
    """The watch's end, in a process of its own: the message (why, and what now) on stderr, status 4."""
    code = (
        "import time\n"
        "from experiments import distributed\n"
        "from experiments.algorithms import default_config\n"
        "run = default_config('fedavg', **{'run.processes': 2, 'run.devices': 2, 'run.process_id': 1,"
        " 'run.coordinator': '127.0.0.1:1'}).run\n"
        "distributed._Watch(run, lambda: 'the last checkpoint is at round 7', None).lost('why')\n"
        "time.sleep(60)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 4, done.stderr
    assert done.stderr.strip() == (
        "stopped: process 1 of 2: why; another process of this run has most likely stopped (see its log). "
        "the last checkpoint is at round 7"
    )


def test_a_new_run_refuses_a_folder_that_holds_anything(tmp_path, capsys):
    """Before: --output on a folder holding anything but a run's config.json (results/demo, a suite folder)
    was accepted and its plots overwritten. One rule: refuse a non-empty folder unless --overwrite."""
    suite = tmp_path / "suite"
    (suite / "fedavg_iid").mkdir(parents=True)
    (suite / "accuracy_vs_round.png").write_bytes(b"the suite's own plot")

    def listing():
        return {str(p.relative_to(suite)): p.read_bytes() if p.is_file() else None for p in suite.rglob("*")}

    before = listing()
    assert cli_main(["fedavg", *FLAGS, "--run.rounds", "1", "--output", str(suite)]) == 2
    err = capsys.readouterr().err
    assert "is not empty (accuracy_vs_round.png, fedavg_iid) and holds no run" in err and "--overwrite" in err
    assert listing() == before
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert cli_main(["fedavg", *FLAGS, "--run.rounds", "1", "--output", str(a_file)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err and a_file.read_text() == "x"
    empty = tmp_path / "empty"
    empty.mkdir()
    check_new_output(empty, overwrite=False)  # an empty folder is a new run's


def test_bpcfl_regression_refuses_a_folder_with_a_finished_result(tmp_path, capsys):
    (tmp_path / "results.json").write_text("{}")
    assert suite_main(["bpcfl_regression", "run", str(tmp_path), "--setting", "quick"]) == 2
    assert "is not empty (results.json)" in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == "{}"


@pytest.mark.slow  # four driver runs through a suite's run_configs
def test_a_suite_counts_a_run_only_for_the_configuration_it_was_asked_for(tmp_path, capsys):
    """Before: after ``table ... --rounds 2`` the suite took those runs as finished for the full setting,
    printed "skipped" and mixed 2-round rows into the table. Now a short try is extended, a finished run of
    exactly the configuration is skipped, and a run of more rounds or another configuration is refused
    before anything is touched."""
    from experiments.suite import run_configs

    def runs(**changes):
        return [("a", small(**{"run.eval_every": 1, **changes}), "A")]

    def rounds_done():
        return [r["round"] for r in _rows(tmp_path / "a")]

    assert run_configs(tmp_path, runs(**{"run.rounds": 2}), force=False, resume_command="") == 0
    assert rounds_done() == [1, 2]
    assert run_configs(tmp_path, runs(**{"run.rounds": 3}), force=False, resume_command="") == 0
    assert "extending the finished 2-round run to 3 rounds" in capsys.readouterr().out
    assert rounds_done() == [1, 2, 3]
    assert run_configs(tmp_path, runs(**{"run.rounds": 3}), force=False, resume_command="") == 0
    assert "finished run found" in capsys.readouterr().out
    before = (tmp_path / "a" / "metrics.jsonl").read_bytes()
    assert run_configs(tmp_path, runs(**{"run.rounds": 2}), force=False, resume_command="") == 2
    assert "holds a run of 3 rounds and this asks for 2" in capsys.readouterr().err
    changed = runs(**{"run.rounds": 3, "method.client_lr": 0.05})
    assert run_configs(tmp_path, changed, force=False, resume_command="") == 2
    assert "method.client_lr" in capsys.readouterr().err
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == before


def test_crc32_checks_every_coders_messages_once():
    """``coder.crc32 = true`` works for every coder: the coders with a check of their own (KLMS, KLMS-Avg) put
    it in their streams, every other coder is wrapped in sidejax.coding.with_crc (a pseudocoreset's coder
    factory included); off, the coder is the plain one."""
    from sidejax.coding import Coder

    for algorithm in sorted(ALGORITHMS):
        for crc in (False, True):
            config = default_config(algorithm, **{"coder.crc32": crc})
            built = config.coder.checked(config.method, client_strategy="map")
            coder = built if isinstance(built, Coder) else built(10)
            native = type(config.coder).native_crc
            assert coder.name.endswith("+crc") == (crc and not native), (algorithm, crc, coder.name)
            if native:
                coder = config.coder
                settings = coder.klms_config() if coder.name == "klms" else coder.config()
                assert settings.crc32 == crc, algorithm


def test_a_section_table_keeps_the_order_and_refuses_a_name_given_twice():
    from experiments.sections import by_name

    assert list(by_name(METHODS["qsgd"], METHODS["fedavg"])) == ["qsgd", "fedavg"]
    twin = type("TwinConfig", (METHODS["qsgd"],), {"name": "fedavg"})
    with pytest.raises(ValueError, match="TwinConfig and FedAvgConfig are both named 'fedavg'"):
        by_name(METHODS["fedavg"], twin)


def test_method_and_coder_sections_are_generated_from_the_library_settings_types():
    """A section that fills a library settings type takes its fields, defaults and help from it (stated
    once, in sidejax) and builds the library value from them; a renamed field maps back; a non-scalar
    library field must be supplied by hand."""
    from experiments.coders import KLMSAvgCoderConfig, KLMSCoderConfig
    from experiments.sections import Section, fills
    from sidejax.algorithms import FedPASettings, LangevinSettings
    from sidejax.algorithms.pfedbayes import CoresetSettings, PFedBayesSettings
    from sidejax.coding import KLMSAvgConfig, KLMSConfig

    assert METHODS["fedpa"]().settings() == FedPASettings()
    assert METHODS["sgld"]().library_value(LangevinSettings) == LangevinSettings()
    assert KLMSCoderConfig().klms_config() == KLMSConfig()  # rho_threshold unset: the library's 3.0
    assert KLMSAvgCoderConfig(crc32=True).config() == KLMSAvgConfig(crc32=True)
    coreset = METHODS["coreset_pfedbayes"](coreset_every=3, aiht_tol=1e-3, coreset_init="zeros")
    assert coreset.library_value(CoresetSettings) == CoresetSettings(every=3, tol=1e-3, init="zeros")
    assert METHODS["fedpa"].field_docs()["num_samples"].startswith("ℓ, local samples per client and round")
    assert METHODS["coreset_pfedbayes"].field_docs()["aiht_tol"].startswith("A-IHT's iteration cap and")
    for cls in (*METHODS.values(), *CODERS.values()):
        for names in cls.libraries.values():
            assert set(names) <= set(cls.field_names()), cls
    with pytest.raises(TypeError, match="personal_optimizer is not a scalar; skip it"):
        fills(PFedBayesSettings)(type("Bad", (Section,), {}))
    with pytest.raises(ValueError, match=r"method 'fedpa': shrinkage must be a number in \(0, 1\]"):
        METHODS["fedpa"](shrinkage=2.0)  # the library's own validation, naming the section


def test_resume_of_a_checkpoint_of_another_stream_format_is_refused(full_run, tmp_path, capsys):
    """A checkpoint written before the counter-hash candidates (no ``stream_format``: format 1) would
    continue with other candidates: resume refuses it by name and leaves the run as it was."""
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    path = checkpoint_path(run / "checkpoint")
    data = path.read_bytes()
    magic_end = data.index(b"\n") + 1
    header_end = data.index(b"\n", magic_end)
    header = json.loads(data[magic_end:header_end])
    payload = data[header_end + 1 :]
    meta = json.loads(payload[: header["meta_bytes"]])
    from sidejax.coding import STREAM_FORMAT

    assert meta.pop("stream_format") == STREAM_FORMAT
    meta_bytes = json.dumps(meta).encode()
    payload = meta_bytes + payload[header["meta_bytes"] :]
    header.update(sha256=hashlib.sha256(payload).hexdigest(), meta_bytes=len(meta_bytes))
    path.write_bytes(data[:magic_end] + json.dumps(header).encode() + b"\n" + payload)
    before = _snapshot(run)
    with pytest.raises(CheckpointError, match="stream format 1: Threefry-2x32 candidates.*--overwrite"):
        run_experiment(small(), run, resume=True, progress=False, verbose=False)
    assert cli_main(["--output", str(run), "--resume", "--run.rounds", "6", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "stream format 1" in err and str(run / "checkpoint") in err and "Traceback" not in err
    assert _snapshot(run) == before
