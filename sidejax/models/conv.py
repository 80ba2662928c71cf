"""A 2-D convolution whose gradients stay fast inside loops on the XLA CPU backend.

Why: every federated round trains clients with ``lax.scan`` over minibatch steps, so the backward pass of
each convolution runs inside an XLA ``while`` body. On the CPU backend the two convolutions that JAX's
transpose rules emit are non-canonical: the kernel gradient ``dim_labels=f01b_i01o->01bf`` (the batch is the
contracted dimension) and the input gradient ``b01f_01oi->b01f`` (the reversed kernel read with input and
output features swapped). XLA CPU rewrites both into the canonical NHWC/HWIO form, which runs on the fast
Eigen path, only outside loops; inside a loop body they are left as they are and run on a generic emitted
loop (upstream: jax-ml/jax#12868, "Convolution is significantly slower inside a loop body (CPU)"). Measured
here (jax 0.10.2, 2 shared CPU cores): Conv6, two SGD steps of batch 32 inside ``lax.scan``, 39.5 s with
``flax.linen.Conv``'s default and 1.9 s with the canonical kernel gradient; LeNet5 local training (batch 32),
where only the second convolution needs an input gradient, 1.6-1.7x faster again with the canonical input
gradient (``experiments/bench/local_training.py`` measures both in one run).

What: :func:`conv_general_dilated` has ``lax.conv_general_dilated``'s signature (so it can be handed to
``flax.linen.Conv(conv_general_dilated=...)``; :data:`Conv` does that). For a plain 2-D NHWC/HWIO
convolution (no input dilation, no feature or batch groups, default precision) on the CPU backend it is a
``jax.custom_vjp`` whose rule gives, with stride ``s``, kernel dilation ``d`` and padding ``(lo, hi)``,

- the input gradient ``dx[n, p, q, i] = sum_{a, b, o} dy_s[n, p + d*a - P, q + d*b - Q, o] *
  K[KH-1-a, KW-1-b, i, o]`` (``dy_s``: ``dy`` dilated by ``s``; ``P = d*(KH-1) - lo`` and likewise ``Q``:
  the padding of JAX's transpose rule) written as a canonical NHWC/HWIO convolution of ``dy`` with the kernel
  flipped and transposed explicitly to ``[KH, KW, O, I]`` (a few KB of data movement per step), and
- the kernel gradient ``dK[a, b, i, o] = sum_{n, h, w} x_pad[n, s*h + d*a, s*w + d*b, i] * dy[n, h, w, o]``
  written as a canonical NHWC/HWIO convolution of ``x_pad`` transposed to ``[I, H, W, N]`` (channels as the
  batch, examples as the features) with ``dy`` transposed to ``[H_out, W_out, N, O]`` as the kernel,
  dilated by the stride ``s``, with window stride ``d`` (the kernel dilation); the first ``KH x KW`` outputs
  are ``dK`` in ``[I, KH, KW, O]`` order.

Small convolutions: even canonical, XLA CPU's convolutions are slow for few channels (Eigen's im2col with a
depth of 1 for LeNet5's first layer; measured single-threaded, batch 32: its forward pass 63 us per example,
PyTorch's 8). A stride-1, undilated convolution with non-negative padding, at most
:data:`BANDED_MAX_OUT_CHANNELS` output channels and a banded matrix of at most :data:`BANDED_MAX_ENTRIES`
entries is therefore computed as one matrix product instead: the ``KH`` padded
input rows that each output row reads, ``[N * H_out, KH * W_pad * I]``, times the block-Toeplitz matrix
``T[a, p, i, w, o] = K[a, p - w, i, o]`` (0 outside the band), ``[KH * W_pad * I, W_out * O]``. It does
``W_pad / KW`` times the multiply-adds of a direct convolution (6.4x and 2.8x for LeNet5's two layers) but
as one well-shaped GEMM, and its gradients are matrix products too (JAX's own autodiff; no convolution is
left in the training loop). LeNet5 local training, batch 32, single-threaded: 1.7x faster than the
canonical convolution path (batch 128: 1.9-2.5x). Per layer (one SGD step per batch of 32 in a scan,
single-threaded, convolution path / banded): LeNet5 conv1 2.7x, conv2 1.3x, CEPAM conv2 3.3x; with more
output channels the convolution path wins (KLMS LeNet conv1, 20 channels: 0.91x; BPC-FL conv1, 32: 0.60x;
Conv4 conv1, 64: 0.41x), hence the channel bound; Conv4, Conv6 and ResNet layers keep the convolution path.
The summation order differs from ``lax``'s (results agree to float32 rounding, not bit for bit).

Everything else (and every other backend) calls ``lax.conv_general_dilated`` unchanged. The forward pass and
both gradients are the same mathematical quantities as JAX's; on the convolution path the input gradient has
JAX's products in JAX's order (measured bit-identical outside loops), only the order of floating-point
summation in ``dK`` may differ. ``tests/models/test_conv.py`` checks the convolution path against
``lax`` (2 ULP) and both paths against a float64 oracle (the float32 summation error bound) on the models'
layer shapes, that every convolution of a training scan is canonical, and strided, dilated
and negative-padding cases under ``grad``, ``vmap`` and ``scan``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["Conv", "conv_general_dilated", "plain_lax_convolution", "lax_input_gradient", "no_banded_matmul"]

_DN = ("NHWC", "HWIO", "NHWC")
_CUSTOM_GRADIENT = [True]
_CANONICAL_INPUT_GRADIENT = [True]
_BANDED = [True]

#: A stride-1 convolution is computed as one banded matrix product (module docstring) when it has at most
#: ``BANDED_MAX_OUT_CHANNELS`` output channels and its banded matrix at most ``BANDED_MAX_ENTRIES``
#: (``KH * W_pad * I * W_out * O``) float32 entries (512 KiB). LeNet5: 6 and 16 channels, 26,880 and 67,200.
BANDED_MAX_ENTRIES = 2**17
BANDED_MAX_OUT_CHANNELS = 16


@contextlib.contextmanager
def plain_lax_convolution():
    """Within this context, :func:`conv_general_dilated` traces to plain ``lax.conv_general_dilated``.

    For benchmarks (``experiments.bench.local_training`` measures both in one run) and debugging. It acts at
    trace time: functions already compiled keep what they were traced with.
    """
    _CUSTOM_GRADIENT.append(False)
    try:
        yield
    finally:
        _CUSTOM_GRADIENT.pop()


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _conv2d(x, kernel, strides, pads, dilation):
    return lax.conv_general_dilated(x, kernel, strides, pads, rhs_dilation=dilation, dimension_numbers=_DN)


@contextlib.contextmanager
def lax_input_gradient():
    """Within this context, :func:`conv_general_dilated` is the convolution before issue 12: canonical kernel
    gradient, but the input gradient from JAX's transpose rule (the ``b01f_01oi`` convolution) and no banded
    matrix product.

    For benchmarks (``experiments.bench.torch_compare --before`` and ``experiments.bench.local_training
    --convs sidejax,no_banded,kernel_only,lax`` measure them in one run) and debugging. It acts at trace
    time, like :func:`plain_lax_convolution`.
    """
    _CANONICAL_INPUT_GRADIENT.append(False)
    try:
        yield
    finally:
        _CANONICAL_INPUT_GRADIENT.pop()


@contextlib.contextmanager
def no_banded_matmul():
    """Within this context, small stride-1 convolutions take the convolution path (the canonical custom VJP)
    instead of the banded matrix product. For benchmarks and tests; acts at trace time."""
    _BANDED.append(False)
    try:
        yield
    finally:
        _BANDED.pop()


def _uses_banded_matmul(lhs_shape, rhs_shape, strides, pads, dilation) -> bool:
    if not _BANDED[-1] or not _CANONICAL_INPUT_GRADIENT[-1]:
        return False
    if strides != (1, 1) or dilation != (1, 1) or any(p < 0 for pad in pads for p in pad):
        return False
    kh, kw, cin, cout = rhs_shape
    w_pad = lhs_shape[2] + pads[1][0] + pads[1][1]
    return (
        cout <= BANDED_MAX_OUT_CHANNELS
        and 0 < kh * w_pad * cin * (w_pad - kw + 1) * cout <= BANDED_MAX_ENTRIES
    )


def _banded_conv(x, kernel, pads):
    """Stride-1 convolution as one matrix product with a banded (block-Toeplitz) matrix built from the kernel.

    ``y[n, h, w, o] = sum_{a, p, i} x_pad[n, h + a, p, i] * T[a, p, i, w, o]`` with
    ``T[a, p, i, w, o] = K[a, p - w, i, o]`` when ``0 <= p - w < KW``, else 0: the rows of ``KH`` consecutive
    padded input lines (``[N * H_out, KH * W_pad * I]``) times ``T`` (``[KH * W_pad * I, W_out * O]``).
    Gradients are JAX's for these operations: matrix products and the transposes of slicing, so nothing in
    the backward pass is a convolution either.
    """
    kh, kw, cin, cout = kernel.shape
    xp = jnp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    n, hp, wp, _ = xp.shape
    ho, wo = hp - kh + 1, wp - kw + 1
    rows = jnp.stack([xp[:, a : a + ho] for a in range(kh)], axis=2)  # [N, H_out, KH, W_pad, I]
    band = np.arange(wp)[:, None, None] - np.arange(wo)[None, :, None] == np.arange(kw)[None, None, :]
    t = jnp.einsum("pwb,abio->apiwo", band.astype(kernel.dtype), kernel)  # [KH, W_pad, I, W_out, O]
    y = rows.reshape(n * ho, kh * wp * cin) @ t.reshape(kh * wp * cin, wo * cout)
    return y.reshape(n, ho, wo, cout)


def _conv2d_fwd(x, kernel, strides, pads, dilation):
    return _conv2d(x, kernel, strides, pads, dilation), (x, kernel)


def _dilated(size: int, dilation: int) -> int:
    return 0 if size == 0 else 1 + dilation * (size - 1)


def _input_gradient(dy, kernel, x_shape, strides, pads, dilation):
    """``dx`` as a canonical NHWC/HWIO convolution of ``dy`` with the flipped, in/out-swapped kernel.

    ``dx[n, p, q, i] = sum_{a, b, o} dy_dil[n, p + a', q + b', o] * K[KH-1-a, KW-1-b, i, o]``, where
    ``dy_dil`` is ``dy`` dilated by the stride and padded so that the window lines up (the padding of
    JAX's transpose rule). JAX's rule writes the same convolution with ``rev(K)`` and the kernel spec
    ``01oi`` (dimension numbers only, no data movement); XLA CPU moves that kernel to ``HWIO`` outside
    loops but not inside a ``while`` body, where the ``b01f_01oi`` convolution then runs on the slow
    generic loop. Here the kernel is flipped and transposed explicitly (``KH x KW x O x I``: a few KB),
    so the convolution itself is canonical everywhere; the products and their summation order are
    JAX's.
    """
    bwd_pads = []
    for size, k, s, d, (lo, _), out in zip(
        x_shape[1:3], kernel.shape[:2], strides, dilation, pads, dy.shape[1:3], strict=True
    ):
        before = _dilated(k, d) - lo - 1
        bwd_pads.append((before, size + _dilated(k, d) - 1 - _dilated(out, s) - before))
    k_t = lax.rev(kernel, (0, 1)).transpose(0, 1, 3, 2).astype(dy.dtype)  # [KH, KW, O, I]
    dx = lax.conv_general_dilated(
        dy, k_t, (1, 1), bwd_pads, lhs_dilation=strides, rhs_dilation=dilation, dimension_numbers=_DN
    )
    return dx


def _conv2d_bwd(strides, pads, dilation, residuals, dy):
    x, kernel = residuals
    if _CANONICAL_INPUT_GRADIENT[-1]:
        dx = _input_gradient(dy, kernel, x.shape, strides, pads, dilation).astype(x.dtype)
    else:  # JAX's transpose rule (benchmarks only, see lax_input_gradient)
        conv = functools.partial(lax.conv_general_dilated, rhs_dilation=dilation, dimension_numbers=_DN)
        (dx,) = jax.vjp(lambda x_: conv(x_, kernel, strides, pads), x)[1](dy)
    (ph_lo, ph_hi), (pw_lo, pw_hi) = pads
    x_pad = lax.pad(x, jnp.zeros((), x.dtype), ((0, 0, 0), (ph_lo, ph_hi, 0), (pw_lo, pw_hi, 0), (0, 0, 0)))
    out = lax.conv_general_dilated(
        x_pad.transpose(3, 1, 2, 0),  # [I, Hp, Wp, N]: channels as the batch, examples as the features
        dy.transpose(1, 2, 0, 3),  # [H_out, W_out, N, O] as the kernel
        dilation,
        "VALID",
        rhs_dilation=strides,
        dimension_numbers=_DN,
    )  # [I, >= KH, >= KW, O]
    dk = out[:, : kernel.shape[0], : kernel.shape[1], :].transpose(1, 2, 0, 3).astype(kernel.dtype)
    return dx, dk


_conv2d.defvjp(_conv2d_fwd, _conv2d_bwd)


def _is_plain_2d(lhs, rhs, lhs_dilation, dimension_numbers, feature_group_count, batch_group_count, *extra):
    if lhs.ndim != 4 or rhs.ndim != 4 or feature_group_count != 1 or batch_group_count != 1:
        return False
    if any(e is not None for e in extra):
        return False
    if lhs_dilation is not None and any(int(v) != 1 for v in lhs_dilation):
        return False
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    return dn == lax.conv_dimension_numbers(lhs.shape, rhs.shape, _DN)


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers=None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision=None,
    preferred_element_type=None,
) -> jax.Array:
    """``lax.conv_general_dilated`` with loop-friendly input and kernel gradients on CPU (module docstring).

    Same arguments and result as :func:`jax.lax.conv_general_dilated`. For plain 2-D NHWC/HWIO convolutions
    when the default backend is CPU: a banded matrix product for small stride-1 ones, else the custom
    gradient; every other call is passed through.
    """
    plain = _is_plain_2d(
        lhs, rhs, lhs_dilation, dimension_numbers, feature_group_count, batch_group_count, precision,
        preferred_element_type,
    )  # fmt: skip
    if not plain or not _CUSTOM_GRADIENT[-1] or jax.default_backend() != "cpu":
        return lax.conv_general_dilated(
            lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, precision, preferred_element_type,
        )  # fmt: skip
    strides = tuple(int(s) for s in window_strides)
    dilation = tuple(int(d) for d in rhs_dilation) if rhs_dilation is not None else (1, 1)
    if isinstance(padding, str):
        window = [(rhs.shape[i] - 1) * dilation[i] + 1 for i in range(2)]
        padding = lax.padtype_to_pads(lhs.shape[1:3], window, strides, padding)
    pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    if _uses_banded_matmul(lhs.shape, rhs.shape, strides, pads, dilation):
        return _banded_conv(lhs, rhs, pads)
    return _conv2d(lhs, rhs, strides, pads, dilation)


#: ``flax.linen.Conv`` using :func:`conv_general_dilated`: same parameters, names and outputs.
Conv = functools.partial(nn.Conv, conv_general_dilated=conv_general_dilated)
