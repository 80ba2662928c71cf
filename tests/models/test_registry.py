"""The model registry (sidejax.models.registry): documented parameter counts, specs, aliases, validation,
and a forward pass of every small model.

Parameter counts are taken from ``jax.eval_shape`` of the initialiser, so the large models are never
materialised; only the small models run a real forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import abstract_count, abstract_params

import sidejax.models as models
from sidejax.models import (
    MODELS,
    ModelSpec,
    count_params,
    get_model,
    init_params,
)

KEY = jax.random.key(0)


DOCUMENTED_COUNTS = {
    "lenet5": 61_706,
    "conv4": 1_933_258,
    "4cnn": 1_933_258,
    "conv6": 2_262_602,
    "6cnn": 2_262_602,
    "klms_lenet": 431_080,
    "resnet18": 11_173_962,
    "mlp_100": 79_510,
    "mlp_32_16": 25_818,
    "cepam_cnn": 6_422,
    "bpcfl_convnet": 1_206_590,
    "moons_mlp": 3_002,
    "regression_mlp": 16_897,
}


SMALL_MODELS = {
    "lenet5": 10,
    "klms_lenet": 10,
    "cepam_cnn": 10,
    "mlp_32_16": 10,
    "moons_mlp": 2,
    "regression_mlp": 1,
}


def test_registry_lists_every_documented_model():
    assert set(MODELS) == set(DOCUMENTED_COUNTS)
    assert len(MODELS) == len(set(MODELS))


@pytest.mark.parametrize("name", sorted(DOCUMENTED_COUNTS))
def test_documented_parameter_count(name):
    spec = get_model(name)
    assert spec.num_params == DOCUMENTED_COUNTS[name]
    assert abstract_count(spec) == DOCUMENTED_COUNTS[name]


@pytest.mark.parametrize(
    ("name", "num_classes", "expected"),
    [("conv4", 47, 1_942_767), ("resnet18", 100, 11_220_132), ("resnet18", 10, 11_173_962)],
)
def test_parameter_count_with_other_num_classes(name, num_classes, expected):
    assert abstract_count(get_model(name, num_classes=num_classes)) == expected


@pytest.mark.parametrize("name", sorted(set(DOCUMENTED_COUNTS) - {"4cnn", "6cnn"}))
def test_params_only_collection_and_abstract_output_shape(name):
    spec = get_model(name)
    x = jax.ShapeDtypeStruct((2, *spec.input_shape), jnp.float32)
    variables = jax.eval_shape(spec.module.init, KEY, x)
    assert set(variables) == {"params"}
    # apply without ``mutable``: the model is a pure function of params.
    out = jax.eval_shape(lambda v, x: spec.module.apply(v, x, train=True), variables, x)
    assert out.shape == (2, spec.module.num_classes)


@pytest.mark.parametrize("name", sorted(SMALL_MODELS))
def test_forward_pass_small_models(name):
    spec = get_model(name)
    # jit: one compilation each instead of many eagerly dispatched ops.
    params = jax.jit(init_params, static_argnums=1)(KEY, spec)
    assert count_params(params) == spec.num_params
    x = jax.random.normal(jax.random.key(1), (2, *spec.input_shape))
    out = jax.jit(spec.module.apply)({"params": params}, x)
    assert out.shape == (2, SMALL_MODELS[name])
    assert out.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(out)))


def test_get_model_returns_spec_with_defaults():
    spec = get_model("conv6")
    assert isinstance(spec, ModelSpec)
    assert spec.name == "conv6"
    assert spec.input_shape == (32, 32, 3)
    assert get_model("bpcfl_convnet").module.num_classes == 62
    assert get_model("moons_mlp").input_shape == (2,)
    assert get_model("regression_mlp").input_shape == (1,)
    assert get_model("resnet18").module.norm == "batch"


def test_aliases_resolve():
    assert get_model("4cnn").name == "conv4"
    assert get_model("6cnn").module == get_model("conv6").module


def test_num_params_is_none_when_overridden():
    assert get_model("conv4", num_classes=47).num_params is None
    assert get_model("lenet5", input_shape=(32, 32, 1)).num_params is None
    assert get_model("lenet5", num_classes=10, input_shape=(28, 28, 1)).num_params == 61_706


def test_unknown_model_lists_valid_names():
    with pytest.raises(ValueError, match="Unknown model") as info:
        get_model("vgg16")
    for name in MODELS:
        assert name in str(info.value)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_invalid_num_classes(bad):
    with pytest.raises(ValueError, match="num_classes"):
        get_model("lenet5", num_classes=bad)


@pytest.mark.parametrize("bad", [(), (28, 0, 1), 5])
def test_invalid_input_shape(bad):
    with pytest.raises(ValueError, match="input_shape"):
        get_model("mlp_100", input_shape=bad)


def test_count_params_concrete_and_abstract_agree():
    spec = get_model("cepam_cnn")
    concrete = jax.jit(init_params, static_argnums=1)(KEY, spec)
    assert count_params(concrete) == count_params(abstract_params(spec)) == 6_422
    assert count_params({}) == 0


def test_public_api():
    for name in models.__all__:
        assert hasattr(models, name), name
