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
