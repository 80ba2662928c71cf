"""experiments.bench.common: the defaults of optional flags, the machine record and the JSON report writer
shared by the benchmark scripts; and :func:`run_quick`, the end-to-end check of a script's ``--quick`` run
that the benchmark tests share."""

from __future__ import annotations

import argparse
import json

from experiments.bench.common import fill_defaults, machine_record, write_json, write_report


def run_quick(bench, tmp_path, capsys, title: str) -> dict:
    """Runs ``bench.main(["--quick", "--out", FILE])``; checks the printed table's ``title``, the ``wrote``
    line, that the JSON written is the report returned and that it records the machine. Returns the JSON."""
    out = tmp_path / "bench.json"
    report = bench.main(["--quick", "--out", str(out)])
    printed = capsys.readouterr().out
    assert title in printed and f"wrote {out}" in printed
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    machine = saved["machine"]
    assert machine["cpu_count"] >= 1 and len(machine["devices"]) >= 1 and machine["backend"]
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
    record = machine_record(extra_version="1.0")
    assert list(record) == [
        "devices",
        "backend",
        "cpu_count",
        "usable_cpus",
        "platform",
        "jax_version",
        "numpy_version",
        "extra_version",
    ]
    assert record["extra_version"] == "1.0" and record["devices"] and record["cpu_count"] >= 1
    with_load = machine_record(load_average=True)
    assert list(with_load)[4] == "load_average_after"
    load = with_load["load_average_after"]
    assert load is None or (len(load) == 3 and all(v >= 0 for v in load))


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
