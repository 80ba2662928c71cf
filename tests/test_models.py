"""Tests for sidejax.models: parameter counts, output shapes and the registry.

Parameter counts are taken from ``jax.eval_shape`` of the initialiser, so the
large models are never materialised; only the small models run a real forward
pass.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sidejax.models as models
from sidejax.models import (
    MLP,
    MODELS,
    BasicBlock,
    BatchStatNorm,
    ModelSpec,
    ResNet18,
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


def abstract_params(spec: ModelSpec):
    """Parameter shapes without allocating or compiling anything."""
    return jax.eval_shape(lambda k: init_params(k, spec), KEY)


def abstract_count(spec: ModelSpec) -> int:
    return count_params(abstract_params(spec))


# --------------------------------------------------------------------------- counts


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


@pytest.mark.parametrize("num_classes", [10, 100])
def test_resnet18_batch_and_group_norm_have_equal_counts(num_classes):
    counts = {}
    for norm in ("batch", "group"):
        spec = ModelSpec("resnet18", ResNet18(num_classes=num_classes, norm=norm), (32, 32, 3), None)
        counts[norm] = abstract_count(spec)
    assert counts["batch"] == counts["group"]
    assert counts["batch"] == {10: 11_173_962, 100: 11_220_132}[num_classes]


def test_resnet18_layer_table_and_bias_free_convs():
    params = abstract_params(get_model("resnet18"))
    assert count_params(params["conv1"]) + count_params(params["norm1"]) == 1_856
    stages = {s: sum(count_params(params[f"stage{s}_block{b}"]) for b in (1, 2)) for s in (1, 2, 3, 4)}
    assert stages == {1: 147_968, 2: 525_568, 3: 2_099_712, 4: 8_393_728}
    assert count_params(params["fc"]) == 5_130
    convs = [
        path
        for path, _ in jax.tree_util.tree_leaves_with_path(params)
        if "conv" in jax.tree_util.keystr(path)
    ]
    assert convs and all(jax.tree_util.keystr(p).endswith("['kernel']") for p in convs)
    assert "shortcut_conv" not in params["stage1_block1"]
    for s in (2, 3, 4):
        assert params[f"stage{s}_block1"]["shortcut_conv"]["kernel"].shape[:2] == (1, 1)


@pytest.mark.parametrize("name", sorted(set(DOCUMENTED_COUNTS) - {"4cnn", "6cnn"}))
def test_params_only_collection_and_abstract_output_shape(name):
    spec = get_model(name)
    x = jax.ShapeDtypeStruct((2, *spec.input_shape), jnp.float32)
    variables = jax.eval_shape(spec.module.init, KEY, x)
    assert set(variables) == {"params"}
    # apply without ``mutable``: the model is a pure function of params.
    out = jax.eval_shape(lambda v, x: spec.module.apply(v, x, train=True), variables, x)
    assert out.shape == (2, spec.module.num_classes)


# --------------------------------------------------------------------------- forward


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


# --------------------------------------------------------------------------- normalisation


def test_batch_stat_norm_uses_batch_statistics():
    x = 3.0 + 2.0 * jax.random.normal(jax.random.key(2), (4, 3, 3, 5))
    norm = BatchStatNorm()
    variables = norm.init(KEY, x)
    assert set(variables) == {"params"}
    assert {k: v.shape for k, v in variables["params"].items()} == {"scale": (5,), "bias": (5,)}
    y = norm.apply(variables, x)
    mean = x.mean(axis=(0, 1, 2))
    var = x.var(axis=(0, 1, 2))
    np.testing.assert_allclose(y, (x - mean) / jnp.sqrt(var + 1e-5), rtol=1e-5, atol=1e-5)
    # Same as flax BatchNorm in training mode (which would also need batch_stats).
    ref = nn.BatchNorm(use_running_average=False, epsilon=1e-5)
    ref_vars = ref.init(KEY, x)
    ref_y, _ = ref.apply(ref_vars, x, mutable=["batch_stats"])
    np.testing.assert_allclose(y, ref_y, rtol=1e-4, atol=1e-4)
    # Affine part.
    params = {"scale": jnp.full((5,), 2.0), "bias": jnp.arange(5.0)}
    np.testing.assert_allclose(
        norm.apply({"params": params}, x), 2.0 * y + jnp.arange(5.0), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("module", [lambda: ResNet18(norm="layer"), lambda: BasicBlock(64, norm="bn")])
def test_invalid_norm_raises(module):
    with pytest.raises(ValueError, match="norm"):
        module()


# --------------------------------------------------------------------------- registry


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


# --------------------------------------------------------------------------- loop-friendly convolution

# (input H, W, kernel, stride, kernel dilation, padding, in, out channels): SAME/VALID strings, PyTorch-style
# symmetric, asymmetric and negative (cropping) pads, 1x1 strided shortcut, stride > 1 with a leftover row
CONV_CASES = [
    ((9, 10), (3, 3), (1, 1), (1, 1), "SAME", 3, 4),
    ((10, 11), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1)), 2, 5),
    ((11, 9), (5, 3), (2, 1), (1, 1), "VALID", 3, 2),
    ((12, 12), (3, 3), (1, 1), (2, 2), ((2, 0), (1, 3)), 2, 3),
    ((8, 8), (1, 1), (2, 2), (1, 1), ((0, 0), (0, 0)), 4, 6),
    ((9, 9), (3, 3), (1, 2), (1, 1), ((-1, 2), (1, 0)), 2, 2),
]


def _conv_loss(conv, strides, dilation, padding):
    dn = ("NHWC", "HWIO", "NHWC")
    return lambda x, k: jnp.sum(
        jnp.sin(conv(x, k, strides, padding, rhs_dilation=dilation, dimension_numbers=dn))
    )


def _close(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.max(np.abs(b)))))


@pytest.mark.parametrize("hw,ks,strides,dilation,padding,cin,cout", CONV_CASES)
def test_loop_friendly_conv_gradients_match_lax(hw, ks, strides, dilation, padding, cin, cout):
    """Forward value and both gradients equal lax's (only the summation order of dK differs)."""
    from sidejax.models.conv import conv_general_dilated

    kx, kk = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (3, *hw, cin))
    k = jax.random.normal(kk, (*ks, cin, cout))
    ours = _conv_loss(conv_general_dilated, strides, dilation, padding)
    ref = _conv_loss(jax.lax.conv_general_dilated, strides, dilation, padding)
    _close(ours(x, k), ref(x, k))
    for a, b in zip(jax.grad(ours, (0, 1))(x, k), jax.grad(ref, (0, 1))(x, k), strict=True):
        _close(a, b)


def test_loop_friendly_conv_under_vmap_and_scan_and_canonical_in_loops():
    """Per-client gradients inside lax.scan (the local-training shape) match lax's, and on CPU the compiled
    loop body holds only canonical NHWC/HWIO convolutions (the non-canonical kernel-gradient conv is what
    runs on XLA CPU's slow generic path inside loops; jax-ml/jax#12868)."""
    from sidejax.models.conv import conv_general_dilated, no_banded_matmul

    kx, kk = jax.random.split(jax.random.key(4))
    x = jax.random.normal(kx, (2, 3, 2, 8, 8, 3))  # [clients, steps, batch, H, W, C]
    k = jax.random.normal(kk, (2, 3, 3, 3, 4))  # [clients, KH, KW, I, O]

    def train(conv):
        loss = _conv_loss(conv, (1, 1), (1, 1), ((1, 1), (1, 1)))

        def client(k, xs):
            def step(k, xb):
                return k - 0.01 * jax.grad(loss, 1)(xb, k), None

            return jax.lax.scan(step, k, xs)[0]

        return jax.jit(jax.vmap(client))

    _close(train(conv_general_dilated)(k, x), train(jax.lax.conv_general_dilated)(k, x))
    if jax.default_backend() == "cpu":
        with no_banded_matmul():  # this small convolution is otherwise a banded matmul (tests/test_conv.py)
            hlo = train(conv_general_dilated).lower(k, x).compile().as_text()
        labels = [
            line.split("dim_labels=")[1].split(",")[0] for line in hlo.splitlines() if " convolution(" in line
        ]
        assert labels and all(lab.startswith("b01f_01io->b01f") for lab in labels), labels


def test_loop_friendly_conv_passes_other_convolutions_through():
    """Grouped or NCHW convolutions go to lax.conv_general_dilated unchanged."""
    from sidejax.models.conv import conv_general_dilated

    x = jax.random.normal(jax.random.key(5), (2, 4, 7, 7))
    k = jax.random.normal(jax.random.key(6), (6, 2, 3, 3))
    args = ((1, 1), "SAME")
    kw = dict(dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=2)
    _close(conv_general_dilated(x, k, *args, **kw), jax.lax.conv_general_dilated(x, k, *args, **kw))


def test_models_use_the_loop_friendly_conv():
    """Every convolution layer of the CNN models is built with sidejax.models.conv.conv_general_dilated."""
    from sidejax.models.conv import conv_general_dilated

    seen = []
    orig = nn.Conv.__call__

    def spy(self, *a, **kw):
        seen.append(self.conv_general_dilated)
        return orig(self, *a, **kw)

    for name in ("lenet5", "conv6", "resnet18", "klms_lenet", "cepam_cnn", "bpcfl_convnet"):
        spec = get_model(name)
        seen.clear()
        try:
            nn.Conv.__call__ = spy
            abstract_params(spec)
        finally:
            nn.Conv.__call__ = orig
        assert seen and all(f is conv_general_dilated for f in seen), name
