"""The accuracy plots of a results folder (:data:`PLOT_FILES`), and of several runs side by side (the suites'
tables): test accuracy against round, total bits and uplink bits, from the metrics rows
(:mod:`experiments.driver_records`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["PLOT_FILES", "accuracy_figures", "plot_runs"]

PLOT_FILES = ("accuracy_vs_round.png", "accuracy_vs_bits.png", "accuracy_vs_uplink_bits.png")


_PLOTS = (  # (x column, file, title, x label, log x)
    ("round", "accuracy_vs_round.png", "Test accuracy by round", "round", False),
    (
        "cumulative_bits",
        "accuracy_vs_bits.png",
        "Test accuracy vs total bits (uplink + downlink)",
        "cumulative bits communicated, uplink + downlink (log scale)",
        True,
    ),
    (
        "cumulative_uplink_bits",
        "accuracy_vs_uplink_bits.png",
        "Test accuracy vs uplink bits (clients to server)",
        "cumulative uplink bits, all clients (log scale)",
        True,
    ),
)


def _with_uplink_cumsum(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ``cumulative_uplink_bits`` (computed from ``uplink_bits`` for folders written before it)."""
    if all("cumulative_uplink_bits" in r for r in rows):
        return rows
    total, out = 0.0, []
    for r in rows:
        total += r["uplink_bits"]
        out.append({**r, "cumulative_uplink_bits": total})
    return out


def accuracy_figures(runs: dict[str, list[dict[str, Any]]], *, title: str | None = None) -> dict[str, Any]:
    """The accuracy plots of one or several labelled runs, as matplotlib figures keyed by file name.

    ``accuracy_vs_uplink_bits.png`` is the one that shows what compression buys: the total-bits plot is
    dominated by the 32-bit downlink broadcast, which every method here pays alike. Rounds are integer ticks;
    the legend sits below the axes, so it never covers a curve. ``title`` (e.g. the dataset and model) is
    added under each plot's title.
    """
    # matplotlib.figure.Figure, not pyplot: no global backend switch (a notebook's inline plots keep working
    # after a run), no figure manager to close; Jupyter displays a Figure like a pyplot one
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figures = {}
    for xkey, fname, heading, xlabel, logx in _PLOTS:
        fig = Figure(figsize=(6.4, 4.2), dpi=120)
        ax = fig.subplots()
        for label, rows in runs.items():
            rows = _with_uplink_cumsum(rows)
            pts = [(r[xkey], r["test_accuracy"]) for r in rows if r.get("test_accuracy") is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, [100 * v for v in ys], marker="o", ms=3, label=label)
        ax.set_title(f"{heading}\n{title}" if title else heading, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        if logx:
            ax.set_xscale("log")
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(
                fontsize=8,
                loc="upper center",
                bbox_to_anchor=(0.5, -0.16),
                ncol=min(2, len(runs)),
                frameon=False,
            )
        figures[fname] = fig
    return figures


def plot_runs(
    runs: dict[str, list[dict[str, Any]]], out_dir: Path, *, title: str | None = None
) -> list[Path]:
    """Writes :func:`accuracy_figures` (the files :data:`PLOT_FILES`) to ``out_dir``; returns their paths."""
    paths = []
    for fname, fig in accuracy_figures(runs, title=title).items():
        path = Path(out_dir) / fname
        fig.savefig(path, bbox_inches="tight")
        paths.append(path)
    return paths
