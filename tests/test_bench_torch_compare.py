"""experiments.bench.torch_compare runs without PyTorch: a message, no traceback, ``"torch": null``."""

from __future__ import annotations

import json
import sys

import pytest


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
    assert saved["torch"] is None and saved["torch_version"] is None
    entry = saved["results"]["32"]
    assert entry["torch"] is None and entry["sidejax_over_torch_time"] is None
    assert entry["sidejax"]["seconds_per_epoch"] > 0 and len(entry["sidejax"]["seconds_per_epoch_all"]) == 1
