"""Helpers for the suite tests: run a paper's suite on shrunk configurations instead of its presets."""

from __future__ import annotations

import dataclasses


def use_configs(monkeypatch, suite, configs: dict) -> None:
    """Makes ``python -m experiments.suite <suite.name> ...`` load ``configs[preset name]`` instead of the
    preset files (a small federation for the tests); plan, folders, table and figure stay the suite's."""
    import experiments.suite as suites

    class Runner(type(suite.runner)):
        def load(self, name):
            return configs[name]

    suites.suite(suite.name)  # the registry, filled before one entry is replaced
    monkeypatch.setitem(suites.SUITES, suite.name, dataclasses.replace(suite, runner=Runner()))
