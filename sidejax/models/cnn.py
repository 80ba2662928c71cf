"""Convolutional classifiers used by the reproduced federated-learning papers.

All models take NHWC inputs (``[batch, height, width, channels]``) and return
logits of shape ``[batch, num_classes]``. They use only the ``params``
collection, so ``module.apply({"params": params}, x)`` is a pure function of
the parameters. Padding is given as explicit integers (PyTorch convention), so
that layer shapes match the reference implementations exactly.

Each is a :class:`~sidejax.models.Classifier` whose ``logits`` is a stack of
convolution blocks (``_conv_pool_stack``) followed by
:func:`~sidejax.models.classifier.dense_stack`. Parameter counts include weights
*and* biases and refer to the default input shape and ``num_classes`` given in
each docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax

from sidejax.models.classifier import Classifier, dense_stack
from sidejax.models.conv import Conv

__all__ = ["LeNet5", "Conv4", "Conv6", "KLMSLeNet", "CEPAMCNN", "BPCFLConvNet"]


def _max_pool2(x: jax.Array) -> jax.Array:
    return nn.max_pool(x, window_shape=(2, 2), strides=(2, 2))


def _avg_pool2(x: jax.Array) -> jax.Array:
    return nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))


def _conv_pool_stack(
    x: jax.Array,
    blocks: Sequence[Sequence[int]],
    kernel_size: tuple[int, int],
    paddings: Sequence[int | str],
    pool: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """The convolutional part of every CNN here: block ``b`` is ``Conv(w, kernel_size,
    padding=paddings[b]) - ReLU`` for each width ``w`` in ``blocks[b]``, then ``pool``.

    Called from a model's ``logits``, so the convolutions belong to the model and are named ``conv1``,
    ``conv2``, ... in order over all blocks.
    """
    index = 0
    for widths, padding in zip(blocks, paddings, strict=True):
        for features in widths:
            index += 1
            x = nn.relu(Conv(features, kernel_size, padding=padding, name=f"conv{index}")(x))
        x = pool(x)
    return x


class LeNet5(Classifier):
    """LeNet-5 with ReLU activations and average pooling (BICompFL, MNIST).

    Source: LeCun et al., "Gradient-based learning applied to document
    recognition", Proc. IEEE 1998; the variant used for MNIST in BICompFL
    (Egger, Bitar, Wachter-Zeh, Weinberger & Gunduz, "BICompFL: Stochastic
    federated learning with bi-directional compression", arXiv:2502.00206, 2025).

    Layer table for a 28x28x1 input:

    ==================================  =============  ==========
    Layer                               Output         Params
    ==================================  =============  ==========
    Conv 5x5, 6 filters, padding 2      28x28x6        156
    ReLU, AvgPool 2x2                   14x14x6        0
    Conv 5x5, 16 filters, VALID         10x10x16       2,416
    ReLU, AvgPool 2x2                   5x5x16 = 400   0
    Dense 400 -> 120, ReLU              120            48,120
    Dense 120 -> 84, ReLU               84             10,164
    Dense 84 -> num_classes             10             850
    ==================================  =============  ==========

    Total: **61,706** parameters for ``num_classes=10``.

    Attributes:
        num_classes: Number of output logits.
    """

    num_classes: int = 10

    def logits(self, x: jax.Array) -> jax.Array:
        x = _conv_pool_stack(x, ((6,), (16,)), (5, 5), (2, "VALID"), _avg_pool2)
        return dense_stack(x, (120, 84), self.num_classes)


class Conv4(Classifier):
    """Conv-4 network (KLMS "CONV4", BICompFL "4CNN").

    Source: Ramanujan et al., "What's hidden in a randomly weighted neural
    network?", CVPR 2020 (after Frankle & Carbin's Conv-2/4/6); used on MNIST
    and EMNIST by KLMS (Isik et al.) and BICompFL.

    Layer table for a 28x28x1 input (3x3 convolutions with padding 1, i.e.
    size-preserving "same" padding):

    ==================================  =================  ==========
    Layer                               Output             Params
    ==================================  =================  ==========
    Conv 3x3, 64, ReLU                  28x28x64           640
    Conv 3x3, 64, ReLU, MaxPool 2x2     14x14x64           36,928
    Conv 3x3, 128, ReLU                 14x14x128          73,856
    Conv 3x3, 128, ReLU, MaxPool 2x2    7x7x128 = 6272     147,584
    Dense 6272 -> 256, ReLU             256                1,605,888
    Dense 256 -> 256, ReLU              256                65,792
    Dense 256 -> num_classes            10                 2,570
    ==================================  =================  ==========

    Total: **1,933,258** parameters for ``num_classes=10``
    (**1,942,767** for EMNIST-balanced, ``num_classes=47``).

    Attributes:
        num_classes: Number of output logits.
    """

    num_classes: int = 10

    def logits(self, x: jax.Array) -> jax.Array:
        x = _conv_pool_stack(x, ((64, 64), (128, 128)), (3, 3), (1, 1), _max_pool2)
        return dense_stack(x, (256, 256), self.num_classes)


class Conv6(Classifier):
    """Conv-6 network (KLMS "CONV6", BICompFL "6CNN") for CIFAR-10.

    Source: Ramanujan et al., "What's hidden in a randomly weighted neural
    network?", CVPR 2020 (after Frankle & Carbin, ICLR 2019); used on CIFAR-10
    by KLMS (Isik et al.) and BICompFL.

    Layer table for a 32x32x3 input (3x3 convolutions with padding 1):

    ==================================  =================  ==========
    Layer                               Output             Params
    ==================================  =================  ==========
    Conv 3x3, 64, ReLU                  32x32x64           1,792
    Conv 3x3, 64, ReLU, MaxPool 2x2     16x16x64           36,928
    Conv 3x3, 128, ReLU                 16x16x128          73,856
    Conv 3x3, 128, ReLU, MaxPool 2x2    8x8x128            147,584
    Conv 3x3, 256, ReLU                 8x8x256            295,168
    Conv 3x3, 256, ReLU, MaxPool 2x2    4x4x256 = 4096     590,080
    Dense 4096 -> 256, ReLU             256                1,048,832
    Dense 256 -> 256, ReLU              256                65,792
    Dense 256 -> num_classes            10                 2,570
    ==================================  =================  ==========

    Total: **2,262,602** parameters for ``num_classes=10``.

    Attributes:
        num_classes: Number of output logits.
    """

    num_classes: int = 10

    def logits(self, x: jax.Array) -> jax.Array:
        x = _conv_pool_stack(x, ((64, 64), (128, 128), (256, 256)), (3, 3), (1, 1, 1), _max_pool2)
        return dense_stack(x, (256, 256), self.num_classes)


class KLMSLeNet(Classifier):
    """LeNet (Caffe variant) for Bayesian FL on MNIST (KLMS, Table 5).

    Source: Isik et al., "Adaptive compression in federated learning via
    side information" (KLMS), AISTATS 2024, Table 5; the architecture is the
    Caffe "LeNet" (20/50 conv filters, 500 hidden units) after LeCun et al.
    1998.

    Layer table for a 28x28x1 input:

    ==================================  =================  ==========
    Layer                               Output             Params
    ==================================  =================  ==========
    Conv 5x5, 20, VALID, ReLU           24x24x20           520
    MaxPool 2x2                         12x12x20           0
    Conv 5x5, 50, VALID, ReLU           8x8x50             25,050
    MaxPool 2x2                         4x4x50 = 800       0
    Dense 800 -> 500, ReLU              500                400,500
    Dense 500 -> num_classes            10                 5,010
    ==================================  =================  ==========

    Total: **431,080** parameters for ``num_classes=10``.

    Attributes:
        num_classes: Number of output logits.
    """

    num_classes: int = 10

    def logits(self, x: jax.Array) -> jax.Array:
        x = _conv_pool_stack(x, ((20,), (50,)), (5, 5), ("VALID", "VALID"), _max_pool2)
        return dense_stack(x, (500,), self.num_classes)


class CEPAMCNN(Classifier):
    """Small CNN of the CEPAM paper (MNIST).

    Source: Ling et al., "Communication-efficient and privacy-adaptable
    mechanism for federated learning" (CEPAM), arXiv:2501.12046, 2025; the
    small CNN used in its MNIST experiments.

    Layer table for a 28x28x1 input:

    ==================================  =================  ==========
    Layer                               Output             Params
    ==================================  =================  ==========
    Conv 5x5, 1 -> 6, VALID, ReLU       24x24x6            156
    MaxPool 2x2                         12x12x6            0
    Conv 5x5, 6 -> 6, VALID, ReLU       8x8x6              906
    MaxPool 2x2                         4x4x6 = 96         0
    Dense 96 -> 50, ReLU                50                 4,850
    Dense 50 -> num_classes             10                 510
    ==================================  =================  ==========

    Total: **6,422** parameters for ``num_classes=10``.

    Attributes:
        num_classes: Number of output logits.
    """

    num_classes: int = 10

    def logits(self, x: jax.Array) -> jax.Array:
        x = _conv_pool_stack(x, ((6,), (6,)), (5, 5), ("VALID", "VALID"), _max_pool2)
        return dense_stack(x, (50,), self.num_classes)


class BPCFLConvNet(Classifier):
    """EMNIST-62 ConvNet used by BPC-FL (no dropout).

    Source: Reddi et al., "Adaptive federated optimization", ICLR 2021
    (EMNIST character-recognition CNN), as used by BPC-FL (d'Hondt, Pechenizkiy
    & Peharz, "One-shot federated learning with Bayesian pseudocoresets",
    arXiv:2406.02177, 2024); the dropout layers of the original are omitted.
    The network has no normalisation layers, so the count below contains none;
    the GroupNorm layers mentioned in BPC-FL belong to its two-moons MLP
    (:class:`sidejax.models.MoonsMLP`).

    Layer table for a 28x28x1 input:

    ==================================  =================  ==========
    Layer                               Output             Params
    ==================================  =================  ==========
    Conv 3x3, 32, VALID, ReLU           26x26x32           320
    Conv 3x3, 64, VALID, ReLU           24x24x64           18,496
    MaxPool 2x2, flatten                12x12x64 = 9216    0
    Dense 9216 -> 128, ReLU             128                1,179,776
    Dense 128 -> num_classes            62                 7,998
    ==================================  =================  ==========

    Total: **1,206,590** parameters for ``num_classes=62``.

    Attributes:
        num_classes: Number of output logits (62 for EMNIST ByClass).
    """

    num_classes: int = 62

    def logits(self, x: jax.Array) -> jax.Array:
        x = _conv_pool_stack(x, ((32, 64),), (3, 3), ("VALID",), _max_pool2)
        return dense_stack(x, (128,), self.num_classes)
