"""Multilayer perceptrons: generic MLP and the small BPC-FL MLPs.

Inputs of any shape ``[batch, *input_shape]`` are flattened to
``[batch, prod(input_shape)]`` first, so the first layer adapts to the data
(e.g. 8x8x1 ``digits`` images give a 64-input first layer). Parameter counts
include weights *and* biases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax

from sidejax.models.classifier import Classifier, dense_stack, flatten

__all__ = ["MLP", "MoonsMLP", "RegressionMLP"]


class MLP(Classifier):
    """Fully connected classifier with configurable hidden layers.

    Source: the standard MNIST MLP baselines of the federated-learning
    literature (e.g. McMahan et al., "Communication-efficient learning of deep
    networks from decentralized data", AISTATS 2017); the 784-32-16-10 preset
    is the MLP of CEPAM (Ling et al., arXiv:2501.12046, 2025).

    Layer table (``d`` = flattened input size, ``h_i`` = ``features[i]``):

    ==================================  ==============================
    Layer                               Params
    ==================================  ==============================
    Flatten                             0
    Dense d -> h_1, activation          d * h_1 + h_1
    Dense h_i -> h_{i+1}, activation    h_i * h_{i+1} + h_{i+1}
    Dense h_k -> num_classes            h_k * num_classes + num_classes
    ==================================  ==============================

    Registry presets (28x28x1 input, 10 classes):

    * ``mlp_100``: 784-100-10, **79,510** parameters (78,500 + 1,010).
    * ``mlp_32_16``: 784-32-16-10, **25,818** parameters
      (25,120 + 528 + 170).

    Attributes:
        features: Widths of the hidden layers (may be empty: a linear model).
        num_classes: Number of output logits.
        activation: Elementwise non-linearity after every hidden layer.
    """

    features: Sequence[int]
    num_classes: int = 10
    activation: Callable[[jax.Array], jax.Array] = nn.relu

    def logits(self, x: jax.Array) -> jax.Array:
        return dense_stack(x, self.features, self.num_classes, self.activation)


class MoonsMLP(Classifier):
    """BPC-FL two-moons classifier with GroupNorm.

    Source: d'Hondt, Pechenizkiy & Peharz, "One-shot federated learning with
    Bayesian pseudocoresets" (BPC-FL), arXiv:2406.02177, 2024; the MLP used for
    the 2-D (two moons) classification experiment.

    Layer table for a 2-D input:

    ==================================  =========  ==========
    Layer                               Output     Params
    ==================================  =========  ==========
    Dense 2 -> 50                       50         150
    GroupNorm (2 groups, affine)        50         100
    ReLU                                50         0
    Dense 50 -> 50                      50         2,550
    GroupNorm (2 groups, affine)        50         100
    ReLU                                50         0
    Dense 50 -> num_classes             2          102
    ==================================  =========  ==========

    Total: **3,002** parameters for ``num_classes=2``.

    GroupNorm normalises each example on its own (no batch statistics), so
    the model only has a ``params`` collection.

    Attributes:
        num_classes: Number of output logits.
    """

    num_classes: int = 2

    def logits(self, x: jax.Array) -> jax.Array:
        x = flatten(x)
        for i in range(2):
            x = nn.Dense(50, name=f"fc{i + 1}")(x)
            x = nn.GroupNorm(num_groups=2, epsilon=1e-5, name=f"norm{i + 1}")(x)
            x = nn.relu(x)
        return nn.Dense(self.num_classes, name="fc3")(x)


class RegressionMLP(Classifier):
    """BPC-FL synthetic-regression MLP with swish activations.

    Source: d'Hondt, Pechenizkiy & Peharz, "One-shot federated learning with
    Bayesian pseudocoresets" (BPC-FL), arXiv:2406.02177, 2024; the network of
    its 1-D synthetic regression experiment.

    Layer table for a 1-D input:

    ==================================  =========  ==========
    Layer                               Output     Params
    ==================================  =========  ==========
    Dense 1 -> 128, swish               128        256
    Dense 128 -> 128, swish             128        16,512
    Dense 128 -> num_classes            1          129
    ==================================  =========  ==========

    Total: **16,897** parameters for ``num_classes=1``.

    Attributes:
        num_classes: Number of outputs (1 for scalar regression; the name is
            shared with the classifiers so the registry can treat all models
            alike).
    """

    num_classes: int = 1

    def logits(self, x: jax.Array) -> jax.Array:
        return dense_stack(x, (128, 128), self.num_classes, nn.swish)
