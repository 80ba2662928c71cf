"""``make demo``: a short federated comparison on the bundled digits dataset (no download, < 3 min on 2 CPUs):
FedAvg (32 bits per parameter), FedPM (about 1 bit per parameter) and FedPM-KLMS (a few hundredths).

Runs each preset in :data:`DEMO_PRESETS` into ``results/demo/<preset>/`` (replacing an earlier demo there;
an ``--output`` folder that holds anything a demo does not write is refused, so nothing else is replaced)
and writes side-by-side plots (``results/demo/accuracy_vs_round.png``, ``accuracy_vs_bits.png`` and
``accuracy_vs_uplink_bits.png``, where the uplink saving shows) and a summary table
(``results/demo/summary.md``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.config import load_preset
from experiments.driver import PLOT_FILES, plot_runs, run_experiment

DEMO_PRESETS = {
    "FedAvg, iid, full participation": "demo_digits_fedavg",
    "FedAvg, label shards (c_max=2), 50% participation": "demo_digits_fedavg_noniid",
    "FedPM, iid": "demo_digits_fedpm",
    "FedPM-KLMS, iid": "demo_digits_fedpm_klms",
}


def check_demo_output(out: Path) -> None:
    """Refuses (``SystemExit`` with the reason) an ``out`` that is not a folder, or that holds anything but
    what a demo writes: its plots, ``summary.md`` and one run folder per preset (each with its
    ``config.json``, or empty). An earlier demo there is replaced; nothing else is."""
    if not out.exists():
        return
    if not out.is_dir():
        raise SystemExit(f"--output {out} is a file, not a folder: choose another --output")
    own = {*PLOT_FILES, "summary.md", *DEMO_PRESETS.values()}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in own)
    for preset in DEMO_PRESETS.values():
        run = out / preset
        if run.exists() and (
            not run.is_dir() or (any(run.iterdir()) and not (run / "config.json").is_file())
        ):
            foreign.append(f"{preset}/ (not a run folder)")
    if foreign:
        raise SystemExit(
            f"--output {out} holds {', '.join(foreign[:5])}, which a demo did not write; the demo replaces "
            "only an earlier demo: choose another --output or an empty folder"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.demo", description=__doc__)
    parser.add_argument("--output", type=Path, default=Path("results/demo"))
    parser.add_argument("--rounds", type=int, default=None, help="override the presets' number of rounds")
    args = parser.parse_args(argv)
    check_demo_output(args.output)

    runs, lines = {}, []
    for label, preset in DEMO_PRESETS.items():
        config = load_preset(preset)
        if args.rounds:
            config = config.override({"run.rounds": args.rounds}, source="--rounds")
        print(f"\n=== {label}  (preset {preset})")
        try:
            summary = run_experiment(config, args.output / preset, label=label, overwrite=True)
        except KeyboardInterrupt:
            print("\ninterrupted: the demo starts its runs afresh; run it again to redo it", file=sys.stderr)
            return 130
        runs[label] = summary.metrics
        lines.append(
            f"| {label} | {100 * summary.final_accuracy:.2f} | {100 * summary.best_accuracy:.2f} | "
            f"{summary.mean_uplink_bpp:.4f} | {32 / summary.mean_uplink_bpp:.0f}x | "
            f"{summary.mean_downlink_bpp:.3f} | {summary.total_bits:.3e} |"
        )
    plot_runs(runs, args.output, title="digits / mlp_100, 10 clients")
    table = "\n".join(
        [
            "| run | final acc (%) | best acc (%) | uplink bpp | uplink vs 32-bit | downlink bpp "
            "| total bits |",
            "|---|---|---|---|---|---|---|",
            *lines,
        ]
    )
    (args.output / "summary.md").write_text(table + "\n")
    print("\n" + table)
    print("\nplots: " + ", ".join(str(args.output / name) for name in PLOT_FILES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
