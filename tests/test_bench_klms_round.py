"""experiments.bench.klms_round on the demo's FedPM-KLMS preset (digits, MLP): wall and CPU time of the round
and of the coder, before and after, and the machine, threads and load the JSON records."""

from __future__ import annotations

import json

import pytest
from test_bench_common import check_run_record


@pytest.mark.slow  # a benchmark script end to end (two round programs and two coders compiled)
def test_klms_round_bench_on_the_demo_preset(tmp_path, capsys):
    from experiments.bench import klms_round

    out = tmp_path / "bench.json"
    argv = ["--preset", "demo_digits_fedpm_klms", "--warmup-rounds", "1", "--repeats", "1", "--out", str(out)]
    report = klms_round.main(argv)
    assert f"wrote {out}" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    check_run_record(saved["machine"])
    for case in saved["cases"].values():
        assert case["same_messages_before_and_after"]
        for clock in ("wall", "cpu"):
            for name in ("before", "after"):
                assert all(t > 0 for t in case[clock]["seconds"][name].values())
