"""Low-noise evaluation of a finished FedPM / FedPM-KLMS run's final global mask.

The driver evaluates a FedPM model the way the reference code does: one sampled mask ``m ~ Bern(theta)``
per evaluation. On LeNet5/Fashion-MNIST that single sample moves the test accuracy by 1-2 points from one
evaluation to the next, which is as large as the differences one wants to compare. This command loads a
run's final checkpoint and evaluates the final ``theta`` with many independent mask samples (their mean
and standard error), and with the deterministic threshold mask ``theta > 0.5`` (FedPM's ``pruned_ths``).

Example::

    python -m experiments.mask_eval results/klms_fmnist/klms_fmnist_fedpm \
        results/klms_fmnist/klms_fmnist_fedpm_klms

Writes ``mask_eval.json`` into each run folder and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.checkpoint import checkpoint_exists, load_checkpoint
from experiments.driver import prepare, run_config
from sidejax.algorithms import masked_network
from sidejax.fl import build_evaluator
from sidejax.keys import draw_key, run_keys
from sidejax.models import init_params

__all__ = ["evaluate_final_mask", "main"]


def evaluate_final_mask(run_dir: Path, num_samples: int = 32, seed: int = 12345) -> dict:
    """Final-round accuracy of a FedPM-family run over ``num_samples`` fresh masks, and with the threshold."""
    path = run_dir / "config.json"
    config = run_config(json.loads(path.read_text()), source=str(path))
    if config.method.name != "fedpm":
        raise ValueError(f"{run_dir}: algorithm {config.algorithm!r} has no probability mask")
    if not checkpoint_exists(run_dir / "checkpoint"):
        raise FileNotFoundError(f"{run_dir}: no checkpoint; run the experiment first")
    algorithm, spec, fed, (x_test, y_test), _ = prepare(config)
    init_key, _ = run_keys(config.run.seed)
    state = algorithm.init(init_key, init_params(init_key, spec), int(fed.num_examples.shape[0]))
    state, meta = load_checkpoint(run_dir / "checkpoint", state)
    server = state.server
    evaluate = build_evaluator(spec.module.apply, batch_size=config.run.eval_batch_size)

    @jax.jit
    def accuracy(mask):
        return evaluate(masked_network(server.weights, mask), x_test, y_test).accuracy

    keys = [draw_key(jax.random.key(seed), j) for j in range(num_samples)]
    sampled = np.array(
        [
            float(accuracy((jax.random.uniform(k, server.theta.shape) < server.theta).astype(jnp.float32)))
            for k in keys
        ]
    )
    threshold = float(accuracy((server.theta > 0.5).astype(jnp.float32)))
    result = {
        "round": int(meta["round_index"]),
        "num_samples": num_samples,
        "sampled_mean": float(sampled.mean()),
        "sampled_std": float(sampled.std(ddof=1)),
        "sampled_se": float(sampled.std(ddof=1) / math.sqrt(num_samples)),
        "threshold": threshold,
    }
    (run_dir / "mask_eval.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.mask_eval", description=__doc__.split("\n")[0]
    )
    parser.add_argument("runs", nargs="+", type=Path, help="FedPM / FedPM-KLMS run folders")
    parser.add_argument("--samples", type=int, default=32, help="independent mask samples (default 32)")
    args = parser.parse_args(argv)
    if args.samples < 2:
        parser.error("--samples must be >= 2")
    print("| run | round | sampled masks: mean acc (%) | std | s.e. | threshold mask acc (%) |")
    print("|---|---|---|---|---|---|")
    for run in args.runs:
        r = evaluate_final_mask(run, args.samples)
        print(
            f"| {run.name} | {r['round']} | {100 * r['sampled_mean']:.2f} | {100 * r['sampled_std']:.2f} | "
            f"{100 * r['sampled_se']:.2f} | {100 * r['threshold']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
