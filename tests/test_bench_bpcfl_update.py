"""experiments.bench.bpcfl_update at --quick sizes: runs, writes the JSON, and the per-chain loop (the
authors' structure) computes the same BPC-fKL updates as sidejax's learn_pseudocoreset. No speed is
asserted."""

from __future__ import annotations

import math

import pytest
from test_bench_common import run_quick


@pytest.mark.slow  # a benchmark script end to end
def test_bpcfl_update_bench_quick(tmp_path, capsys):
    from experiments.bench import bpcfl_update as bench

    saved = run_quick(bench, tmp_path, capsys, "BPC-fKL update")
    s = saved["settings"]
    assert s["quick"] and s["skip_through"] and s["repeats"] == 1 and s["updates"] == 3
    assert (s["pairs"], s["chain_length"], s["num_noise"], s["num_points"]) == (3, 5, 2, 5)
    assert saved["problem"]["num_params"] == 3002 and saved["problem"]["num_examples"] == 20

    methods = ["sidejax", "unrolled", "per_chain"]  # --quick skips through_chain
    for field in (
        "compile_seconds",
        "wall_seconds_per_update",
        "cpu_seconds_per_update",
        "wall_seconds_total",
    ):
        assert list(saved[field]) == methods, field
    for field in ("compile_seconds", "wall_seconds_per_update", "wall_seconds_total"):
        assert all(math.isfinite(v) and v > 0 for v in saved[field].values()), field
    wall = saved["wall_seconds_per_update"]
    for m in methods:
        assert saved["wall_seconds_total"][m] == pytest.approx(s["updates"] * wall[m])
        assert saved["ratio_to_sidejax"][m] == pytest.approx(wall[m] / wall["sidejax"])
        cpu = saved["cpu_seconds_per_update"]
        assert saved["cpu_ratio_to_sidejax"][m] == pytest.approx(cpu[m] / cpu["sidejax"])
    assert set(saved["temp_bytes"]) == set(methods)
    assert all(v is None or v >= 0 for v in saved["temp_bytes"].values())

    cc = saved["cross_check"]
    assert cc["finite"] and cc["inputs_move_max_abs"] > 0
    # the unrolled loop runs the very same compiled update; the per-chain loop the same math
    assert cc["final_inputs_diff_over_move"]["unrolled"] < 1e-5
    assert cc["final_inputs_diff_over_move"]["per_chain"] < 1e-3
    assert max(cc["final_inputs_rel_diff"].values()) < 1e-5
    c32, c64 = cc["first_update_float32"], cc["first_update_float64"]
    assert c32["gradient_norm"] > 0 and c64["gradient_norm"] > 0
    assert c32["gradient_rel_diff"] < 1e-4 and c32["gradient_at_same_chain_ends_rel_diff"] < 1e-4
    assert c32["chain_ends_rel_diff_max"] < 1e-5
    assert c64["gradient_rel_diff"] < 1e-10 and c64["gradient_at_same_chain_ends_rel_diff"] < 1e-10
    assert c64["chain_ends_rel_diff_max"] < 1e-12


def test_bpcfl_update_bench_rejects_bad_arguments():
    from experiments.bench import bpcfl_update as bench

    for bad in (["--updates", "0"], ["--pairs", "0"], ["--data-chain-length", "7"], ["--num-points", "21"]):
        with pytest.raises(SystemExit):
            bench.main(["--quick", *bad])
