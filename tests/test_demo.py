"""``make demo``'s folder rule (experiments/demo.py): it replaces an earlier demo and nothing else."""

from __future__ import annotations

import pytest

from experiments.demo import DEMO_PRESETS, check_demo_output
from experiments.driver_plots import PLOT_FILES


def _earlier_demo(out):
    for preset in DEMO_PRESETS.values():
        (out / preset).mkdir(parents=True)
        (out / preset / "config.json").write_text("{}")
    for name in (*PLOT_FILES, "summary.md"):
        (out / name).write_text("")


def test_an_earlier_demo_or_an_empty_or_new_folder_is_accepted(tmp_path):
    check_demo_output(tmp_path / "new")
    check_demo_output(tmp_path)
    _earlier_demo(tmp_path)
    check_demo_output(tmp_path)


def test_a_folder_holding_anything_else_is_refused_and_left_as_it_is(tmp_path):
    _earlier_demo(tmp_path)
    (tmp_path / "my_notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match=r"holds my_notes\.txt, which a demo did not write"):
        check_demo_output(tmp_path)
    assert (tmp_path / "my_notes.txt").read_text() == "keep me"


def test_a_preset_folder_that_is_not_a_run_is_refused(tmp_path):
    preset = next(iter(DEMO_PRESETS.values()))
    (tmp_path / preset).mkdir()
    (tmp_path / preset / "data.npz").write_text("")
    with pytest.raises(SystemExit, match=rf"{preset}/ \(not a run folder\)"):
        check_demo_output(tmp_path)
    file = tmp_path / "f"
    file.write_text("")
    with pytest.raises(SystemExit, match="is a file, not a folder"):
        check_demo_output(file)
