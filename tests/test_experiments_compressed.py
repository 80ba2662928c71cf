"""The error-feedback baselines in the experiment layer: their [method] sections, the scaled_sign coder, and
that each builds through an ExperimentConfig with its paper defaults, and one runs a round."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from experiments.algorithms import build_algorithm
from experiments.coders import CODERS, ScaledSignCoderConfig
from experiments.config import ExperimentConfig, default_config
from experiments.methods import (
    CSERConfig,
    DoubleSqueezeConfig,
    LIECConfig,
    M3Config,
    MemSGDConfig,
    NeolithicConfig,
    parse_algorithm,
)
from sidejax.fl import Algorithm, build_round_step
from sidejax.keys import round_key

BASELINES = {"memsgd": MemSGDConfig, "doublesqueeze": DoubleSqueezeConfig, "neolithic": NeolithicConfig}
BASELINES["cser"] = CSERConfig
BASELINES["liec"] = LIECConfig


@pytest.mark.parametrize("method", sorted(BASELINES))
def test_each_baseline_builds_from_an_experiment_config(method, small_model):
    _, params, loss = small_model
    config = default_config(**{"method.name": method})
    # the paper's settings, the scaled sign by default
    assert isinstance(config.method, BASELINES[method]) and config.coder == ScaledSignCoderConfig()
    assert config.algorithm == f"{method}+scaled_sign"
    assert parse_algorithm(config.algorithm) == (method, "scaled_sign")
    m = config.method
    paper = ("adam", 3e-4, 3, 128, 0.1)
    assert (m.client_optimizer, m.client_lr, m.local_epochs, m.batch_size, m.server_lr) == paper
    algo = build_algorithm(config, loss)
    assert isinstance(algo, Algorithm) and algo.clients_per_round == 10
    state = algo.init(jax.random.key(0), params, 10)
    assert state.clients.error.shape == (10, sum(x.size for x in jax.tree.leaves(params)))


def test_a_configured_baseline_runs_a_round(small_model, digits_fed):
    """Neolithic from its section (compress_rounds 3, one local step): real messages of the expected lengths
    (the algorithms themselves are tested in tests/algorithms/test_compressed.py)."""
    _, params, loss = small_model
    overrides = {"method.local_steps": 1, "method.batch_size": 16, "method.compress_rounds": 3}
    algo = build_algorithm(default_config("neolithic+scaled_sign", **overrides), loss)
    state = algo.init(jax.random.key(0), params, 10)
    step = jax.jit(build_round_step(algo, client_map="map"))
    _, info = step(round_key(jax.random.key(1), 0), state, digits_fed)
    d = sum(x.size for x in jax.tree.leaves(params))
    np.testing.assert_array_equal(info.uplink_bits, 3 * (d + 32))
    np.testing.assert_array_equal(info.downlink_bits, 3 * (d + 32))
    np.testing.assert_array_equal(info.uplink_errors, 0)
    assert np.all(info.clients.valid) and np.all(info.clients.finite)


def test_fields_coders_and_checks():
    assert CODERS["scaled_sign"] is ScaledSignCoderConfig
    for method in BASELINES:
        assert BASELINES[method].coders == ("scaled_sign", "float32")
        assert isinstance(default_config(f"{method}+float32").coder, CODERS["float32"])
    neo = default_config("neolithic+scaled_sign", **{"method.compress_rounds": 3})
    assert neo.method.compress_rounds == 3
    assert default_config("cser+scaled_sign", **{"method.period": 7}).method.period == 7
    with pytest.raises(ValueError, match="compress_rounds must be >= 1"):
        default_config("neolithic+scaled_sign", **{"method.compress_rounds": 0})
    with pytest.raises(ValueError, match="period must be >= 1"):
        default_config("cser+scaled_sign", **{"method.period": 0})
    with pytest.raises(ValueError, match="server_lr must be > 0"):
        default_config("memsgd+scaled_sign", **{"method.server_lr": 0.0})
    with pytest.raises(ValueError, match=r"unknown algorithm 'memsgd\+klms'.*memsgd\+scaled_sign"):
        default_config("memsgd+klms")
    with pytest.raises(ValueError, match="does not take coder 'klms'"):
        default_config(**{"method.name": "memsgd", "coder.name": "klms"})
    with pytest.raises(ValueError, match="period|has no key|not a field"):
        default_config("memsgd+scaled_sign", **{"method.period": 3})


def test_m3_builds_with_topk_floor_d_over_n(small_model):
    """M3's section: the paper's settings with server lr 0.02, TopK with K = floor(d/n) from the number of
    clients (the coder's divisor unset), or a divisor of its own."""
    _, params, loss = small_model
    config = default_config(**{"method.name": "m3"})
    assert isinstance(config.method, M3Config) and config.coder == CODERS["topk"]()
    assert config.algorithm == "m3+topk" and parse_algorithm("m3+topk") == ("m3", "topk")
    m = config.method
    assert (m.client_optimizer, m.client_lr, m.local_epochs, m.batch_size, m.server_lr) == (
        "adam",
        3e-4,
        3,
        128,
        0.02,
    )
    assert (m.momentum, m.sync_probability) == (0.1, None)
    d = sum(x.size for x in jax.tree.leaves(params))
    for divisor, k in ((None, d // 10), (4, d // 4)):
        algo = build_algorithm(default_config("m3+topk", **{"coder.divisor": divisor}), loss)
        coder = algo.client_update.args[0].coder
        assert coder.fixed_bits(d) == k * (32 + (d - 1).bit_length())
        assert algo.client_update.args[0].sync_probability == 0.1  # 1/n
    for field in ("momentum", "sync_probability"):
        with pytest.raises(ValueError, match=f"{field} must be in \\(0, 1\\]"):
            default_config("m3+topk", **{f"method.{field}": 1.5})
    with pytest.raises(ValueError, match="divisor must be >= 1"):
        default_config("m3+topk", **{"coder.divisor": 0})


@pytest.mark.parametrize("method", ["doublesqueeze", "neolithic", "liec", "m3"])
def test_compressed_downlink_needs_full_participation(method, small_model):
    config = default_config(**{"method.name": method, "data.participation": 0.5})
    assert isinstance(config, ExperimentConfig)
    with pytest.raises(ValueError, match=r"data\.participation = 1.*5 of 10"):
        build_algorithm(config, small_model[2])
    build_algorithm(default_config(**{"method.name": "memsgd", "data.participation": 0.5}), small_model[2])
