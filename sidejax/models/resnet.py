"""CIFAR ResNet-18 with parameter-only normalisation layers.

The federated-learning engine of ``sidejax`` trains and communicates the
``params`` pytree only; a model with mutable ``batch_stats`` (running means
and variances, as in :class:`flax.linen.BatchNorm`) would need extra state
that is neither aggregated nor compressed. Both normalisation choices offered
here therefore keep the model a pure function of ``params``:

* ``"batch"``: :class:`BatchStatNorm`, batch normalisation that always uses the
  statistics of the current batch (PyTorch ``BatchNorm2d(...,
  track_running_stats=False)``). This is what the KLMS specification
  recommends, and it is the usual choice in stochastic / mask-based FL
  (FedPM, KLMS, BICompFL), where running statistics estimated for one sampled
  model or one client's data do not transfer to the aggregated model.
* ``"group"``: :class:`flax.linen.GroupNorm` with 2 groups, a per-example
  normalisation with the same number of parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from sidejax.models.classifier import Classifier
from sidejax.models.conv import Conv

__all__ = ["BatchStatNorm", "BasicBlock", "ResNet18", "NORMS"]

#: Valid values of the ``norm`` field of :class:`ResNet18` / :class:`BasicBlock`.
NORMS: tuple[str, ...] = ("batch", "group")


class BatchStatNorm(nn.Module):
    """Batch normalisation that always uses the current batch's statistics.

    Equivalent to PyTorch's ``BatchNorm(track_running_stats=False)``: the mean
    and (biased) variance are computed over every axis except the last
    (``N, H, W`` for NHWC feature maps), in training *and* evaluation, and no
    running averages are kept. The only variables are the learned per-channel
    affine ``scale`` (init 1) and ``bias`` (init 0), both in the ``params``
    collection, so ``apply`` needs no ``mutable`` argument and the module is a
    pure function of ``params``.

    Because evaluation also uses batch statistics, predictions depend on the
    composition of the evaluation batch; evaluate with reasonably large batches
    (as the reference implementations do).

    Parameters: ``2 * channels``.

    Attributes:
        epsilon: Added to the variance for numerical stability.
        use_scale: Whether to learn a per-channel scale.
        use_bias: Whether to learn a per-channel bias.
    """

    epsilon: float = 1e-5
    use_scale: bool = True
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalises ``x`` with its own batch statistics.

        Args:
            x: Array of shape ``[..., channels]``; statistics are taken over all
                leading axes.

        Returns:
            Normalised array of the same shape and dtype as ``x``.
        """
        features = x.shape[-1]
        axes = tuple(range(x.ndim - 1))
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=axes)
        var = jnp.mean(jnp.square(xf - mean), axis=axes)
        y = (xf - mean) * jax.lax.rsqrt(var + self.epsilon)
        if self.use_scale:
            y = y * self.param("scale", nn.initializers.ones, (features,), jnp.float32)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (features,), jnp.float32)
        return y.astype(x.dtype)


def _check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got norm={norm!r}")


def _norm_factory(norm: str) -> Callable[..., nn.Module]:
    """Returns a constructor ``f(name=...)`` for the chosen normalisation."""
    _check_norm(norm)
    if norm == "batch":
        return functools.partial(BatchStatNorm, epsilon=1e-5)
    return functools.partial(nn.GroupNorm, num_groups=2, epsilon=1e-5)


class BasicBlock(nn.Module):
    """ResNet basic block: two bias-free 3x3 convolutions with normalisation.

    ``conv3x3(stride) - norm - ReLU - conv3x3 - norm``, plus a shortcut that is
    the identity, or a bias-free 1x1 convolution (with the same stride) followed
    by a norm when the stride or channel count changes; ReLU after the sum.

    Parameters (``c_in`` -> ``c``): ``9*c_in*c + 9*c*c + 4*c``, plus
    ``c_in*c + 2*c`` with a projection shortcut.

    Attributes:
        features: Number of output channels.
        strides: Stride of the first convolution and the shortcut.
        norm: ``"batch"`` (:class:`BatchStatNorm`) or ``"group"`` (GroupNorm, 2 groups).
    """

    features: int
    strides: int = 1
    norm: str = "batch"

    def __post_init__(self) -> None:
        _check_norm(self.norm)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the block to NHWC features ``x``."""
        make_norm = _norm_factory(self.norm)
        y = Conv(self.features, (3, 3), strides=self.strides, padding=1, use_bias=False, name="conv1")(x)
        y = nn.relu(make_norm(name="norm1")(y))
        y = Conv(self.features, (3, 3), strides=1, padding=1, use_bias=False, name="conv2")(y)
        y = make_norm(name="norm2")(y)
        shortcut = x
        if self.strides != 1 or x.shape[-1] != self.features:
            shortcut = Conv(
                self.features, (1, 1), strides=self.strides, padding=0, use_bias=False, name="shortcut_conv"
            )(x)
            shortcut = make_norm(name="shortcut_norm")(shortcut)
        return nn.relu(y + shortcut)


class ResNet18(Classifier):
    """ResNet-18 for 32x32 images (CIFAR variant; KLMS Table 4).

    Source: He et al., "Deep residual learning for image recognition", CVPR
    2016, in the common CIFAR adaptation (3x3 stem with stride 1 and no
    max-pool, as in kuangliu/pytorch-cifar) used by KLMS (Isik et al.,
    "Adaptive compression in federated learning via side information",
    AISTATS 2024, Table 4). Convolutions are bias-free and use explicit
    PyTorch-style padding (1 for 3x3, 0 for 1x1), so stride-2 layers match
    PyTorch exactly.

    Layer table for a 32x32x3 input (parameters with affine norm layers,
    i.e. scale and bias per channel):

    ========================================  ==========  ============
    Layer                                     Output      Params
    ========================================  ==========  ============
    Conv 3x3, 64, stride 1 (no bias) + norm   32x32x64    1,856
    Stage 1: 2 BasicBlocks, 64                32x32x64    147,968
    Stage 2: 2 BasicBlocks, 128, stride 2     16x16x128   525,568
    Stage 3: 2 BasicBlocks, 256, stride 2     8x8x256     2,099,712
    Stage 4: 2 BasicBlocks, 512, stride 2     4x4x512     8,393,728
    Global average pool (4x4)                 512         0
    Dense 512 -> num_classes                  10          5,130
    ========================================  ==========  ============

    Stages 2-4 open with a projection shortcut (1x1 conv, no bias, + norm).
    Other input sizes work: the final pooling averages over whatever spatial extent remains.
    Total: **11,173,962** parameters for ``num_classes=10`` and
    **11,220,132** for ``num_classes=100``, with either normalisation.

    Normalisation (``norm``):

    * ``"batch"`` (default): :class:`BatchStatNorm`, i.e. batch norm that
      always uses the current batch's statistics and keeps no running
      averages (PyTorch ``track_running_stats=False``), with a learned affine
      scale/bias. The KLMS specification recommends BN with batch statistics,
      and stochastic/mask-based FL methods (FedPM, KLMS) do the same, because
      running averages are extra non-parameter state: the ``sidejax`` FL
      engine trains, aggregates and compresses only the ``params`` pytree, so
      the model must stay a pure function of ``params``.
    * ``"group"``: ``nn.GroupNorm(num_groups=2)`` (epsilon 1e-5), a
      per-example alternative with the same parameter count.

    Attributes:
        num_classes: Number of output logits.
        norm: ``"batch"`` or ``"group"``; anything else raises ``ValueError``.
    """

    num_classes: int = 10
    norm: str = "batch"

    def __post_init__(self) -> None:
        _check_norm(self.norm)
        super().__post_init__()

    def logits(self, x: jax.Array) -> jax.Array:
        make_norm = _norm_factory(self.norm)
        x = Conv(64, (3, 3), strides=1, padding=1, use_bias=False, name="conv1")(x)
        x = nn.relu(make_norm(name="norm1")(x))
        for stage, features in enumerate((64, 128, 256, 512)):
            for block in range(2):
                strides = 2 if stage > 0 and block == 0 else 1
                name = f"stage{stage + 1}_block{block + 1}"
                x = BasicBlock(features, strides=strides, norm=self.norm, name=name)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, name="fc")(x)
