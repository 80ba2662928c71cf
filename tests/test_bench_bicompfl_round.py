"""experiments.bench.bicompfl_round: the JSON records wall and CPU time of every contestant, the cores both
sides were pinned to, the threads and load, and the candidate floor the encode is checked against."""

from __future__ import annotations

import os

import pytest
from test_bench_common import check_run_record, check_timing, run_quick


@pytest.mark.slow  # a benchmark script end to end
def test_bicompfl_round_bench_quick(tmp_path, capsys, monkeypatch):
    from experiments.bench import bicompfl_round

    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # the sidejax side alone, fast
    before = os.sched_getaffinity(0)
    core = min(before)
    saved = run_quick(bicompfl_round, tmp_path, capsys, "BICompFL importance sampling", ("--threads", "0"))
    check_run_record(saved["machine"])
    assert saved["cores"] == [core] == saved["machine"]["threads"]["cpu_affinity"]
    assert os.sched_getaffinity(0) == before  # the mask is restored
    assert saved["torch"] is None and set(saved["configs"]) == {"b128_k16", "b256_k256"}
    for entry in saved["configs"].values():
        assert set(entry["timing"]) == {"sidejax_encode", "sidejax_decode", "candidate_floor"}
        for t in entry["timing"].values():
            check_timing(t, 1)
        cpu = {k: t["median_cpu_s"] for k, t in entry["timing"].items()}
        assert entry["encode_over_floor_cpu_time"] == cpu["sidejax_encode"] / cpu["candidate_floor"] >= 0.75
        assert "torch_over_sidejax_time" not in entry


def test_bicompfl_round_refuses_bad_arguments():
    from experiments.bench import bicompfl_round

    for bad in (["--repeats", "0"], ["--dim", "100"], ["--cores", "x"]):
        with pytest.raises(SystemExit):
            bicompfl_round.main(["--quick", *bad])
