"""Flax linen models (NHWC inputs) used by the reproduced federated-learning papers.

Every model is a :class:`Classifier`: it maps ``[batch, *input_shape]`` to
``[batch, num_classes]`` and has only a ``params`` collection. Use
:func:`get_model` to build a model by name, :func:`init_params` to initialise it
and :func:`count_params` to count it.
"""

from sidejax.models import classifier, cnn, mlp, registry, resnet
from sidejax.models.classifier import *
from sidejax.models.cnn import *
from sidejax.models.mlp import *
from sidejax.models.registry import *
from sidejax.models.resnet import *

# every model module's public names (its __all__), declared once there; the convolution they share
# (sidejax.models.conv, with its CPU-backend switches) stays in its module
__all__ = [
    *classifier.__all__,
    *cnn.__all__,
    *mlp.__all__,
    *registry.__all__,
    *resnet.__all__,
]
