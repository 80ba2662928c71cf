"""Device-side container for a partitioned (federated) dataset.

Design: the training set is stored on the device **once**, as ``x`` ``[num_examples, ...]`` and ``y``
``[num_examples]``, together with a small per-client index table ``client_indices``
``[num_clients, max_examples]`` (rows padded with index ``0``) and the true per-client counts
``num_examples`` ``[num_clients]``. Client ``c``'s view is ``(x, y, client_indices[c], num_examples[c])``;
positions ``>= num_examples[c]`` of its row are padding and must be masked out (e.g. with
``jnp.arange(max_examples) < num_examples[c]``) or never sampled.

Because every client has the same static shapes, a round of local training can be written for one
client and mapped over clients with ``jax.vmap`` over ``(client_indices, num_examples)`` while ``x`` and
``y`` are closed over / broadcast; the gathers ``x[idx]`` happen inside ``jit``, batch by batch.

Memory: materialising a padded per-client copy of the data would cost
``num_clients * max_examples * example_size``, which for unbalanced splits (``max_examples`` much larger
than the mean) can be many times the dataset itself. Here the data costs ``num_examples * example_size``
once, plus ``4 * num_clients * max_examples`` bytes of indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FederatedData",
    "class_counts",
    "client_sizes",
    "make_federated_data",
    "max_examples",
    "num_clients",
]


class FederatedData(NamedTuple):
    """A dataset stored once on device plus a padded per-client index table.

    Client ``c`` owns the examples ``x[client_indices[c, :num_examples[c]]]``; the rest of row ``c`` is
    padding (index ``0``). All fields are JAX arrays with static shapes, so a per-client function
    ``f(x, y, idx, n)`` can be ``jax.vmap``-ed over ``(client_indices, num_examples)`` with ``x`` and
    ``y`` unmapped, and the gathers run inside ``jit``. See the module docstring for the memory argument.

    Attributes:
        x: The whole training inputs, ``[num_examples, ...]`` (not duplicated per client).
        y: The training targets, ``[num_examples]`` (``int32`` labels or ``float32`` targets).
        client_indices: ``int32 [num_clients, max_examples]``; row ``c`` lists client ``c``'s example
            indices, padded with ``0``.
        num_examples: ``int32 [num_clients]``; entries of row ``c`` at positions ``>= num_examples[c]``
            of ``client_indices`` are padding.
    """

    x: jax.Array
    y: jax.Array
    client_indices: jax.Array
    num_examples: jax.Array


def _check_partition(client_partition: Any, num_total: int) -> list[np.ndarray]:
    if isinstance(client_partition, np.ndarray) and client_partition.ndim == 2:
        client_partition = list(client_partition)
    if not isinstance(client_partition, Sequence) or len(client_partition) == 0:
        raise ValueError(
            "client_partition must be a non-empty list of 1-D integer index arrays, one per client; "
            f"got {type(client_partition).__name__}."
        )
    parts = []
    for c, part in enumerate(client_partition):
        arr = np.asarray(part)
        if arr.ndim != 1:
            raise ValueError(f"client_partition[{c}] must be a 1-D index array; got shape {arr.shape}.")
        if arr.size == 0:
            raise ValueError(
                f"client_partition[{c}] is empty: client {c} has no examples; every client needs at least "
                "one."
            )
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"client_partition[{c}] must hold integer indices; got dtype {arr.dtype}.")
        if arr.min() < 0 or arr.max() >= num_total:
            raise ValueError(
                f"client_partition[{c}] has indices outside [0, {num_total}) (found min {arr.min()}, "
                f"max {arr.max()}); indices must address the {num_total} examples of x."
            )
        parts.append(arr.astype(np.int64))
    return parts


def _padded_table(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.array([p.size for p in parts], dtype=np.int64)
    flat = np.concatenate(parts)
    rows = np.repeat(np.arange(len(parts)), sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    cols = np.arange(flat.size) - np.repeat(offsets, sizes)
    table = np.zeros((len(parts), int(sizes.max())), dtype=np.int32)
    table[rows, cols] = flat
    return table, sizes.astype(np.int32)


def make_federated_data(x: Any, y: Any, client_partition: Sequence[np.ndarray]) -> FederatedData:
    """Builds a :class:`FederatedData` from host arrays and a client partition.

    Args:
        x: Inputs ``[num_examples, ...]``; converted to a JAX array keeping its dtype (subject to JAX's
            default 32-bit mode).
        y: Targets ``[num_examples]``; integer (or boolean) labels become ``int32``, anything else
            ``float32``.
        client_partition: One 1-D integer index array per client (e.g. from
            :mod:`sidejax.data.partition`); indices must lie in ``[0, num_examples)`` and no client may be
            empty. Clients may overlap or leave examples unused.

    Returns:
        The :class:`FederatedData`.

    Raises:
        ValueError: If ``x`` and ``y`` differ in length, ``x`` is a scalar or empty, the partition is
            empty or malformed, some client is empty (the message names it), or an index is out of
            range.
    """
    x_np = np.asarray(x)
    y_np = np.asarray(y)
    if x_np.ndim < 1 or x_np.shape[0] == 0:
        raise ValueError(f"x must be an array [num_examples, ...] with num_examples >= 1; got {x_np.shape}.")
    if y_np.ndim != 1:
        raise ValueError(f"y must be a 1-D array [num_examples]; got shape {y_np.shape}.")
    if x_np.shape[0] != y_np.shape[0]:
        raise ValueError(
            f"x and y must have the same number of examples; got {x_np.shape[0]} (x) and {y_np.shape[0]} (y)."
        )
    if x_np.shape[0] > np.iinfo(np.int32).max:
        raise ValueError(f"x has {x_np.shape[0]} examples, more than int32 indices can address.")
    parts = _check_partition(client_partition, x_np.shape[0])
    table, sizes = _padded_table(parts)
    integer_labels = np.issubdtype(y_np.dtype, np.integer) or y_np.dtype == np.bool_
    y_dtype = jnp.int32 if integer_labels else jnp.float32
    return FederatedData(
        x=jnp.asarray(x_np),
        y=jnp.asarray(y_np, dtype=y_dtype),
        client_indices=jnp.asarray(table),
        num_examples=jnp.asarray(sizes),
    )


def _check_fd(fd: Any) -> FederatedData:
    if not isinstance(fd, FederatedData):
        raise ValueError(f"fd must be a FederatedData; got {type(fd).__name__}.")
    return fd


def num_clients(fd: FederatedData) -> int:
    """Number of clients of ``fd``, ``client_indices.shape[0]`` (``ValueError`` if ``fd`` is not a
    :class:`FederatedData`)."""
    return int(_check_fd(fd).client_indices.shape[0])


def max_examples(fd: FederatedData) -> int:
    """Padded row length of ``fd``'s client index table (the largest client's size),
    ``client_indices.shape[1]`` (``ValueError`` if ``fd`` is not a :class:`FederatedData`)."""
    return int(_check_fd(fd).client_indices.shape[1])


def client_sizes(fd: FederatedData) -> np.ndarray:
    """Number of examples of every client of ``fd``, as a host ``int64 [num_clients]`` numpy array
    (``ValueError`` if ``fd`` is not a :class:`FederatedData`)."""
    return np.asarray(_check_fd(fd).num_examples).astype(np.int64)


def class_counts(labels: Any, client_partition: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-client label histogram, for diagnosing a partition.

    Args:
        labels: 1-D integer labels in ``[0, num_classes)``, one per example.
        client_partition: One 1-D integer index array per client, indices in ``[0, len(labels))``.
        num_classes: Number of classes (>= 1).

    Returns:
        ``int64 [num_clients, num_classes]``; entry ``[c, k]`` counts client ``c``'s examples of class
        ``k``.

    Raises:
        ValueError: If ``num_classes`` is not a positive integer, ``labels`` is not a 1-D integer array
            with values in range, or the partition is malformed.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer; got {num_classes!r}.")
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"labels must be a non-empty 1-D integer array; got shape {labels.shape}, dtype {labels.dtype}."
        )
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(
            f"labels must lie in [0, num_classes) = [0, {num_classes}); found min {labels.min()}, "
            f"max {labels.max()}."
        )
    if isinstance(client_partition, np.ndarray) and client_partition.ndim == 2:
        client_partition = list(client_partition)
    if not isinstance(client_partition, Sequence) or len(client_partition) == 0:
        raise ValueError("client_partition must be a non-empty list of 1-D integer index arrays.")
    parts = []
    for c, part in enumerate(client_partition):
        arr = np.asarray(part)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"client_partition[{c}] must be a 1-D integer index array.")
        if arr.size and (arr.min() < 0 or arr.max() >= labels.size):
            raise ValueError(f"client_partition[{c}] has indices outside [0, {labels.size}).")
        parts.append(arr.astype(np.int64))
    sizes = np.array([p.size for p in parts], dtype=np.int64)
    rows = np.repeat(np.arange(len(parts)), sizes)
    flat = np.concatenate(parts) if sizes.sum() else np.zeros(0, dtype=np.int64)
    counts = np.bincount(rows * num_classes + labels[flat], minlength=len(parts) * num_classes)
    return counts.reshape(len(parts), num_classes).astype(np.int64)
