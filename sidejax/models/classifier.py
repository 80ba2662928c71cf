"""The contract every ``sidejax`` model follows, and the dense stack the models end in.

A :class:`Classifier` maps inputs ``[batch, *input_shape]`` to outputs ``[batch, num_classes]`` and has
only a ``params`` collection, so ``module.apply({"params": params}, x, train=...)`` (the ``apply_fn`` of
the federated-learning engine, which passes ``train=True`` in local training and ``train=False`` in
evaluation) is a pure function of the parameters. A model states its layers once, in
:meth:`Classifier.logits`; ``__call__`` is shared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax

__all__ = ["Classifier", "dense_stack", "flatten"]


def flatten(x: jax.Array) -> jax.Array:
    """Flattens all but the leading (batch) axis."""
    return x.reshape((x.shape[0], -1))


def dense_stack(
    x: jax.Array,
    widths: Sequence[int],
    num_classes: int,
    activation: Callable[[jax.Array], jax.Array] = nn.relu,
) -> jax.Array:
    """Flatten, then ``Dense(w) - activation`` for each ``w`` in ``widths``, then ``Dense(num_classes)``.

    Called from a module's :meth:`Classifier.logits` (which runs inside the compact ``__call__``), so the
    layers belong to that module and are named ``fc1, ..., fc{len(widths) + 1}`` in order. Parameters:
    ``d * w_1 + w_1`` for the first layer on a flattened input of size ``d``, ``w_i * w_{i+1} + w_{i+1}``
    for each next one.
    """
    x = flatten(x)
    for i, width in enumerate(widths):
        x = activation(nn.Dense(width, name=f"fc{i + 1}")(x))
    return nn.Dense(num_classes, name=f"fc{len(widths) + 1}")(x)


class Classifier(nn.Module):
    """Base of the ``sidejax`` models: ``[batch, *input_shape] -> [batch, num_classes]``.

    Subclasses declare a ``num_classes`` attribute (and any others) and implement :meth:`logits`; their
    docstrings give the layer table for their default input shape.
    """

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Computes logits (or, for a regression model, predictions).

        Args:
            x: Inputs of shape ``[batch, *input_shape]``.
            train: Unused: no ``sidejax`` model has layers that behave differently in training and
                evaluation (no dropout; :class:`~sidejax.models.ResNet18`'s normalisations use the
                current batch in both).

        Returns:
            Array of shape ``[batch, num_classes]``.
        """
        del train
        return self.logits(x)

    def logits(self, x: jax.Array) -> jax.Array:
        """The model's layers, ``[batch, *input_shape] -> [batch, num_classes]``.

        Runs inside the compact ``__call__``, so submodules created here (with explicit names) belong to
        the model.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement logits(x)")
