"""ResNet18 (sidejax.models.resnet): parameter table, normalisations, BatchStatNorm."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import abstract_count, abstract_params

from sidejax.models import (
    BasicBlock,
    BatchStatNorm,
    ModelSpec,
    ResNet18,
    count_params,
    get_model,
)

KEY = jax.random.key(0)


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
