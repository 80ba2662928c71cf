"""experiments.bench.local_training: the JSON records every strategy's wall and CPU time, the threads, cores
and load it ran with."""

from __future__ import annotations

import json

import pytest
from test_bench_common import check_run_record, check_timing


@pytest.mark.slow  # a benchmark script end to end
def test_local_training_bench_tiny(tmp_path, capsys):
    from experiments.bench import local_training

    out = tmp_path / "bench.json"
    argv = ["--clients", "2", "--examples-per-client", "64", "--strategies", "map", "--convs", "sidejax"]
    report = local_training.main([*argv, "--repeats", "2", "--output", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    check_run_record(saved["machine"])
    result = saved["results"]["map/sidejax"]
    check_timing(result["timing"], 2)
    assert result["seconds_per_round_best"] == result["timing"]["best_wall_s"] > 0
