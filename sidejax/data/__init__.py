"""Datasets, client partitioning and the device-side federated data container.

* :mod:`sidejax.data.datasets`: :func:`load_dataset` and friends (host numpy arrays): the registry and the
  search path; the formats are read by :mod:`sidejax.data.idx` (MNIST family), :mod:`sidejax.data.cifar`,
  :mod:`sidejax.data.builtin` (no files needed; also BPC-FL's
  three-interval regression, :func:`interval_regression`) and :mod:`sidejax.data.tfds`, into the common
  :class:`Dataset` of :mod:`sidejax.data.base`.
* :mod:`sidejax.data.partition`: deterministic host-side client partitions (index arrays), and pFedMe's
  label split into per-client train and test sets (:func:`label_split_train_test`).
* :mod:`sidejax.data.federated`: :class:`FederatedData`, the data stored once on device with a padded
  per-client index table, ready for ``jax.vmap`` over clients.
"""

from sidejax.data import builtin, datasets, federated
from sidejax.data import partition as _partition_module  # the name ``partition`` is its function
from sidejax.data.builtin import *
from sidejax.data.datasets import *
from sidejax.data.federated import *
from sidejax.data.partition import *

# every submodule's public names (its __all__), declared once there; datasets re-exports builtin's
# synthetic_regression (a name listed twice is imported once)
__all__ = [
    *builtin.__all__,
    *datasets.__all__,
    *federated.__all__,
    *_partition_module.__all__,
]
