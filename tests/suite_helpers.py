"""Helpers for the suite tests: run a paper's suite on shrunk configurations instead of its presets."""

from __future__ import annotations

import dataclasses

#: The shrunk federation the suite tests run (each adds its method's and dataset's own fields): 4 clients on
#: ``digits``, 2 rounds, evaluated after each.
SMALL_FEDERATION = {"data.dataset": "digits", "data.num_clients": 4, "run.rounds": 2, "run.eval_every": 1}


def use_configs(monkeypatch, suite, configs: dict) -> None:
    """Makes ``python -m experiments.suite <suite.name> ...`` load ``configs[preset name]`` instead of the
    preset files (a small federation for the tests); plan, folders, table and figure stay the suite's."""
    import experiments.suite as suites

    class Runner(type(suite.runner)):
        def load(self, name):
            return configs[name]

    suites.suite(suite.name)  # the registry, filled before one entry is replaced
    monkeypatch.setitem(suites.SUITES, suite.name, dataclasses.replace(suite, runner=Runner()))


def assert_shipped_presets(suite, settings, variants, tmp_path) -> None:
    """Every (setting, variant) preset of ``suite`` is listed and is exactly what ``python -m
    experiments.suite <suite> presets`` writes, one per pair (so the presets and the table's definitions
    cannot drift apart)."""
    from experiments.config import PRESET_DIR, list_presets
    from experiments.suite import write_presets

    written = write_presets(suite, tmp_path)
    assert len(written) == len(settings) * len(variants)
    for path in written:
        assert (PRESET_DIR / path.name).read_text() == path.read_text(), path.name
    assert {suite.preset_name(s, v) for s in settings for v in variants} <= set(list_presets())
