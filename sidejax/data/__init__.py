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

from sidejax.data.builtin import (
    INTERVALS,
    IntervalRegression,
    interval_regression,
    interval_regression_test,
    interval_target,
)
from sidejax.data.datasets import (
    DATASETS,
    EMNIST_SUBSETS,
    Dataset,
    dataset_available,
    load_dataset,
    read_idx,
    synthetic_regression,
)
from sidejax.data.federated import (
    FederatedData,
    class_counts,
    client_sizes,
    make_federated_data,
    max_examples,
    num_clients,
)
from sidejax.data.partition import (
    PARTITION_KINDS,
    dirichlet_partition,
    fixed_size_partition,
    iid_partition,
    klms_noniid_partition,
    label_shard_partition,
    label_split_train_test,
    partition,
)

__all__ = [
    "DATASETS",
    "EMNIST_SUBSETS",
    "INTERVALS",
    "IntervalRegression",
    "PARTITION_KINDS",
    "Dataset",
    "FederatedData",
    "class_counts",
    "client_sizes",
    "dataset_available",
    "dirichlet_partition",
    "fixed_size_partition",
    "iid_partition",
    "interval_regression",
    "interval_regression_test",
    "interval_target",
    "klms_noniid_partition",
    "label_shard_partition",
    "label_split_train_test",
    "load_dataset",
    "make_federated_data",
    "max_examples",
    "num_clients",
    "partition",
    "read_idx",
    "synthetic_regression",
]
