"""Flax linen models (NHWC inputs) used by the reproduced federated-learning papers.

Every model is a :class:`Classifier`: it maps ``[batch, *input_shape]`` to
``[batch, num_classes]`` and has only a ``params`` collection. Use
:func:`get_model` to build a model by name, :func:`init_params` to initialise it
and :func:`count_params` to count it.
"""

from sidejax.models.classifier import Classifier
from sidejax.models.cnn import CEPAMCNN, BPCFLConvNet, Conv4, Conv6, KLMSLeNet, LeNet5
from sidejax.models.mlp import MLP, MoonsMLP, RegressionMLP
from sidejax.models.registry import ALIASES, MODELS, ModelSpec, count_params, get_model, init_params
from sidejax.models.resnet import NORMS, BasicBlock, BatchStatNorm, ResNet18

__all__ = [
    "ALIASES",
    "BPCFLConvNet",
    "BasicBlock",
    "BatchStatNorm",
    "CEPAMCNN",
    "Classifier",
    "Conv4",
    "Conv6",
    "KLMSLeNet",
    "LeNet5",
    "MLP",
    "MODELS",
    "ModelSpec",
    "MoonsMLP",
    "NORMS",
    "RegressionMLP",
    "ResNet18",
    "count_params",
    "get_model",
    "init_params",
]
