"""MLPs (sidejax.models.mlp): any input shape, activations, the linear model."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from helpers import abstract_count, abstract_params

from sidejax.models import (
    MLP,
    count_params,
    get_model,
)

KEY = jax.random.key(0)


def test_mlp_accepts_any_input_shape():
    spec = get_model("mlp_100", input_shape=(8, 8, 1))
    assert spec.input_shape == (8, 8, 1)
    assert spec.num_params is None
    assert abstract_count(spec) == 64 * 100 + 100 + 100 * 10 + 10
    out = jax.eval_shape(
        lambda p, x: spec.module.apply({"params": p}, x),
        abstract_params(spec),
        jax.ShapeDtypeStruct((3, 8, 8, 1), jnp.float32),
    )
    assert out.shape == (3, 10)


def test_mlp_custom_activation_and_linear_model():
    x = jnp.ones((2, 5))
    linear = MLP(features=(), num_classes=3)
    params = linear.init(KEY, x)["params"]
    assert count_params(params) == 5 * 3 + 3
    tanh_mlp = MLP(features=(4,), num_classes=2, activation=nn.tanh)
    params = tanh_mlp.init(KEY, x)["params"]
    hidden = jnp.tanh(x @ params["fc1"]["kernel"] + params["fc1"]["bias"])
    expected = hidden @ params["fc2"]["kernel"] + params["fc2"]["bias"]
    np.testing.assert_allclose(tanh_mlp.apply({"params": params}, x), expected, rtol=1e-6)
