"""experiments.bench.sharding at --quick sizes: a 1- and a 2-device subprocess run, the JSON's fields."""

from __future__ import annotations

import json

import pytest
from test_bench_common import check_run_record


@pytest.mark.slow  # a benchmark script end to end (two subprocesses compiling LeNet5 rounds)
def test_sharding_bench_quick(tmp_path, capsys):
    from experiments.bench import sharding

    out = tmp_path / "sharding.json"
    report = sharding.main(["--quick", "--devices", "1,2", "--methods", "fedavg", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "2 device(s): fedavg x" in printed and f"wrote {out}" in printed
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    assert set(saved["results"]) == {"1", "2"}
    for n in ("1", "2"):
        row = saved["results"][n]["fedavg"]
        assert row["round_s"] > 0 and row["round_cpu_s"] > 0 and row["compile_s"] > 0
        assert row["per_device_bytes"] is None or row["per_device_bytes"] > 0
    assert saved["ratio_to_first_count"]["1"]["fedavg"]["round_time"] == 1.0
    check_run_record(saved["machine"])


def test_bad_device_counts_are_refused(capsys):
    from experiments.bench import sharding

    with pytest.raises(SystemExit):
        sharding.main(["--devices", "1,32", "--participants", "16"])
    assert "--devices must be between 1 and --participants=16" in capsys.readouterr().err
