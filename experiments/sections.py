"""Typed configuration sections: the base of the ``[run]``, ``[data]``, ``[method]`` and ``[coder]`` tables.

A section is a frozen dataclass whose fields are the keys of its TOML table and, as ``--<table>.<field>``,
the command line's flags. Field types are ``int``, ``float``, ``bool``, ``str`` or one of them ``| None``
(``None`` means "not set"; a field is never given a magic 0). A field with a fixed set of values declares it
with :func:`choice`; each section checks its values in ``__post_init__`` and raises ``ValueError`` naming the
field. The ``Attributes:`` section of a class's docstring is the help text of its fields
(:meth:`Section.field_docs`).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Section", "choice", "field_type", "coerce_value"]

_SCALARS = (bool, int, float, str)


def choice(default: Any, choices: tuple[str, ...]) -> Any:
    """A dataclass field with a fixed set of values (checked by :class:`Section`, listed by ``--help``)."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


def field_type(cls: type, name: str) -> tuple[type, bool]:
    """``(scalar type, optional)`` of field ``name`` of the dataclass ``cls`` (``int | None`` gives
    ``(int, True)``)."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = len(args) != len(typing.get_args(hint))
    base = args[0] if args else hint
    if base not in _SCALARS or len(args) > 1:
        raise TypeError(f"{cls.__name__}.{name}: unsupported field type {hint!r}")
    return base, optional


def _type_name(base: type, optional: bool) -> str:
    return base.__name__ + (" or null" if optional else "")


def coerce_value(cls: type, name: str, value: Any) -> Any:
    """``value`` checked against the type of field ``name`` of ``cls`` (an int is accepted for a float).

    Raises:
      TypeError: the value has the wrong type (the message says which type is expected).
    """
    base, optional = field_type(cls, name)
    if value is None and optional:
        return None
    if base is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    raise TypeError(f"must be {_type_name(base, optional)}, got {value!r}")


@dataclass(frozen=True)
class Section:
    """Base of a configuration section (a frozen dataclass of scalar fields).

    Subclasses set :attr:`table` (the TOML table, ``run``/``data``/``method``/``coder``), may declare
    :attr:`conditional` fields, add value checks in :meth:`check`, and combine given values with a base in
    :meth:`merge` (e.g. giving ``local_steps`` unsets ``local_epochs``).
    """

    table: ClassVar[str] = ""
    #: ``{field: (controlling field, its values where the field applies, required there)}``: an optional
    #: field that only applies for some values of another (``c_max`` only with ``partition`` ``shards`` or
    #: ``klms_noniid``). Set elsewhere it is an error; where it is required, leaving it unset is one. When
    #: :meth:`merge` is given a new controlling value without the field, a base value that no longer
    #: applies is dropped.
    conditional: ClassVar[dict[str, tuple[str, tuple[str, ...], bool]]] = {}

    def __post_init__(self):
        for f in dataclasses.fields(self):
            try:
                value = coerce_value(type(self), f.name, getattr(self, f.name))
            except TypeError as e:
                raise ValueError(f"{self.label()}: {f.name} {e}") from None
            object.__setattr__(self, f.name, value)  # an int given for a float field is stored as a float
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"{self.label()}: {f.name} must be one of {', '.join(choices)}; "
                    f"got {getattr(self, f.name)!r}"
                )
        for name, (ctrl, values, required) in self.conditional.items():
            value, by = getattr(self, name), getattr(self, ctrl)
            if by in values and required and value is None:
                raise ValueError(f"{self.label()}: {ctrl} {by!r} needs {name}")
            if by not in values and value is not None:
                raise ValueError(
                    f"{self.label()}: {name} is only used with {ctrl} {' or '.join(map(repr, values))}; got "
                    f"{name}={value!r} with {ctrl}={by!r}"
                )
        self.check()

    def check(self) -> None:
        """Value checks beyond types and choices (raise ``ValueError`` via :meth:`require`)."""

    def require(self, ok: bool, name: str, rule: str) -> None:
        """Raises ``ValueError`` naming the field ``name`` and its value unless ``ok``."""
        if not ok:
            raise ValueError(f"{self.label()}: {name} {rule}; got {getattr(self, name)!r}")

    @classmethod
    def label(cls) -> str:
        """How messages name the section: ``[run]``, or ``method 'fedpm'`` for a named one."""
        name = getattr(cls, "name", None)
        return f"{cls.table} {name!r}" if isinstance(name, str) else f"[{cls.table}]"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The fields' default values."""
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def choices(cls, name: str) -> tuple[str, ...] | None:
        return next(f.metadata.get("choices") for f in dataclasses.fields(cls) if f.name == name)

    @classmethod
    def merge(cls, base: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
        """The field values when ``given`` (a preset's table, command-line flags) is applied on ``base``
        (defaults, or a config being overridden). Plain update here; subclasses unset fields that the given
        ones replace (see :attr:`conditional`)."""
        merged = {**base, **given}
        for name, (ctrl, values, _) in cls.conditional.items():
            if ctrl in given and name not in given and merged[ctrl] not in values:
                merged[name] = None
        return merged

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """One line of help per field, from the ``Attributes:`` sections of the class and its bases."""
        docs: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            text = (klass.__dict__.get("__doc__") or "").split("Attributes:", 1)
            if len(text) < 2:
                continue
            name = None
            for line in text[1].splitlines():
                m = re.match(r"^      (\w+): (.*)$", line)
                if m and m.group(1) in cls.field_names():
                    name = m.group(1)
                    docs[name] = m.group(2).strip()
                elif name and line.startswith("        "):
                    docs[name] += " " + line.strip()
                elif line.strip():
                    name = None
        return {k: re.sub(r":\w+:`~?([^`]*)`", r"\1", v).replace("``", "") for k, v in docs.items()}

    def to_dict(self) -> dict[str, Any]:
        """The fields (``None`` for unset ones), with ``name`` first for a named section."""
        name = getattr(type(self), "name", None)
        head = {"name": name} if isinstance(name, str) else {}
        return {**head, **dataclasses.asdict(self)}
