"""experiments.bench.common: the defaults of optional flags, the machine record and the JSON report writer
shared by the benchmark scripts; and :func:`run_quick`, the end-to-end check of a script's ``--quick`` run
that the benchmark tests share."""

from __future__ import annotations

import argparse
import json
import os

from experiments.bench.common import fill_defaults, machine_record, write_json, write_report


def check_run_record(machine: dict, *, torch: bool = False) -> None:
    """What every benchmark JSON records of how it was measured (:func:`machine_record`): the threads (XLA
    flags, PyTorch's thread counts where it ran, the cores the process could use), the load average before
    and after the run."""
    assert machine["cpu_count"] >= 1 and len(machine["devices"]) >= 1 and machine["backend"]
    threads = machine["threads"]
    assert isinstance(threads["xla_flags"], str) and isinstance(threads["xla_single_thread"], bool)
    assert threads["cpu_affinity"] and all(isinstance(c, int) for c in threads["cpu_affinity"])
    assert threads["process_threads"] >= 1
    assert (threads["torch_threads"] is not None) == torch
    for key in ("load_average_before", "load_average_after"):
        load = machine[key]
        assert load is None or (len(load) == 3 and all(v >= 0 for v in load))


def check_timing(t: dict, repeats: int) -> None:
    """A contestant's :func:`timing` record: ``repeats`` wall and CPU times and their summaries."""
    assert len(t["wall_s"]) == len(t["cpu_s"]) == repeats
    assert t["best_wall_s"] == min(t["wall_s"]) and t["best_cpu_s"] == min(t["cpu_s"])
    assert t["median_wall_s"] > 0 and t["median_cpu_s"] > 0 and t["cpu_over_wall"] > 0


def run_quick(bench, tmp_path, capsys, title: str, extra: tuple[str, ...] = ()) -> dict:
    """Runs ``bench.main(["--quick", "--out", FILE, *extra])``; checks the printed table's ``title``, the
    ``wrote`` line, that the JSON written is the report returned and that it records the machine, threads
    and load (:func:`check_run_record`). Returns the JSON."""
    out = tmp_path / "bench.json"
    report = bench.main(["--quick", "--out", str(out), *extra])
    printed = capsys.readouterr().out
    assert title in printed and f"wrote {out}" in printed
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    check_run_record(saved["machine"])
    return saved


def test_fill_defaults_sets_only_flags_left_unset():
    quick, full = {"n": 3, "k": 1}, {"n": 30, "k": 10}
    args = argparse.Namespace(quick=True, n=None, k=5)
    fill_defaults(args, quick, full)
    assert (args.n, args.k) == (3, 5)
    args = argparse.Namespace(quick=False, n=None, k=None)
    fill_defaults(args, quick, full)
    assert (args.n, args.k) == (30, 10)


def test_machine_record_fields_in_order():
    from experiments.bench.common import load_average

    before = load_average()
    record = machine_record(load_before=before, extra_version="1.0")
    assert list(record) == [
        "devices",
        "backend",
        "cpu_count",
        "usable_cpus",
        "threads",
        "load_average_before",
        "load_average_after",
        "platform",
        "jax_version",
        "numpy_version",
        "extra_version",
    ]
    assert record["extra_version"] == "1.0" and record["load_average_before"] == before
    check_run_record(record)
    assert record["usable_cpus"] == len(record["threads"]["cpu_affinity"])


def test_threads_record_reads_xla_flags_and_torch_threads(monkeypatch):
    from experiments.bench.common import SINGLE_THREAD_XLA_FLAGS, single_thread_env, threads_record

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    assert threads_record()["xla_single_thread"] is False
    monkeypatch.setenv("XLA_FLAGS", single_thread_env()["XLA_FLAGS"])
    record = threads_record()
    assert record["xla_single_thread"] and SINGLE_THREAD_XLA_FLAGS in record["xla_flags"]

    class FakeTorch:  # the two calls threads_record makes of PyTorch
        get_num_threads = staticmethod(lambda: 3)
        get_num_interop_threads = staticmethod(lambda: 2)

    assert threads_record(FakeTorch)["torch_threads"] == {"intra_op": 3, "interop": 2}


def test_pinned_pins_every_thread_and_restores_the_mask():
    import threading

    import pytest

    from experiments.bench.common import cpu_affinity, pinned

    before = set(os.sched_getaffinity(0))
    core = min(before)
    seen = {}
    started, release = threading.Event(), threading.Event()

    def worker():  # a thread started before pinning, as jax's and PyTorch's pools are
        seen["tid"] = threading.get_native_id()
        started.set()
        release.wait()

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    try:
        with pinned([core]) as cores:
            assert cores == [core] == cpu_affinity()
            assert os.sched_getaffinity(seen["tid"]) == {core}
        assert set(os.sched_getaffinity(0)) == before and os.sched_getaffinity(seen["tid"]) == before
    finally:
        release.set()
        thread.join()
    with pinned(None) as cores:  # not pinned
        assert set(cores) == before
    with pytest.raises(ValueError, match="cores must be a non-empty subset"):
        with pinned([max(before) + 1000]):
            pass
    assert set(os.sched_getaffinity(0)) == before


def test_parse_cores_reads_lists_ranges_all_and_refuses_unusable_cores():
    import pytest

    from experiments.bench.common import parse_cores

    usable = sorted(os.sched_getaffinity(0))
    assert parse_cores(None) == [usable[0]] and parse_cores("all") is None
    assert parse_cores(str(usable[0])) == [usable[0]]
    assert parse_cores(f"{usable[0]}-{usable[-1]}") == usable
    assert parse_cores(",".join(map(str, reversed(usable)))) == usable
    for bad in ("x", "1-0", "", "0-y"):
        with pytest.raises(ValueError, match="--cores takes"):
            parse_cores(bad)
    with pytest.raises(ValueError, match="not usable here"):
        parse_cores(str(usable[-1] + 1000))


def test_timing_summarises_wall_and_cpu_times():
    from experiments.bench.common import timing

    t = timing([(2.0, 1.0), (1.0, 1.5), (3.0, 0.5)])
    assert t["wall_s"] == [2.0, 1.0, 3.0] and t["cpu_s"] == [1.0, 1.5, 0.5]
    assert (t["median_wall_s"], t["median_cpu_s"], t["best_wall_s"], t["best_cpu_s"]) == (2.0, 1.0, 1.0, 0.5)
    assert t["cpu_over_wall"] == 0.5
    check_timing(t, 3)


def test_candidate_floor_generates_the_coders_candidates():
    """The floor sums exactly the candidates the importance coder draws (its public ``candidates``), sample
    ``s`` under ``fold_in(key, s)``, whatever the chunking, so no encoder can do less work."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import pytest

    from experiments.bench.common import FLOOR_TOLERANCE, candidate_floor, check_above_floor
    from sidejax.coding.importance import candidates
    from sidejax.distributions import Bernoulli

    dim, log2k = 70, 3
    p = Bernoulli(jnp.linspace(0.05, 0.95, dim))
    key = jax.random.key(7)
    want = sum(float(jnp.sum(candidates(jax.random.fold_in(key, s), p, log2k))) for s in range(2))
    for chunk in (16, 70):  # a remainder chunk and a single chunk
        assert float(candidate_floor(p, 2**log2k, chunk, num_samples=2)(key)) == pytest.approx(want, rel=1e-6)
    assert check_above_floor("enc", 1.0, 1.0) == 1.0
    with pytest.raises(RuntimeError, match="enc: .* below 0.1x"):
        check_above_floor("enc", FLOOR_TOLERANCE * 0.99, 1.0)
    assert np.isfinite(want)


def test_write_report_writes_json_then_prints(tmp_path, capsys):
    out = tmp_path / "sub" / "r.json"
    assert write_report({"a": [1, 2]}, out, table="TABLE") == out
    assert out.read_text() == json.dumps({"a": [1, 2]}, indent=2) + "\n"
    assert capsys.readouterr().out == f"TABLE\nwrote {out}\n"
    write_report({"a": 1}, str(out), trailing_newline=False)
    assert out.read_text() == json.dumps({"a": 1}, indent=2)
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert write_json({"b": 2}, out) == out and json.loads(out.read_text()) == {"b": 2}
    assert capsys.readouterr().out == ""


def test_parser_from_a_table_fills_sized_defaults_only_when_unset():
    from experiments.bench.common import Sized, parser

    flags = {
        "--quick": (bool, False, "tiny sizes"),
        "--n": (int, Sized(100, 3), "points"),
        "--ks": ([int], Sized([5, 10], [1]), None),
        "--skip": (bool, Sized(False, True), None),
        "--tol": (float, 1e-5, None),
    }
    p = parser("experiments.bench.demo", "Demo.\n\nMore.", flags, out="results/x.json")
    assert p.prog == "python -m experiments.bench.demo" and p.description == "Demo."
    args = p.parse_args(["--quick", "--ks", "7", "8"])
    assert (args.n, args.ks, args.skip, args.tol, args.out) == (3, [7, 8], True, 1e-5, "results/x.json")
    args = p.parse_args(["--no-skip"])
    assert (args.quick, args.n, args.ks, args.skip) == (False, 100, [5, 10], False)
    assert "(default 100; --quick 3)" in p.format_help()
    plain = parser("experiments.bench.demo", "Demo.", {"--n": (int, 4, None)})  # no sized flag, no --quick
    assert plain.parse_args([]).n == 4


def test_interleave_runs_every_call_in_turn_and_best_takes_each_minimum():
    from experiments.bench.common import best, interleave

    order = []
    calls = {"a": lambda: order.append("a") or 1, "b": lambda: order.append("b") or 2}
    times, outputs = interleave(calls, 3)
    assert order == ["a", "b"] * 3 and outputs == {"a": 1, "b": 2}
    assert all(len(t) == 3 and all(w >= 0 and c >= 0 for w, c in t) for t in times.values())
    fastest = best({"x": [(3.0, 1.0), (2.0, 4.0)]})
    assert fastest == {"x": (2.0, 1.0)}


def test_text_table_pads_headers_to_the_columns():
    from experiments.bench.common import text_table

    lines = text_table(
        [("name", "<6"), ("ms", "7.2f"), ("note", ">5")], [["ab", 1.5, "x"], ["cdefgh", 10.0, "yz"]]
    )
    assert lines == ["name        ms  note", "-" * 20, "ab        1.50     x", "cdefgh   10.00    yz"]


def test_child_json_reads_the_tagged_line_and_reports_a_failure(tmp_path):
    import sys

    import pytest

    from experiments.bench.common import child_json, rel_diff

    code = "print('noise'); print('TAG ' + '{\"a\": 1}'); print('after')"
    assert child_json([sys.executable, "-c", code], tag="TAG ") == {"a": 1}
    with pytest.raises(RuntimeError, match="exit code 3"):
        child_json([sys.executable, "-c", "import sys; print('TAG {}'); sys.exit(3)"], tag="TAG ")
    assert rel_diff([1.0, 2.5], [1.0, 2.0]) == 0.25


def test_run_pinned_runs_in_process_or_again_under_the_single_thread_flags(tmp_path, monkeypatch):
    import sys
    from types import SimpleNamespace

    from experiments.bench.common import SINGLE_THREAD_XLA_FLAGS, run_pinned

    before = os.sched_getaffinity(0)
    core = min(before)
    out = tmp_path / "r.json"
    seen = {}

    def run():
        seen.update(cores=sorted(os.sched_getaffinity(0)), flags=os.environ.get("XLA_FLAGS", ""))
        return {"ran": "here"}

    args = SimpleNamespace(cores=[core], threads=0, output=out)
    assert run_pinned("unused", args, [], run) == {"ran": "here"} and seen["cores"] == [core]
    monkeypatch.setenv("XLA_FLAGS", SINGLE_THREAD_XLA_FLAGS)  # already in force: runs here as well
    args.threads = 1
    assert run_pinned("unused", args, [], run) == {"ran": "here"}
    # jax imported (it is, in the tests) and the flags not in force: a fresh interpreter runs the module,
    # on the same cores, with the flags; its JSON is the result
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    module = tmp_path / "fake_bench.py"
    module.write_text(
        "import json, os, sys\n"
        "json.dump({'cores': sorted(os.sched_getaffinity(0)), 'flags': os.environ['XLA_FLAGS'],"
        " 'argv': sys.argv[1:]}, open(sys.argv[-1], 'w'))\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert "jax" in sys.modules
    got = run_pinned("fake_bench", args, ["--x", str(out)], run)
    assert (
        got["cores"] == [core]
        and SINGLE_THREAD_XLA_FLAGS in got["flags"]
        and got["argv"] == ["--x", str(out)]
    )
    assert os.sched_getaffinity(0) == before  # the mask is restored
    assert seen["flags"] == SINGLE_THREAD_XLA_FLAGS  # the in-process runs saw the flags they were given
