"""Slow real-data check: FedAvg on Fashion-MNIST (Debian's dataset-fashion-mnist, installed by .ci/run)."""

from __future__ import annotations

import pytest

from experiments.config import load_preset
from experiments.driver import run_experiment
from sidejax.data import dataset_available


@pytest.mark.slow
@pytest.mark.skipif(
    not dataset_available("fashion_mnist"),
    reason="Fashion-MNIST files not found (apt-get install dataset-fashion-mnist, or set SIDEJAX_DATA_DIR)",
)
def test_fedavg_lenet5_fashion_mnist_reaches_85_percent_within_10_rounds(tmp_path):
    config = load_preset("fedavg_fmnist_lenet5_iid").override({"run.stop_at_accuracy": 0.85})
    data, method = config.data, config.method
    assert (data.model, data.num_clients, data.partition, method.local_epochs) == ("lenet5", 10, "iid", 1)
    assert config.run.rounds == 10
    summary = run_experiment(config, tmp_path, progress=False, verbose=True)
    accs = [r["test_accuracy"] for r in summary.metrics]
    print("test accuracy per round:", accs)
    assert summary.best_accuracy >= 0.85, (
        f"best accuracy {summary.best_accuracy:.4f} after {summary.rounds_run} rounds"
    )
    assert summary.rounds_run <= 10
