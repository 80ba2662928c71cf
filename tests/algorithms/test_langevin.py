"""QLSD and SGLD-KLMS (sidejax.algorithms.langevin; docs/papers/klms.md#s4-6, docs/papers/klms.md#s7-17)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from helpers import assert_clean_run

from sidejax.algorithms import qlsd, sgld, sgld_klms_sigma
from sidejax.coding import float32_coder


def test_sgld_klms_noise_calibration():
    """With exact samples from q, the aggregate step noise has variance 2*gamma
    (docs/papers/klms.md#s7-17)."""
    gamma, N, C = 1e-4, 50, 10
    sigma = sgld_klms_sigma(gamma, N, C)
    a = N / C
    n = 20000
    y = sigma * jax.random.normal(jax.random.key(0), (n, C))  # y_c - H_c
    noise = np.asarray(gamma * a * y.sum(1), np.float64)
    var = noise.var()
    # chi-square CI: relative SE of a variance estimate is sqrt(2/n)
    assert abs(var / (2 * gamma) - 1) < 5 * math.sqrt(2 / n)


def test_qlsd_and_sgld_klms_run_clean(algorithm_run):
    for name in ("qlsd", "sgld_klms"):
        _, _, _, infos = algorithm_run(name)
        assert_clean_run(name, infos)


def test_langevin_rejects_a_mismatched_federation(small_model):
    _, params, loss = small_model
    for algo in (
        qlsd(loss, num_clients=7, clients_per_round=3),
        sgld(loss, num_clients=7, clients_per_round=3, coder=float32_coder()),
    ):
        with pytest.raises(ValueError, match="num_clients=7"):
            algo.init(jax.random.key(0), params, 10)
