"""Name-based registry of the ``sidejax`` models.

Example:
    >>> import jax
    >>> from sidejax.models import get_model, init_params, count_params
    >>> spec = get_model("lenet5")
    >>> params = init_params(jax.random.key(0), spec)
    >>> count_params(params) == spec.num_params == 61_706
    True
    >>> logits = spec.module.apply({"params": params}, jax.numpy.zeros((2, *spec.input_shape)))
    >>> logits.shape
    (2, 10)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sidejax.keys import MODEL, stream_key
from sidejax.models.cnn import CEPAMCNN, BPCFLConvNet, Conv4, Conv6, KLMSLeNet, LeNet5
from sidejax.models.mlp import MLP, MoonsMLP, RegressionMLP
from sidejax.models.resnet import ResNet18

__all__ = ["ModelSpec", "MODELS", "ALIASES", "get_model", "init_params", "count_params"]

_MNIST_SHAPE = (28, 28, 1)
_CIFAR_SHAPE = (32, 32, 3)


class ModelSpec(NamedTuple):
    """A model together with the data it expects.

    Attributes:
        name: Canonical registry name (aliases resolve to it, e.g. ``"4cnn"`` ->
            ``"conv4"``).
        module: The Flax linen module (``params`` collection only).
        input_shape: Per-example input shape, e.g. ``(28, 28, 1)``.
        num_params: Documented parameter count (weights and biases) for the
            default input shape and number of classes; ``None`` when
            ``num_classes`` or ``input_shape`` differ from the defaults.
    """

    name: str
    module: nn.Module
    input_shape: tuple[int, ...]
    num_params: int | None


class _Entry(NamedTuple):
    build: Callable[[int], nn.Module]
    input_shape: tuple[int, ...]
    num_classes: int
    num_params: int


_REGISTRY: dict[str, _Entry] = {
    "lenet5": _Entry(lambda n: LeNet5(num_classes=n), _MNIST_SHAPE, 10, 61_706),
    "conv4": _Entry(lambda n: Conv4(num_classes=n), _MNIST_SHAPE, 10, 1_933_258),
    "conv6": _Entry(lambda n: Conv6(num_classes=n), _CIFAR_SHAPE, 10, 2_262_602),
    "klms_lenet": _Entry(lambda n: KLMSLeNet(num_classes=n), _MNIST_SHAPE, 10, 431_080),
    "resnet18": _Entry(lambda n: ResNet18(num_classes=n), _CIFAR_SHAPE, 10, 11_173_962),
    "mlp_100": _Entry(lambda n: MLP(features=(100,), num_classes=n), _MNIST_SHAPE, 10, 79_510),
    "mlp_32_16": _Entry(lambda n: MLP(features=(32, 16), num_classes=n), _MNIST_SHAPE, 10, 25_818),
    "cepam_cnn": _Entry(lambda n: CEPAMCNN(num_classes=n), _MNIST_SHAPE, 10, 6_422),
    "bpcfl_convnet": _Entry(lambda n: BPCFLConvNet(num_classes=n), _MNIST_SHAPE, 62, 1_206_590),
    "moons_mlp": _Entry(lambda n: MoonsMLP(num_classes=n), (2,), 2, 3_002),
    "regression_mlp": _Entry(lambda n: RegressionMLP(num_classes=n), (1,), 1, 16_897),
}

#: Alternative names, mapped to canonical registry names.
ALIASES: dict[str, str] = {"4cnn": "conv4", "6cnn": "conv6"}

#: Every name accepted by :func:`get_model` (canonical names, then aliases).
MODELS: tuple[str, ...] = (*_REGISTRY, *ALIASES)


def get_model(
    name: str,
    *,
    num_classes: int | None = None,
    input_shape: tuple[int, ...] | None = None,
) -> ModelSpec:
    """Builds a registered model.

    Args:
        name: One of :data:`MODELS` (case-insensitive).
        num_classes: Number of outputs; defaults to the model's own (10, or 62
            for ``bpcfl_convnet``, 2 for ``moons_mlp``, 1 for
            ``regression_mlp``).
        input_shape: Per-example input shape; defaults to ``(28, 28, 1)`` for
            the MNIST models, ``(32, 32, 3)`` for ``conv6``/``resnet18``,
            ``(2,)`` for ``moons_mlp`` and ``(1,)`` for ``regression_mlp``.
            The MLPs accept any shape (inputs are flattened).

    Returns:
        A :class:`ModelSpec`. Its ``num_params`` is the documented count when
        both ``num_classes`` and ``input_shape`` equal the defaults, else
        ``None``.

    Raises:
        ValueError: If ``name`` is unknown, ``num_classes < 1``,
            ``input_shape`` is not a tuple of positive integers, or the model
            cannot take inputs of ``input_shape`` (e.g. ``lenet5`` on 8x8
            digits: its convolutions and pools leave nothing); the message
            lists the models that fit. Checked abstractly with
            :func:`jax.eval_shape` when ``input_shape`` is not the default.
    """
    key = name.lower() if isinstance(name, str) else name
    key = ALIASES.get(key, key)
    if key not in _REGISTRY:
        raise ValueError(f"Unknown model {name!r}; valid names are: {', '.join(MODELS)}")
    entry = _REGISTRY[key]

    if num_classes is None:
        num_classes = entry.num_classes
    if isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got num_classes={num_classes!r}")
    num_classes = int(num_classes)

    if input_shape is None:
        input_shape = entry.input_shape
    try:
        input_shape = tuple(int(d) for d in input_shape)
    except TypeError as err:
        raise ValueError(f"input_shape must be a tuple of positive integers, got {input_shape!r}") from err
    if not input_shape or any(d < 1 for d in input_shape):
        raise ValueError(f"input_shape must be a tuple of positive integers, got {input_shape!r}")

    if input_shape != entry.input_shape:
        problem = _input_problem(key, num_classes, input_shape)
        if problem is not None:
            fits = [n for n in _REGISTRY if _input_problem(n, num_classes, input_shape) is None]
            raise ValueError(
                f"model {key!r} does not fit inputs of shape {input_shape} (it is built for "
                f"{entry.input_shape}): {problem}. models that fit {input_shape}: {', '.join(fits) or 'none'}"
            )

    is_default = num_classes == entry.num_classes and input_shape == entry.input_shape
    return ModelSpec(
        name=key,
        module=entry.build(num_classes),
        input_shape=input_shape,
        num_params=entry.num_params if is_default else None,
    )


@functools.lru_cache(maxsize=256)
def _input_problem(name: str, num_classes: int, input_shape: tuple[int, ...]) -> str | None:
    """Why model ``name`` cannot take one example of ``input_shape``, or ``None`` if it can.

    Traces the model's initialisation and forward pass abstractly (:func:`jax.eval_shape`: no parameters are
    allocated, nothing runs) and checks that the logits have shape ``(1, num_classes)``. An input too small
    for a CNN's convolutions and pools (e.g. LeNet5 on 8x8 digits) leaves a zero-sized feature map, which
    fails here instead of deep inside initialisation.
    """
    module = _REGISTRY[name].build(num_classes)
    x = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
    try:
        logits, _ = jax.eval_shape(module.init_with_output, jax.random.key(0), x)
    except Exception as err:  # noqa: BLE001 - any failure means it does not fit; the cause is reported
        cause = f"{type(err).__name__}: {err}".split("\n")[0][:300]
        if isinstance(err, ZeroDivisionError):  # a zero-sized feature map reaches a Dense layer's init
            cause += " (the input is too small for its convolutions and pooling)"
        return cause
    if logits.shape != (1, num_classes):
        return f"its output has shape {logits.shape[1:]} per example, not ({num_classes},)"
    return None


def init_params(key: jax.Array, spec: ModelSpec) -> Any:
    """Initialises the parameters of ``spec.module``.

    Works under :func:`jax.eval_shape` to get shapes without allocating:
    ``jax.eval_shape(init_params, key, spec)`` is not possible because ``spec``
    is not an array, so close over it instead:
    ``jax.eval_shape(lambda k: init_params(k, spec), key)``.

    Args:
        key: A PRNG key, e.g. a run's ``init_key`` (:func:`sidejax.keys.run_keys`).
        spec: The model specification.

    Returns:
        The ``params`` pytree: ``module.init(stream_key(key, MODEL), zeros((1, *input_shape)))["params"]``.
        Flax folds hashes of module paths into the key it is given; taking them below the ``MODEL`` tag
        keeps them apart from every other stream of ``key`` (e.g. an algorithm's own init streams, which
        :func:`sidejax.keys` derives from the same ``init_key``).
    """
    dummy = jnp.zeros((1, *spec.input_shape), jnp.float32)
    return spec.module.init(stream_key(key, MODEL), dummy)["params"]


def count_params(params: Any) -> int:
    """Counts scalar parameters in a pytree.

    Args:
        params: A pytree of arrays, or of :class:`jax.ShapeDtypeStruct` (e.g.
            from :func:`jax.eval_shape`).

    Returns:
        The total number of elements over all leaves.
    """
    return sum(math.prod(np.shape(leaf)) for leaf in jax.tree_util.tree_leaves(params))
