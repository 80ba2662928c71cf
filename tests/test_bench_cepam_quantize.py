"""experiments.bench.cepam_quantize at a tiny size: runs, checks the decoded noise law, writes the JSON."""

from __future__ import annotations

import json
import math
import os

import pytest


@pytest.mark.slow  # a benchmark script end to end
def test_cepam_quantize_bench_tiny(tmp_path, capsys):
    from experiments.bench import cepam_quantize

    out = tmp_path / "bench.json"
    d = 3001
    cores = os.sched_getaffinity(0)
    core = min(cores)
    try:
        report = cepam_quantize.main(
            [
                "--dim",
                str(d),
                "--repeats",
                "2",
                "--lattices",
                "z1",
                "--out",
                str(out),
                "--pin-core",
                str(core),
            ]
        )
    finally:
        os.sched_setaffinity(0, cores)  # the benchmark pinned this process
    printed = capsys.readouterr().out
    assert "Z^1-gaussian" in printed and "Z^1-laplace" in printed and f"wrote {out}" in printed
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    assert saved["dims"] == [d] and saved["repeats"] == 2 and saved["sigma"] == 0.1 and saved["b"] == 0.1
    machine = saved["machine"]
    assert machine["cpu_count"] >= 1 and len(machine["devices"]) >= 1 and machine["backend"]
    assert len(machine["load_average_after"]) == 3 and len(machine["load_average_before"]) == 3
    assert saved["threads"]["pinned_core"] == core and saved["threads"]["usable_cpus"] == 1
    assert saved["threads"]["jax_imported_before_the_flags"]  # in this process: the flags are recorded as is
    assert saved["process_cpu_seconds"] > 0
    cases = saved["results"][str(d)]
    assert set(cases) == {"Z^1-gaussian", "Z^1-laplace"}
    for name, case in cases.items():
        laplace = name.endswith("laplace")
        assert case["noise"] == ("laplace" if laplace else "gaussian")
        assert case["blocks"] == d and case["lattice_dim"] == 1
        # Z^1: every block accepts at the first trial (p = 1 exactly), so no trial index is sent
        assert case["acceptance_probability"] == 1.0
        assert case["mean_trials"] == 1.0 and case["max_trials"] == 1
        assert 0.0 < case["bits_per_coordinate"] < 16.0
        target = math.sqrt(2.0) * 0.1 if laplace else 0.1
        assert case["expected_error_std"] == pytest.approx(target)
        tol = 5.0 * target * math.sqrt((5.0 if laplace else 2.0) / d) / 2.0
        for key in ("error_std", "round_trip_error_std", "baseline_error_std"):
            assert abs(case[key] - target) <= tol, (name, key, case[key])
        assert abs(case["numpy_reference"]["round_trip_error_std"] - target) <= tol
        assert 0.0 < case["numpy_reference"]["bits_per_coordinate"] < 16.0
        for clock in ("wall", "cpu"):
            sec = case[f"{clock}_seconds"]
            assert set(sec) == set(cepam_quantize.STEPS) | set(cepam_quantize.NUMPY_STEPS)
            assert sec["round_trip"] == pytest.approx(sec["encode"] + sec["decode"])
            assert sec["numpy_round_trip"] == pytest.approx(sec["numpy_encode"] + sec["numpy_decode"])
            speedup = case[f"{clock}_speedup_vs_numpy"]
            assert speedup == pytest.approx(sec["numpy_round_trip"] / sec["round_trip"])
            rate = case[f"{clock}_coords_per_second"]
            slow = case[f"{clock}_slowdown_vs_baseline"]
            assert set(slow) == {"quantize", "reconstruct", "round_trip"}
            for step in ("quantize", "reconstruct", "round_trip"):
                if sec["baseline"] > 0 and sec[step] > 0:
                    assert rate[step] == pytest.approx(d / sec[step])
                    assert slow[step] == pytest.approx(sec[step] / sec["baseline"])
        assert all(v > 0 for v in case["wall_seconds"].values())
        assert set(case["first_call_wall_seconds"]) == (
            set(cepam_quantize.STEPS) | set(cepam_quantize.NUMPY_STEPS)
        ) - {"round_trip", "numpy_round_trip"}


def test_cepam_quantize_check_fails_loudly():
    import numpy as np

    from experiments.bench import cepam_quantize

    rng = np.random.default_rng(0)
    err = 0.1 * rng.standard_normal(20_000)
    mean, std, target = cepam_quantize._check_error("ok", err, "gaussian", 0.1)
    assert target == 0.1 and abs(std - 0.1) < 0.005
    with pytest.raises(RuntimeError, match="not gaussian noise of std 0.1"):
        cepam_quantize._check_error("bad", 1.1 * err, "gaussian", 0.1)
    with pytest.raises(RuntimeError, match="not laplace noise"):
        cepam_quantize._check_error("bad", err, "laplace", 0.1)  # std 0.1, not sqrt(2)·0.1


def test_cepam_quantize_rejects_bad_arguments():
    from experiments.bench import cepam_quantize

    with pytest.raises(SystemExit):
        cepam_quantize.main(["--repeats", "0"])
    with pytest.raises(SystemExit):
        cepam_quantize.main(["--dim", "0"])
    with pytest.raises(SystemExit):
        cepam_quantize.main(["--lattices", "z4"])


@pytest.mark.parametrize(("n", "family"), [(1, "gaussian"), (1, "laplace"), (2, "gaussian"), (3, "gaussian")])
def test_numpy_reference_writes_sidejax_streams_and_has_the_law(n, family):
    """The numpy reference of the benchmark: from the same (h, coords) its writer gives sidejax's words bit
    for bit and its reader reads them back; its own round trip has the noise's law (the check the
    benchmark applies) and decodes every block."""
    import jax.numpy as jnp
    import numpy as np

    from experiments.bench import cepam_quantize
    from sidejax.coding.lattice import encode_lattice_stream, lattice_stream_capacity_words

    ref = cepam_quantize.NumpyLRSUQ(n, family, 0.1)
    rng = np.random.default_rng(n)
    blocks = 3000
    h = rng.geometric(ref.p, blocks)
    flat = np.zeros(blocks * n, np.int64)
    live = rng.random(blocks * n) < 0.05
    flat[live] = rng.integers(1, 300, live.sum()) * rng.choice([-1, 1], live.sum())
    words, num_bits = ref._write(h, flat)
    cap = lattice_stream_capacity_words(blocks, n, ref.trial_m, 16, acceptance=ref.p if ref.trial_m else None)
    want, want_bits, _ = encode_lattice_stream(
        jnp.asarray(h, jnp.int32),
        jnp.asarray(flat.reshape(blocks, n), jnp.int32),
        trial_m=ref.trial_m,
        capacity_words=cap,
    )
    assert num_bits == int(want_bits)
    np.testing.assert_array_equal(words, np.asarray(want)[: words.size])
    h2, flat2 = ref._read(words, num_bits, blocks)
    np.testing.assert_array_equal(h2, h if ref.trial_m else np.ones(blocks))
    np.testing.assert_array_equal(flat2, flat)
    d = 12_001
    x = rng.standard_normal(d).astype(np.float32)
    x /= np.linalg.norm(x)
    words, num_bits = ref.encode(3, x)
    y = ref.decode(3, words, num_bits, d)
    cepam_quantize._check_error("numpy reference", y - x, family, 0.1)
    with pytest.raises(ValueError, match="malformed"):
        ref.decode(3, words, num_bits - 1, d)
