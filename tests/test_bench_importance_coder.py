"""experiments.bench.importance_coder: every contestant's wall and CPU time, the encode's ratio to the
candidate floor measured in the same run (checked), and the machine, threads and load."""

from __future__ import annotations

import json

import pytest
from test_bench_common import check_run_record, check_timing

from experiments.bench.common import FLOOR_TOLERANCE


@pytest.mark.slow  # a benchmark script end to end
def test_importance_coder_bench_tiny(tmp_path, capsys):
    from experiments.bench import importance_coder

    out = tmp_path / "bench.json"
    report = importance_coder.main(["--dims", "2048", "--log2k", "4", "--repeats", "2", "--output", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    check_run_record(saved["machine"])
    (row,) = saved["results"]
    timed = {"floor", "floor_counter", "floor_threefry", "encode", "encode_format1", "decode"}
    assert set(row["timing"]) == timed
    for t in row["timing"].values():
        check_timing(t, 2)
    cpu = {k: t["best_cpu_s"] for k, t in row["timing"].items()}
    assert row["floor_check_time"] == "cpu"
    assert row["encode_over_counter_floor"] == cpu["encode"] / cpu["floor_counter"] >= FLOOR_TOLERANCE
    # the same encoder traced with stream format 1's Threefry uniforms, timed in the same run
    assert row["encode_speedup_over_format1"] == row["encode_format1_s"] / row["encode_s"] > 0
