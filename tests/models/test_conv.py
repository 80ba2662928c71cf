"""sidejax.models.conv: the loop-friendly convolution against lax (forward value and both gradients, under
vmap and scan, other convolutions passed through, every CNN model built with it); the forward pass and both
gradients of its two paths (canonical custom-VJP convolution; banded matrix product for small stride-1
convolutions) against lax and a float64 oracle, which path each layer takes, and the canonical layout of
every convolution of a training loop (the input gradient included)."""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import abstract_params

from sidejax.models import conv as conv_module
from sidejax.models import get_model
from sidejax.models.conv import conv_general_dilated, no_banded_matmul

DN = ("NHWC", "HWIO", "NHWC")
EPS32 = float(np.finfo(np.float32).eps)


def float32_precision():
    """The float64-oracle bounds are float32 summation bounds: on a GPU, JAX's default precision lets float32
    convolutions and matrix products run in TF32 (10-bit mantissa products), so the oracle comparisons ask
    for float32 arithmetic; the CPU computes in float32 either way."""
    return jax.default_matmul_precision("float32")


# (name, batch, input H, W, C, kernel KH, KW, out channels, padding, stride, kernel dilation). Batch 2; the
# layers are the models' own (sidejax/models/cnn.py), plus plain SAME/VALID and a strided/dilated case.
CASES = [
    ("same_3x3", 2, (9, 10, 3), (3, 3), 4, "SAME", (1, 1), (1, 1)),
    ("valid_5x3", 2, (11, 9, 3), (5, 3), 2, "VALID", (1, 1), (1, 1)),
    ("lenet5_conv1", 2, (28, 28, 1), (5, 5), 6, ((2, 2), (2, 2)), (1, 1), (1, 1)),
    ("lenet5_conv2", 2, (14, 14, 6), (5, 5), 16, "VALID", (1, 1), (1, 1)),
    ("conv4_conv2", 2, (28, 28, 64), (3, 3), 64, ((1, 1), (1, 1)), (1, 1), (1, 1)),
    ("conv4_conv3", 2, (14, 14, 64), (3, 3), 128, ((1, 1), (1, 1)), (1, 1), (1, 1)),
    ("conv6_conv1", 2, (32, 32, 3), (3, 3), 64, ((1, 1), (1, 1)), (1, 1), (1, 1)),
    ("conv6_conv6", 2, (8, 8, 256), (3, 3), 256, ((1, 1), (1, 1)), (1, 1), (1, 1)),
    ("strided_dilated", 2, (12, 11, 3), (3, 3), 5, ((2, 1), (0, 3)), (2, 3), (2, 1)),
]


def _pads(hw, ks, strides, dilation, padding):
    if isinstance(padding, str):
        window = [(k - 1) * d + 1 for k, d in zip(ks, dilation, strict=True)]
        return [tuple(p) for p in jax.lax.padtype_to_pads(hw, window, strides, padding)]
    return [tuple(p) for p in padding]


def _oracle(x, k, dy, strides, dilation, pads):
    """float64 numpy: y = conv(x, k), dx = (dy/dx)^T dy and dk, each with its sum of |terms| (error scale)."""
    x, k, dy = (np.asarray(a, np.float64) for a in (x, k, dy))
    (ph, pw), (sh, sw), (dh, dw) = pads, strides, dilation
    kh, kw = k.shape[:2]
    xp = np.pad(x, ((0, 0), ph, pw, (0, 0)))
    ho, wo = dy.shape[1:3]
    y, y_abs = np.zeros(dy.shape), np.zeros(dy.shape)
    dxp, dxp_abs = np.zeros(xp.shape), np.zeros(xp.shape)
    dk, dk_abs = np.zeros(k.shape), np.zeros(k.shape)
    for a in range(kh):
        for b in range(kw):
            rows = slice(a * dh, a * dh + sh * (ho - 1) + 1, sh)
            cols = slice(b * dw, b * dw + sw * (wo - 1) + 1, sw)
            win = xp[:, rows, cols, :]  # [N, Ho, Wo, I]
            y += np.einsum("nhwi,io->nhwo", win, k[a, b])
            y_abs += np.einsum("nhwi,io->nhwo", np.abs(win), np.abs(k[a, b]))
            dxp[:, rows, cols, :] += np.einsum("nhwo,io->nhwi", dy, k[a, b])
            dxp_abs[:, rows, cols, :] += np.einsum("nhwo,io->nhwi", np.abs(dy), np.abs(k[a, b]))
            dk[a, b] = np.einsum("nhwi,nhwo->io", win, dy)
            dk_abs[a, b] = np.einsum("nhwi,nhwo->io", np.abs(win), np.abs(dy))
    crop = (slice(None), slice(ph[0], ph[0] + x.shape[1]), slice(pw[0], pw[0] + x.shape[2]), slice(None))
    return y, y_abs, dxp[crop], dxp_abs[crop], dk, dk_abs


def _assert_within_summation_bound(got, exact, abs_sum, terms, what):
    """|got - exact| <= terms * eps32 * sum|terms|: the classic bound on a float32 sum of `terms` products in
    any order (gamma_n ~ n * eps), so it holds for every summation order XLA may choose, and is far below
    any real error (a wrong sign, index or padding moves entries by O(sum|terms| / terms))."""
    err = np.abs(np.asarray(got, np.float64) - exact)
    bound = terms * EPS32 * abs_sum
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"{what}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


def _case(n, xshape, ks, cout, padding, strides, dilation):
    kx, kk, kd = jax.random.split(jax.random.key(11), 3)
    x = jax.random.normal(kx, (n, *xshape))
    k = jax.random.normal(kk, (*ks, xshape[2], cout)) / np.sqrt(ks[0] * ks[1] * xshape[2])
    pads = _pads(xshape[:2], ks, strides, dilation, padding)
    ho = jax.eval_shape(lambda: jax.lax.conv_general_dilated(x, k, strides, pads, rhs_dilation=dilation,
                                                             dimension_numbers=DN)).shape  # fmt: skip
    dy = jax.random.normal(kd, ho)

    def vjp(conv):
        def f(x, k, dy):
            y, pull = jax.vjp(lambda x, k: conv(x, k, strides, padding, rhs_dilation=dilation,
                                                dimension_numbers=DN), x, k)  # fmt: skip
            return (y, *pull(dy))

        return jax.jit(f)

    return x, k, dy, pads, vjp


def _check_against_oracle(x, k, dy, pads, strides, dilation, y, dx, dk):
    n, _, _, cin = x.shape
    kh, kw, _, cout = k.shape
    y64, y_abs, dx64, dx_abs, dk64, dk_abs = _oracle(x, k, dy, strides, dilation, pads)
    _assert_within_summation_bound(y, y64, y_abs, kh * kw * cin, "y")
    _assert_within_summation_bound(dx, dx64, dx_abs, kh * kw * cout, "dx")
    _assert_within_summation_bound(dk, dk64, dk_abs, n * dy.shape[1] * dy.shape[2], "dk")


@pytest.mark.parametrize("name,n,xshape,ks,cout,padding,strides,dilation", CASES, ids=[c[0] for c in CASES])
def test_convolution_path_gradients_match_lax_and_float64_oracle(
    name, n, xshape, ks, cout, padding, strides, dilation
):
    """The convolution path (custom VJP; forced with no_banded_matmul): on CPU, dx equals jax.grad of the
    plain lax convolution to within 2 ULP (the same products summed in the same order, but a different
    compiled program, so not demanded bit-equal); on every backend y, dx and dk lie within the float32
    summation error bound of a float64 oracle, computed at float32 precision (float32_precision)."""
    x, k, dy, pads, vjp = _case(n, xshape, ks, cout, padding, strides, dilation)
    with float32_precision(), no_banded_matmul():
        y, dx, dk = vjp(conv_general_dilated)(x, k, dy)
    with float32_precision():
        y_ref, dx_ref, dk_ref = vjp(jax.lax.conv_general_dilated)(x, k, dy)
    if jax.default_backend() == "cpu":
        # Different compiled programs (custom VJP vs lax's transpose rule): tight ULP tolerance, not bit
        # equality. Only on CPU: elsewhere conv_general_dilated is lax's own, and each compilation may pick
        # another cuDNN algorithm (autotuned), summing in another order (6 cases failed 2 ULP on an H200).
        np.testing.assert_array_max_ulp(np.asarray(y), np.asarray(y_ref), maxulp=2)
        np.testing.assert_array_max_ulp(np.asarray(dx), np.asarray(dx_ref), maxulp=2)
    _check_against_oracle(x, k, dy, pads, strides, dilation, y, dx, dk)
    _check_against_oracle(x, k, dy, pads, strides, dilation, y_ref, dx_ref, dk_ref)  # the oracle itself


BANDED = ["same_3x3", "valid_5x3", "lenet5_conv1", "lenet5_conv2"]


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in BANDED], ids=BANDED)
def test_banded_matmul_path_matches_float64_oracle(case):
    """Small stride-1 convolutions (LeNet5's two among them) are one banded matrix product: y, dx and dk lie
    within the float32 summation error bound of a float64 oracle (the summation order is not lax's, so no ULP
    comparison with lax), and the path is really taken: no convolution in the compiled program."""
    name, n, xshape, ks, cout, padding, strides, dilation = case
    x, k, dy, pads, vjp = _case(n, xshape, ks, cout, padding, strides, dilation)
    assert conv_module._uses_banded_matmul(x.shape, k.shape, strides, tuple(pads), dilation)
    f = vjp(conv_general_dilated)
    with float32_precision():
        if jax.default_backend() == "cpu":
            assert " convolution(" not in f.lower(x, k, dy).compile().as_text()
        out = f(x, k, dy)
    _check_against_oracle(x, k, dy, pads, strides, dilation, *out)


def test_banded_matmul_only_for_small_stride1_convolutions():
    """Only small stride-1 convolutions with few output channels are banded (where it measured faster); the
    models' wider, larger or strided convolutions keep the convolution path."""
    uses = conv_module._uses_banded_matmul
    assert uses((32, 28, 28, 1), (5, 5, 1, 6), (1, 1), ((2, 2), (2, 2)), (1, 1))  # LeNet5 conv1: 26,880
    assert uses((32, 14, 14, 6), (5, 5, 6, 16), (1, 1), ((0, 0), (0, 0)), (1, 1))  # LeNet5 conv2: 67,200
    assert uses((32, 12, 12, 6), (5, 5, 6, 6), (1, 1), ((0, 0), (0, 0)), (1, 1))  # CEPAM conv2
    assert not uses((32, 28, 28, 1), (5, 5, 1, 20), (1, 1), ((0, 0), (0, 0)), (1, 1))  # KLMS LeNet conv1
    assert not uses((32, 28, 28, 1), (3, 3, 1, 32), (1, 1), ((0, 0), (0, 0)), (1, 1))  # BPC-FL conv1
    assert not uses((32, 28, 28, 1), (3, 3, 1, 64), (1, 1), ((1, 1), (1, 1)), (1, 1))  # Conv4 conv1
    assert not uses((32, 28, 28, 64), (3, 3, 64, 64), (1, 1), ((1, 1), (1, 1)), (1, 1))  # Conv4 conv2
    assert not uses((32, 32, 32, 3), (3, 3, 3, 64), (1, 1), ((1, 1), (1, 1)), (1, 1))  # Conv6 conv1
    assert not uses((32, 14, 14, 6), (5, 5, 6, 16), (2, 2), ((0, 0), (0, 0)), (1, 1))  # strided
    with no_banded_matmul():
        assert not uses((32, 28, 28, 1), (5, 5, 1, 6), (1, 1), ((2, 2), (2, 2)), (1, 1))


def _two_conv_net(conv):
    """LeNet5's convolutions (5x5 pad 2 to 6, then 5x5 VALID to 16) on 14x14 inputs, sum of squares."""

    def loss(params, x):
        h = jax.nn.relu(conv(x, params[0], (1, 1), ((2, 2), (2, 2)), dimension_numbers=DN))
        h = conv(h, params[1], (1, 1), "VALID", dimension_numbers=DN)
        return jnp.mean(h**2)

    return loss


def _scan_trainer(conv):
    loss = _two_conv_net(conv)

    def train(params, xs):
        def step(params, xb):
            g = jax.grad(loss)(params, xb)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), None

        return jax.lax.scan(step, params, xs)[0]

    return jax.jit(train)


def _params_and_data():
    k1, k2, kx = jax.random.split(jax.random.key(12), 3)
    params = (jax.random.normal(k1, (5, 5, 1, 6)) / 5, jax.random.normal(k2, (5, 5, 6, 16)) / 12)
    xs = jax.random.normal(kx, (3, 4, 14, 14, 1))  # [steps, batch, H, W, C]
    return params, xs


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the layout concern is XLA CPU's")
def test_every_convolution_of_a_training_scan_is_canonical():
    """In a lax.scan of SGD steps through two convolutions, the second one's input gradient is needed; all
    five compiled convolutions (2 forward, 2 kernel gradients, 1 input gradient) must be canonical
    NHWC/HWIO (``b01f_01io->b01f``). JAX's transpose rule gives the input gradient as a ``b01f_01oi``
    convolution, which XLA CPU leaves in place inside a while body, off the fast Eigen path (before the
    fix: ``b01f_01oi->b01f`` here, and LeNet5's local trainer 1.7x slower than a Python loop of jitted
    steps)."""
    params, xs = _params_and_data()
    with no_banded_matmul():  # these small convolutions would otherwise be banded matrix products
        hlo = _scan_trainer(conv_general_dilated).lower(params, xs).compile().as_text()
    labels = [
        line.split("dim_labels=")[1].split(",")[0] for line in hlo.splitlines() if " convolution(" in line
    ]
    assert len(labels) == 5 and all(lab == "b01f_01io->b01f" for lab in labels), labels


@pytest.mark.parametrize("banded", [True, False], ids=["banded", "convolution"])
def test_training_scan_matches_lax(banded):
    """Three SGD steps through both convolutions inside lax.scan (gradients flow through the second conv's
    input gradient into the first kernel), on either path, agree with plain lax: different programs, so a
    tolerance; per-op rounding differences (a few ULP) compound over steps, so 1e-5 of each kernel's scale."""
    params, xs = _params_and_data()
    with contextlib.nullcontext() if banded else no_banded_matmul():
        ours = _scan_trainer(conv_general_dilated)(params, xs)
    ref = _scan_trainer(jax.lax.conv_general_dilated)(params, xs)
    for a, b in zip(ours, ref, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.max(np.abs(b)))


# ---------------------------------------------------------------------------------------------------
# the loop-friendly convolution against lax

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
        with no_banded_matmul():  # this small convolution is otherwise a banded matmul (see below)
            hlo = train(conv_general_dilated).lower(k, x).compile().as_text()
        labels = [
            line.split("dim_labels=")[1].split(",")[0] for line in hlo.splitlines() if " convolution(" in line
        ]
        assert labels and all(lab.startswith("b01f_01io->b01f") for lab in labels), labels


def test_loop_friendly_conv_passes_other_convolutions_through():
    """Grouped or NCHW convolutions go to lax.conv_general_dilated unchanged."""
    x = jax.random.normal(jax.random.key(5), (2, 4, 7, 7))
    k = jax.random.normal(jax.random.key(6), (6, 2, 3, 3))
    args = ((1, 1), "SAME")
    kw = dict(dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=2)
    _close(conv_general_dilated(x, k, *args, **kw), jax.lax.conv_general_dilated(x, k, *args, **kw))


def test_models_use_the_loop_friendly_conv():
    """Every convolution layer of the CNN models is built with sidejax.models.conv.conv_general_dilated."""
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
