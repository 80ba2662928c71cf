"""BICompFL experiments: the paper's settings as presets, and its table and plot from finished runs.

Examples::

    # the reduced CPU setting (Fashion-MNIST, LeNet5, 10 iid clients): run every method, then tabulate
    python -m experiments.bicompfl table results/bicompfl_fmnist --setting fmnist_lenet5_cpu
    # the same with fewer rounds (a quick look), or only some methods
    python -m experiments.bicompfl table results/quick --setting fmnist_lenet5_cpu --rounds 5 \
        --only gr_fixed fedavg
    # just tabulate the run folders under a directory
    python -m experiments.bicompfl table results/bicompfl_fmnist
    # rewrite the shipped presets from the definitions below (a test checks they are up to date)
    python -m experiments.bicompfl presets

A **setting** is a dataset, model and federation (:data:`SETTINGS`: the paper's MNIST LeNet5 i.i.d.,
MNIST and Fashion-MNIST 4CNN i.i.d. and Dirichlet 0.1, CIFAR-10 6CNN, which run unchanged on a GPU, and the
reduced CPU settings on Fashion-MNIST); a **variant** is a method of the paper's tables (:data:`VARIANTS`:
FedAvg, the bi-directionally compressed baselines and the six BICompFL rows). Preset
``bicompfl_<setting>_<variant>`` is their combination.

The table has the paper's columns (docs/papers/bicompfl.md#s5), from the messages the runs sent:

- ``acc``: the best test accuracy over the evaluations (the paper's "maximum test accuracy over rounds");
  ``last-5 acc``: the mean of the last five evaluations, beside it;
- ``bpp``: uplink + downlink bits per parameter per client per round, averaged over rounds;
- ``bpp (BC)``: the same on a broadcast channel (a message every client hears is sent once):
  ``uplink + downlink / n`` for one shared downlink message (FedAvg, the baselines, GR-Reconst), the
  relay of all ``n`` streams once for GR, and ``bpp`` for PR's per-client messages. The paper counts GR's
  broadcast as ``(n - 1)`` streams over ``n`` clients (0.059 at 1/32 bit per sample); sent once to
  everybody it is ``n`` streams (0.0625), which is what is measured here;
- ``uplink``, ``downlink``: the two directions.

The plot ``accuracy_vs_total_bpp.png`` shows test accuracy against the cumulative total bits per parameter
per client (the sum over rounds of ``bpp``), log scale, one line per method.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from experiments.config import PRESET_DIR, ExperimentConfig, default_config, load_preset, preset_toml
from experiments.table import read_run_folders, suite_main

__all__ = ["SETTINGS", "VARIANTS", "suite_config", "preset_name", "write_presets", "variant_label", "main"]

# --------------------------------------------------------------------------------------------------
# settings: dataset, model, federation, rounds (docs/papers/bicompfl.md#s4-1)

_PAPER_RUN = {
    "run.rounds": 200,
    "run.eval_every": 5,
    "run.eval_batch_size": 2000,
    "run.client_strategy": "auto",
}
_IID = {"data.num_clients": 10, "data.participation": 1.0, "data.partition": "iid"}
_DIR = {"data.num_clients": 10, "data.participation": 1.0, "data.partition": "dirichlet", "data.alpha": 0.1}

#: setting -> (description, dotted overrides of [run] and [data], IS block size b and log2 n_IS)
SETTINGS: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "mnist_lenet5_iid": (
        "paper Table 5: MNIST, LeNet5, 10 iid clients, 200 rounds",
        {**_PAPER_RUN, **_IID, "data.dataset": "mnist", "data.model": "lenet5"},
        256,
        8,
    ),
    "mnist_conv4_iid": (
        "paper Table 7: MNIST, 4CNN, 10 iid clients, 200 rounds",
        {**_PAPER_RUN, **_IID, "data.dataset": "mnist", "data.model": "conv4"},
        256,
        8,
    ),
    "mnist_conv4_dir01": (
        "paper Table 8: MNIST, 4CNN, 10 clients, Dirichlet(0.1) labels, 200 rounds",
        {**_PAPER_RUN, **_DIR, "data.dataset": "mnist", "data.model": "conv4"},
        256,
        8,
    ),
    "fmnist_conv4_iid": (
        "paper Fig. 1 / Table 9 (missing from the text): Fashion-MNIST, 4CNN, 10 iid clients, 200 rounds",
        {**_PAPER_RUN, **_IID, "data.dataset": "fashion_mnist", "data.model": "conv4"},
        256,
        8,
    ),
    "fmnist_conv4_dir01": (
        "paper Table 10: Fashion-MNIST, 4CNN, 10 clients, Dirichlet(0.1) labels, 200 rounds",
        {**_PAPER_RUN, **_DIR, "data.dataset": "fashion_mnist", "data.model": "conv4"},
        256,
        8,
    ),
    "cifar10_conv6_iid": (
        "paper Table 11: CIFAR-10, 6CNN, 10 iid clients, 400 rounds",
        {**_PAPER_RUN, **_IID, "run.rounds": 400, "data.dataset": "cifar10", "data.model": "conv6"},
        256,
        8,
    ),
    "fmnist_lenet5_cpu": (
        "reduced CPU setting: Fashion-MNIST, LeNet5, 10 iid clients, 20k training examples, 60 rounds of 1 "
        "local epoch; IS blocks of 128 with 16 candidates (the spec's CPU profile, 1/32 bit per sample)",
        {
            "run.rounds": 60,
            "run.eval_every": 5,
            "run.eval_batch_size": 2000,
            "run.client_strategy": "auto",
            **_IID,
            "data.dataset": "fashion_mnist",
            "data.model": "lenet5",
            "data.train_subset": 20000,
            "method.local_epochs": 1,
        },
        128,
        4,
    ),
    "fmnist_conv4_cpu": (
        "reduced CPU setting: Fashion-MNIST, 4CNN, 10 iid clients, 10k training examples, 30 rounds of 1 "
        "local epoch; IS blocks of 128 with 16 candidates",
        {
            "run.rounds": 30,
            "run.eval_every": 5,
            "run.eval_batch_size": 1000,
            "run.client_strategy": "auto",
            **_IID,
            "data.dataset": "fashion_mnist",
            "data.model": "conv4",
            "data.train_subset": 10000,
            "method.local_epochs": 1,
        },
        128,
        4,
    ),
}

# --------------------------------------------------------------------------------------------------
# variants: the rows of the paper's tables


def _fixed(b: int, log2k: int) -> dict[str, Any]:
    return {"coder.adaptive": False, "coder.block_size": b, "coder.log2_num_candidates": log2k}


def _downlink(b: int, log2k: int) -> dict[str, Any]:
    return {"method.downlink_block_size": b, "method.downlink_num_candidates": 2**log2k}


# the non-stochastic baselines: Adam, local lr 3e-4, server lr 0.1 (docs/papers/bicompfl.md#s4-1 [P])
_DENSE = {"method.client_optimizer": "adam", "method.client_lr": 3e-4, "method.batch_size": 128}

#: variant -> (table label, method+coder, overrides given the setting's (b, log2 n_IS))
VARIANTS: dict[str, tuple[str, str, Any]] = {
    "fedavg": (
        "FedAvg",
        "fedavg",
        lambda b, k: {**_DENSE, "method.server_optimizer": "sgd", "method.server_lr": 0.1},
    ),
    # the same local training with plain averaging (server step 1): FedAvg as most readers know it, beside
    # the paper's server lr 0.1, which makes it slow at a small number of rounds
    "fedavg_avg": ("FedAvg (server lr 1)", "fedavg", lambda b, k: {**_DENSE}),
    "doublesqueeze": (
        "DoubleSqueeze",
        "doublesqueeze+scaled_sign",
        lambda b, k: {**_DENSE, "method.server_lr": 0.1},
    ),
    "memsgd": ("MemSGD", "memsgd+scaled_sign", lambda b, k: {**_DENSE, "method.server_lr": 0.1}),
    "neolithic": ("Neolithic", "neolithic+scaled_sign", lambda b, k: {**_DENSE, "method.server_lr": 0.1}),
    "cser": (
        "CSER",
        "cser+scaled_sign",
        lambda b, k: {**_DENSE, "method.server_lr": 0.1, "method.period": 50},
    ),
    "gr_adaptive": (
        "GR-Adaptive",
        "bicompfl_gr+klms",
        lambda b, k: {
            "coder.adaptive": True,
            "coder.log2_num_candidates": k,
            "coder.block_size": b,
            "coder.max_block_size": 2048,
        },
    ),
    "gr_adaptive_avg": (
        "GR-Adaptive-Avg",
        "bicompfl_gr+klms_avg",
        lambda b, k: {"coder.log2_num_candidates": k, "coder.block_size": b, "coder.max_block_size": 2048},
    ),
    "gr_fixed": ("GR-Fixed", "bicompfl_gr+klms", lambda b, k: _fixed(b, k)),
    "gr_reconst_fixed": (
        "GR-Reconst-Fixed",
        "bicompfl_gr_reconst+klms",
        lambda b, k: {**_fixed(b, k), **_downlink(b, k)},
    ),
    "pr_fixed": ("PR-Fixed", "bicompfl_pr+klms", lambda b, k: {**_fixed(b, k), **_downlink(b, k)}),
    "pr_fixed_splitdl": (
        "PR-Fixed-SplitDL",
        "bicompfl_pr+klms",
        lambda b, k: {**_fixed(b, k), **_downlink(b, k), "method.split_downlink": True},
    ),
}


def preset_name(setting: str, variant: str) -> str:
    return f"bicompfl_{setting}_{variant}"


def suite_config(setting: str, variant: str) -> ExperimentConfig:
    """The configuration of ``variant`` in ``setting`` (preset ``bicompfl_<setting>_<variant>``)."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; settings: {', '.join(SETTINGS)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; variants: {', '.join(VARIANTS)}")
    _, values, b, log2k = SETTINGS[setting]
    _, algorithm, extra = VARIANTS[variant]
    values = dict(values)
    if not algorithm.startswith("bicompfl") and "method.local_epochs" not in values:
        values["method.local_epochs"] = 3  # every method: L = 3 local epochs [P]
    return default_config(algorithm).override(
        {**values, **extra(b, log2k)}, source=preset_name(setting, variant)
    )


def write_presets(directory: Path = PRESET_DIR) -> list[Path]:
    """Writes every (setting, variant) preset as canonical TOML; returns the paths."""
    paths = []
    for setting, (description, _, _, _) in SETTINGS.items():
        for variant, (label, _, _) in VARIANTS.items():
            path = Path(directory) / f"{preset_name(setting, variant)}.toml"
            path.write_text(preset_toml(suite_config(setting, variant), f"BICompFL {label}; {description}"))
            paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------------
# the table and the plot


def variant_label(config: dict[str, Any]) -> str:
    """The table row of a run from its ``config.json``: the paper's method name."""
    method, coder = config["method"]["name"], config["coder"]["name"]
    if method == "bicompfl_gr":
        if coder == "klms_avg":
            return "GR-Adaptive-Avg"
        return "GR-Adaptive" if config["coder"].get("adaptive") else "GR-Fixed"
    if method == "bicompfl_gr_reconst":
        return "GR-Reconst-" + ("Adaptive" if config["coder"].get("adaptive") else "Fixed")
    if method == "bicompfl_pr":
        name = "PR-" + ("Adaptive" if config["coder"].get("adaptive") else "Fixed")
        return name + ("-SplitDL" if config["method"].get("split_downlink") else "")
    if method == "fedavg":
        return (
            "FedAvg" if config["method"].get("server_optimizer", "none") != "none" else "FedAvg (server lr 1)"
        )
    for label, algorithm, _ in VARIANTS.values():
        if algorithm.split("+")[0] == method:
            return label
    return f"{method}+{coder}"


_ORDER = [v[0] for v in VARIANTS.values()]
COLUMNS = ("method", "acc (%)", "last-5 acc (%)", "bpp", "bpp (BC)", "uplink", "downlink", "rounds", "run")


def _mean(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def collect(directory: Path) -> list[dict[str, Any]]:
    """Every finished run folder under ``directory``: its label, config, summary and per-round rows (a damaged
    folder is skipped with a warning, :func:`experiments.table.read_run_folders`)."""
    runs = [
        {"name": sub.name, "label": variant_label(config), "config": config, "summary": summary, "rows": rows}
        for sub, config, summary, rows in read_run_folders(directory)
    ]
    runs.sort(key=lambda r: (_ORDER.index(r["label"]) if r["label"] in _ORDER else len(_ORDER), r["name"]))
    return runs


def table_rows(runs: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The paper's table (docs/papers/bicompfl.md#s5) from the runs' per-round logs."""

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    out = []
    for r in runs:
        rows, s = r["rows"], r["summary"]
        up, down = _mean(rows, "uplink_bpp"), _mean(rows, "downlink_bpp")
        out.append(
            {
                "method": r["label"],
                "acc (%)": f(None if s.get("best_accuracy") is None else 100 * s["best_accuracy"], ".2f"),
                "last-5 acc (%)": f(
                    None if s.get("tail_accuracy") is None else 100 * s["tail_accuracy"], ".2f"
                ),
                "bpp": f(None if up is None else up + down, ".4g"),
                "bpp (BC)": f(_mean(rows, "broadcast_bpp"), ".4g"),
                "uplink": f(up, ".4g"),
                "downlink": f(down, ".4g"),
                "rounds": str(s.get("rounds_run", len(rows))),
                "run": r["name"],
            }
        )
    return out


def plot(runs: list[dict[str, Any]], path: Path, *, title: str | None = None) -> Path:
    """Test accuracy against cumulative total bits per parameter per client (log x), one line per run
    (solid: BICompFL, dashed: the baselines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, r in enumerate(runs):
        total, xs, ys = 0.0, [], []
        for row in r["rows"]:
            total += row["uplink_bpp"] + row["downlink_bpp"]
            if row.get("test_accuracy") is not None:
                xs.append(total)
                ys.append(100 * row["test_accuracy"])
        if xs:
            ours = r["config"]["method"]["name"].startswith("bicompfl")  # solid: BICompFL; dashed: baselines
            style = "-" if ours else "--"
            ax.plot(xs, ys, style, marker=".", color=colors[(2 * i) % 20 + (i // 10) % 2], label=r["label"])
    ax.set_xscale("log")
    ax.set_xlabel("cumulative bits per parameter per client (uplink + downlink)")
    ax.set_ylabel("test accuracy (%)")
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    return suite_main(
        argv,
        module="bicompfl",
        description=__doc__.split("\n")[0],
        settings=SETTINGS,
        variants={name: v[0] for name, v in VARIANTS.items()},
        noun="variants",
        preset_name=preset_name,
        write_presets=write_presets,
        load=lambda name: load_preset(name),  # looked up at call time (tests replace it)
        collect=collect,
        table_rows=table_rows,
        columns=COLUMNS,
        plot=plot,
        figure_name="accuracy_vs_total_bpp.png",
    )


if __name__ == "__main__":
    sys.exit(main())
