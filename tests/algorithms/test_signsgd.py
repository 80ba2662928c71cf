"""SignSGD, stochastic SignSGD and SignSGD-KLMS (sidejax.algorithms.signsgd;
docs/papers/klms.md#s4-5, docs/papers/klms.md#s7-15)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import klms_uplink_bits_per_coordinate

from sidejax.algorithms import stochastic_sign_probs
from sidejax.layout import flat_layout


def test_stochastic_sign_mean():
    layout = flat_layout({"a": jnp.zeros(5)})
    v = jnp.array([0.5, -0.2, 0.0, 1.0, -1.0])
    q = stochastic_sign_probs(v, layout, 2.0)
    n = 40000
    samples = q.sample(jax.random.key(0), (n,))
    expect = 2 * jax.nn.sigmoid(2.0 * v) - 1
    se = np.sqrt((1 - np.asarray(expect) ** 2) / n)
    assert np.all(np.abs(np.asarray(samples.mean(0) - expect)) <= 5 * se + 1e-9)
    assert np.all(np.sign(np.asarray(expect))[v != 0] == np.sign(np.asarray(v))[v != 0])


def test_signsgd_sends_one_bit_per_coordinate_and_klms_fewer(algorithm_run, small_model):
    d = flat_layout(small_model[1]).dim
    klms_uplink_bits_per_coordinate(algorithm_run, d, "signsgd")
    np.testing.assert_array_equal(algorithm_run("signsgd")[3].uplink_bits, float(d))  # the packed signs
