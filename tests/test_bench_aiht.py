"""experiments.bench.aiht at --quick sizes: runs, writes the JSON, sidejax and numpy A-IHT agree."""

from __future__ import annotations

import numpy as np
import pytest
from test_bench_common import run_quick


@pytest.mark.slow  # a benchmark script end to end
def test_aiht_bench_quick(tmp_path, capsys):
    from experiments.bench import aiht as bench

    saved = run_quick(bench, tmp_path, capsys, "A-IHT")
    s = saved["settings"]
    assert s["quick"] and s["n"] == 60 and s["ks"] == [12] and s["clients"] == 3 and s["repeats"] == 1
    assert "not synthetic" in saved["problem"]["phi"]
    assert set(saved["results"]) == {"12"}
    r = saved["results"]["12"]
    n, k, clients = 60, 12, 3
    assert r["k"] == k and r["n"] == n and r["clients"] == clients and r["J"] == bench.num_samples(k) == 100
    assert r["projection_float32_max_rel_error"] < 1e-5
    for clock in ("wall_seconds", "cpu_seconds"):
        assert set(r[clock]) == set(bench.METHODS)
    assert all(v > 0 for v in r["wall_seconds"].values())
    assert all(v > 0 for v in r["compile_seconds"].values())
    ratio = r["ratio_sidejax_over_numpy"]
    w = r["wall_seconds"]
    assert ratio["batch_vmap"] == pytest.approx(w["sidejax_vmap"] / w["numpy"])
    assert ratio["per_client_loop"] == pytest.approx(w["sidejax_loop"] / w["numpy"])

    sj, nps, cc = r["sidejax"], r["numpy"], r["cross_check"]
    # sparse, non-negative, identical under vmap and the loop
    assert all(1 <= size <= k for size in sj["support_size"]) and sj["min_weight"] >= 0.0
    assert all(1 <= size <= k for size in nps["support_size"]) and nps["min_weight"] >= 0.0
    assert sj["vmap_vs_loop_max_abs_weight_diff"] <= 1e-5 * max(sj["weight_sum"])
    # float32 sidejax and float64 numpy run the same algorithm: same objective (and here the same supports)
    for a, b in zip(sj["relative_objective"], nps["relative_objective"], strict=True):
        assert 0.0 < a < 1.0 and a == pytest.approx(b, rel=1e-4)
    assert max(cc["objective_rel_diff"]) < 1e-4
    assert all(cc["same_support"])
    for a, b in zip(sj["relative_objective_float32"], sj["relative_objective"], strict=True):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-6)
    assert all(1 <= it <= 300 for it in sj["iterations"] + nps["iterations"])
    # sidejax in float64 follows numpy's trajectory: same iterations, supports and objective to round-off
    f64 = r["sidejax_float64"]
    assert f64["iterations"] == nps["iterations"] and all(f64["same_support_as_numpy"])
    assert max(f64["objective_rel_diff_vs_numpy"]) < 1e-9
    assert max(f64["weights_max_abs_diff_over_max_weight_vs_numpy"]) < 1e-9
    # context: random subsets are worse than A-IHT; NNLS (J = 100 > n = 60) fits y with more than k points
    random_rel = r["random_subset"]["mean_relative_objective"]
    assert all(a < rnd for a, rnd in zip(sj["relative_objective"], random_rel, strict=True))
    assert all(0 <= size <= n for size in r["nnls"]["support_size"])
    assert all(
        0.0 <= f <= a for f, a in zip(r["nnls"]["relative_objective"], sj["relative_objective"], strict=True)
    )


def test_numpy_aiht_matches_sidejax_float32():
    """The numpy reference against sidejax.bayes.aiht on a small random non-negative problem."""
    import jax.numpy as jnp

    from experiments.bench import aiht as bench
    from sidejax.bayes import aiht

    rng = np.random.default_rng(1)
    phi = rng.standard_normal((40, 30))
    y = phi @ np.abs(rng.standard_normal(30))
    w, f, it, conv = bench.numpy_aiht(y, phi, 8)
    res = aiht(jnp.asarray(y, jnp.float32), jnp.asarray(phi, jnp.float32), 8)
    assert np.sum(w > 0) <= 8 and w.min() >= 0 and 1 <= it <= 300
    w32 = np.asarray(res.weights, np.float64)
    assert np.sum(w32 > 0) <= 8 and w32.min() >= 0
    r = y - phi @ w32
    assert float(r @ r) == pytest.approx(f, rel=1e-3)


def test_aiht_bench_rejects_bad_arguments():
    from experiments.bench import aiht as bench

    with pytest.raises(SystemExit):
        bench.main(["--quick", "--ks", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--ks", "61"])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--repeats", "0"])
