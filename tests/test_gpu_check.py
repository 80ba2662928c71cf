"""experiments.gpu_check: the --quick run on this machine's CPU end to end (the report's fields), an existing
report kept, the budget's skips recorded, synthetic data of the real shapes, and the default tests and
presets still existing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import gpu_check

ROOT = Path(__file__).resolve().parents[1]
PAPERS = ("KLMS", "BICompFL", "CEPAM", "CoreSet-PFedBayes", "BPC-FL")


# a preset of every paper, compiled in five subprocesses at the level of this run, then four benchmarks: 2-3
# min cold on 2 cores
@pytest.mark.breadth
def test_quick_check_writes_a_report_with_numbers_for_every_preset(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.gpu_check", "--quick", "--skip-tests", "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check summary (quick)" in proc.stdout and f"wrote {out / 'gpu_check.json'}" in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["mode"] == "quick" and report["finished"] and report["ok"] and not report["failures"]
    device = report["device"]
    assert device["backend"] and device["device_count"] >= 1 and device["jax_version"]
    if device["backend"] == "cpu":
        assert report["accelerator"] is False and "CPU figure" in report["note"]
        assert "no accelerator found" in proc.stdout
    assert report["tests"]["status"] == "skipped" and report["tests"]["reason"] == "--skip-tests"
    assert {"section": "tests", "item": "pytest", "reason": "--skip-tests"} in report["skipped"]

    assert list(report["presets"]) == list(PAPERS)
    for paper, entry in report["presets"].items():
        assert entry["status"] == "ok", (paper, entry)
        assert entry["backend"] == device["backend"]
        assert entry["data"]["synthetic"] and entry["data"]["dataset"] == "fashion_mnist"
        assert entry["data"]["num_classes"] == 10 and entry["data"]["test_shape"][1:] == [28, 28, 1]
        assert entry["num_params"] > 0 and entry["finite"] and entry["streams_valid"]
        for key in ("prepare_s", "init_s", "compile_and_first_round_s", "steady_round_s", "eval_s"):
            assert entry[key] > 0, (paper, key)
        assert len(entry["uplink_bits"]) == 2 and all(b > 0 for b in entry["uplink_bits"])
        assert len(entry["uplink_bpp"]) == 2 and all(b > 0 for b in entry["uplink_bpp"])
        assert entry["peak_rss_mb"] > 0 and entry["overrides"] and entry["why"]
        if entry["peak_bytes_in_use"] is None:
            assert entry["memory_note"]
        else:
            assert entry["peak_bytes_in_use"] > 0
    assert report["presets"]["BPC-FL"]["one_shot"] and not report["presets"]["KLMS"]["one_shot"]

    benches = report["benchmarks"]
    assert set(benches) == {b.name for b in gpu_check.BENCHMARKS} | set(gpu_check.NOT_RUN_BENCHMARKS) | {
        "sharding"
    }
    skipped = {s["item"] for s in report["skipped"] if s["section"] == "benchmarks"}
    for name, entry in benches.items():
        if entry["status"] == "skipped":
            assert name in skipped and entry["reason"]
        else:
            assert entry["status"] == "ok", (name, entry)
            assert Path(entry["json"]).is_file() and json.loads(Path(entry["json"]).read_text())
            assert entry["result"] and entry["duration_s"] > 0
    assert benches["importance_coder"]["status"] == "ok"


def test_an_existing_report_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "gpu_check.json").write_text('{"earlier": true}')
    assert gpu_check.main(["--quick", "--output", str(tmp_path)]) == 2
    assert "already exists: pass --overwrite" in capsys.readouterr().err
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == {"earlier": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json"]


def test_a_budget_too_small_records_every_preset_as_skipped(tmp_path, capsys):
    """Nothing is silently dropped: each preset and benchmark that does not fit is in the report with the
    reason (the device facts still run: one small subprocess)."""
    code = gpu_check.main(["--quick", "--skip-tests", "--budget-s", "6", "--output", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["device"]["backend"]
    assert list(report["presets"]) == list(PAPERS)
    for entry in report["presets"].values():
        assert entry["status"] == "skipped" and entry["reason"].startswith("budget: ")
        assert "needs at least" in entry["reason"]
    skipped = {(s["section"], s["item"]) for s in report["skipped"]}
    assert {("presets", p) for p in PAPERS} <= skipped
    assert ("benchmarks", "importance_coder") in skipped
    assert "skipped" in capsys.readouterr().out


def test_junit_counts(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.a" name="ok"/><testcase classname="tests.a" name="bad"><failure/>'
        '</testcase><testcase classname="tests.a" name="s"><skipped/></testcase>'
        '<testcase classname="tests.b" name="ok"/></testsuite></testsuites>'
    )
    counts, failed = gpu_check._junit_counts(xml)
    assert counts == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1, "total": 4}
    assert failed == ["tests.a::bad"]


@pytest.mark.parametrize(
    ("name", "subset", "shape", "classes"),
    [
        ("mnist", "balanced", (28, 28, 1), 10),
        ("cifar100", "balanced", (32, 32, 3), 100),
        ("emnist", "balanced", (28, 28, 1), 47),
    ],
)
def test_synthetic_data_has_the_real_test_split_shapes(name, subset, shape, classes):
    data = gpu_check.synthetic_dataset(name, "test", subset=subset)
    n = gpu_check.EMNIST_SIZES[subset][1] if name == "emnist" else gpu_check.REAL_SHAPES[name][1]
    assert data.x.shape == (n, *shape) and data.x.dtype == np.float32
    assert 0.0 <= data.x.min() and data.x.max() <= 1.0
    assert data.y.dtype == np.int32 and data.num_classes == classes
    counts = np.bincount(data.y, minlength=classes)
    assert counts.size == classes and counts.max() - counts.min() <= 1  # balanced


def test_synthetic_datasets_replaces_only_the_file_datasets_and_restores_the_loader():
    from experiments import driver

    real = driver.load_dataset
    with gpu_check.synthetic_datasets() as replaced:
        assert driver.load_dataset is not real
        digits = driver.load_dataset("digits", "test")
        assert digits.x.shape == (360, 8, 8, 1) and replaced == []
        assert driver.load_dataset("fashion_mnist", "test").x.shape == (10_000, 28, 28, 1)
        assert replaced == ["fashion_mnist"]
    assert driver.load_dataset is real


def test_the_default_tests_and_presets_exist_and_load():
    from experiments.config import load_preset

    for path in (*gpu_check.ACCELERATOR_TESTS, *gpu_check.QUICK_TESTS):
        assert (ROOT / path).is_file(), path
    for check in (*gpu_check.PAPER_PRESETS, *gpu_check.QUICK_PRESETS):
        config = load_preset(check.preset)
        rounds = 1 if config.method.one_shot else 2
        config.override({**check.overrides, "run.rounds": rounds})  # raises on a stale override
        assert gpu_check._paper_of(check.preset) == check.paper
    assert [c.paper for c in gpu_check.PAPER_PRESETS] == list(PAPERS)
    assert [c.paper for c in gpu_check.QUICK_PRESETS] == list(PAPERS)
    for bench in gpu_check.BENCHMARKS:
        assert (ROOT / "experiments" / "bench" / f"{bench.name}.py").is_file()
