"""The generic suite command (experiments.suite) on a suite whose runner only writes files: the folder rule,
skip / resume / refuse, Ctrl-C and ``resume``, bad flags in one line, and the table's cells (one row per run,
or per label over seeds). The paper suites' own runs are in tests/test_*_experiments.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import experiments.suite as suites
from experiments.suite import Suite, main, table_rows


class FileRunner:
    """Runs are dicts; a run writes ``done.json`` (its config) and is finished when that file is there.
    ``interrupt`` names runs that raise ``KeyboardInterrupt`` once (a Ctrl-C), after writing ``partial``."""

    def __init__(self):
        self.executed, self.interrupt = [], set()

    def load(self, name):
        if not name.startswith("fake_"):
            raise ValueError(f"unknown preset {name!r}")
        return {"name": name, "rounds": 3, "seed": 0}

    def with_rounds(self, config, rounds):
        return {**config, "rounds": rounds}

    def with_seed(self, config, seed):
        return {**config, "seed": seed}

    def with_value(self, config, key, text):
        if key not in config:
            raise ValueError(f"--set {key}: unknown")
        return {**config, key: suites._parse_value(text)}

    def resolve(self, config, directory, seed, source):
        return config

    def plan(self, out: Path, config, force):
        if force or not (out / "done.json").is_file():
            return ("resume", "(resuming)") if (out / "partial").is_file() and not force else ("run", "")
        if json.loads((out / "done.json").read_text()) == config:
            return "skip", f"finished run found in {out}"
        return "refuse", f"{out} holds another configuration"

    def execute(self, config, out: Path, *, resume, label):
        out.mkdir(parents=True, exist_ok=True)
        if config["name"] in self.interrupt:
            self.interrupt.discard(config["name"])
            (out / "partial").write_text("")
            raise KeyboardInterrupt
        self.executed.append((out.name, resume))
        (out / "done.json").write_text(json.dumps(config))

    def read(self, folder: Path):
        if not (folder / "done.json").is_file():
            return []
        config = json.loads((folder / "done.json").read_text())
        return [{"config": config, "summary": {"value": config["rounds"] + config["seed"]}, "rows": []}]


def _figure(runs, directory):
    path = directory / "figure.txt"
    path.write_text(", ".join(r["name"] for r in runs))
    return [path]


def _fake(runner, per_label=False) -> Suite:
    return Suite(
        name="fake",
        title="a suite of files",
        columns=(("variant", None), ("value", ".1f"), ("seeds", None)),
        label=lambda name, config: config["name"].rsplit("_", 1)[1].upper(),
        cells=lambda run, runs: {"value": run["summary"]["value"], "seeds": str(run["config"]["seed"])},
        figure=_figure,
        settings={"small": "a small setting"},
        variants={"b": "B", "a": "A"},
        per_label=per_label,
        runner=runner,
    )


@pytest.fixture
def runner(monkeypatch):
    suites.suite("klms")  # the registry, filled before the fake suite joins it
    r = FileRunner()
    monkeypatch.setitem(suites.SUITES, "fake", _fake(r))
    return r


def test_fresh_folder_rerun_and_the_table(tmp_path, runner, capsys):
    out = tmp_path / "suite"
    args = ["fake", "run", str(out), "--setting", "small", "--rounds", "5"]
    assert main(args) == 0
    assert runner.executed == [("fake_small_b", False), ("fake_small_a", False)]
    assert json.loads((out / "suite.json").read_text()) == {"suite": "fake", "argv": args[1:]}
    md = (out / "table.md").read_text()
    assert md.splitlines()[0] == "| variant | value | seeds |"
    assert md.splitlines()[2:] == ["| B | 5.0 | 0 |", "| A | 5.0 | 0 |"]  # the variants' order
    assert (out / "figure.txt").read_text() == "fake_small_b, fake_small_a"
    capsys.readouterr()
    assert main(args) == 0  # into the full folder: every run finished for exactly this configuration
    assert capsys.readouterr().out.count("finished run found") == 2 and len(runner.executed) == 2
    assert main([*args[:-1], "7"]) == 2  # the same runs asked with more rounds: refused, untouched
    assert "holds another configuration" in capsys.readouterr().err and len(runner.executed) == 2
    assert json.loads((out / "suite.json").read_text())["argv"] == args[1:]  # `resume` keeps the last plan
    assert main([*args, "--force"]) == 0 and len(runner.executed) == 4


def test_ctrl_c_prints_resume_and_resume_replays_the_plan(tmp_path, runner, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "suite"
    runner.interrupt.add("fake_small_a")
    assert main(["fake", "run", "suite", "--setting", "small", "--seeds", "1", "2"]) == 130
    err = capsys.readouterr().err
    assert "python -m experiments.suite fake resume suite" in err and "Traceback" not in err
    assert runner.executed == [("fake_small_b_s1", False), ("fake_small_b_s2", False)]
    monkeypatch.chdir(tmp_path.parent)  # resumed from elsewhere: the folder given now is the one resumed
    assert main(["fake", "resume", str(out)]) == 0
    assert runner.executed[2:] == [("fake_small_a_s1", True), ("fake_small_a_s2", False)]
    assert main(["fake", "table", str(out)]) == 0
    assert "| B | 4.0 | 1 |" in (out / "table.md").read_text()


def test_the_folder_rule(tmp_path, runner, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(["fake", "run", str(foreign), "--setting", "small"]) == 2
    err = capsys.readouterr().err
    assert "is not empty (notes.txt)" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"] and not runner.executed
    assert main(["fake", "run", str(foreign), "--setting", "small", "--overwrite"]) == 0
    assert (foreign / "notes.txt").read_text() == "mine"
    other = tmp_path / "other"
    other.mkdir()
    (other / "suite.json").write_text(json.dumps({"suite": "cepam", "argv": []}))
    assert main(["fake", "run", str(other), "--setting", "small"]) == 2
    assert "holds the 'cepam' suite's runs" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nope", "table", "x"], "unknown suite 'nope'"),
        (["fake", "run", "{out}"], "run needs --setting (small) or --preset"),
        (["fake", "run", "{out}", "--setting", "small", "--preset", "fake_x"], "not both"),
        (["fake", "run", "{out}", "--preset", "fake_x", "--only", "a"], "--only chooses among"),
        (["fake", "run", "{out}", "--preset", "other"], "unknown preset 'other'"),
        (["fake", "run", "{out}", "--setting", "small", "--rounds", "0"], "--rounds must be >= 1"),
        (["fake", "run", "{out}", "--setting", "small", "--seeds", "1", "1"], "--seeds must be distinct"),
        (["fake", "run", "{out}", "--setting", "small", "--set", "rounds"], "expected KEY=VALUE"),
        (["fake", "run", "{out}", "--setting", "small", "--set", "lr=1"], "--set lr: unknown"),
        (["fake", "resume", "{out}"], "no suite run to resume"),
        (["fake", "table", "{out}"], "is not a directory"),
        (["fake", "presets"], "has no generated presets"),
    ],
)
def test_bad_input_is_refused_in_one_line_writing_nothing(
    tmp_path, runner, capsys, monkeypatch, argv, message
):
    if argv[:2] == ["fake", "presets"]:
        monkeypatch.setitem(suites.SUITES, "fake", dataclasses.replace(_fake(runner), settings={}))
    out = tmp_path / "out"
    assert main([a.format(out=out) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not runner.executed


def test_an_unknown_setting_or_variant_is_argparses_error(tmp_path, runner, capsys):
    for extra in (["--setting", "big"], ["--setting", "small", "--only", "c"]):
        with pytest.raises(SystemExit) as exit_:
            main(["fake", "run", str(tmp_path / "out"), *extra])
        assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_rows_per_label_are_mean_and_std_over_seeds():
    runner = FileRunner()
    runs = [
        {"name": f"r{i}", "label": label, "config": {"seed": i}, "summary": {"value": v}}
        for i, (label, v) in enumerate([("A", 1.0), ("B", 4.0), ("A", 3.0)])
    ]
    assert table_rows(_fake(runner, per_label=True), runs) == [
        {"variant": "A", "value": "2.0 ± 1.4", "seeds": "0, 2"},
        {"variant": "B", "value": "4.0", "seeds": "1"},
    ]
    assert [r["value"] for r in table_rows(_fake(runner), runs)] == ["1.0", "4.0", "3.0"]
    runs[1]["summary"]["value"] = None
    assert table_rows(_fake(runner, per_label=True), runs)[1]["value"] == "-"
    runs[2]["summary"]["value"] = 1.0  # the same on every seed (a preset's fixed rate): once, no "± 0"
    assert table_rows(_fake(runner, per_label=True), runs)[0]["value"] == "1.0"


def test_list_names_every_suite(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("klms", "bicompfl", "cepam", "coreset_pfedbayes", "bpcfl", "bpcfl_regression"):
        assert f"  {name}: " in out


def test_the_docs_suite_commands_parse():
    """Every ``experiments.suite`` command in the README's and the docs' bash blocks names a suite, a command
    and flags its parser takes (settings and variants included)."""
    import shlex

    from test_readme import BASH

    lines = [line for block in BASH for line in block.replace("\\\n", " ").splitlines()]
    commands = [shlex.split(line, comments=True) for line in lines if "-m experiments.suite" in line]
    assert len(commands) >= 8
    for argv in commands:
        assert argv[:3] == [".venv/bin/python", "-m", "experiments.suite"], argv
        suite = suites.suite(argv[3])
        args = suites._parser(suite).parse_args(argv[4:])  # argparse exits on a bad flag, setting or variant
        assert args.command != "run" or bool(args.setting) != bool(args.preset), argv
