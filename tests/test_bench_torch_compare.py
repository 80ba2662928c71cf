"""experiments.bench.torch_compare runs without PyTorch: a message, no traceback, ``"torch": null``."""

from __future__ import annotations

import json
import os
import sys

import pytest
from test_bench_common import check_run_record, check_timing


@pytest.mark.slow  # a benchmark script end to end
def test_torch_compare_skips_pytorch_cleanly_when_not_installed(tmp_path, monkeypatch, capsys):
    from experiments.bench import torch_compare

    monkeypatch.setitem(
        sys.modules, "torch", None
    )  # `import torch` raises ImportError, as when not installed
    out = tmp_path / "bench.json"
    argv = [
        "--examples",
        "64",
        "--batch-sizes",
        "32",
        "--repeats",
        "1",
        "--threads",
        "0",
        "--output",
        str(out),
    ]
    report = torch_compare.main(argv)
    printed = capsys.readouterr()
    assert "skipping PyTorch: PyTorch is not installed" in printed.out
    assert "Traceback" not in printed.out + printed.err
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    assert saved["torch"] is None and "torch_version" not in saved["machine"]
    check_run_record(saved["machine"])
    core = min(os.sched_getaffinity(0))
    assert saved["cores"] == [core] == saved["machine"]["threads"]["cpu_affinity"]  # pinned while it ran
    entry = saved["results"]["32"]
    assert entry["torch"] is None and entry["sidejax_over_torch_time"] is None
    assert entry["sidejax"]["seconds_per_epoch"] == entry["sidejax"]["timing"]["median_wall_s"] > 0
    check_timing(entry["sidejax"]["timing"], 1)
    assert entry["sidejax"]["cpu_us_per_example"] > 0
