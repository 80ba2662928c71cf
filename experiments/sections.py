"""Typed configuration sections: the base of the ``[run]``, ``[data]``, ``[method]`` and ``[coder]`` tables.

A section is a frozen dataclass whose fields are the keys of its TOML table and, as ``--<table>.<field>``,
the command line's flags. Field types are ``int``, ``float``, ``bool``, ``str``, one of them ``| None``
(``None`` means "not set"; a field is never given a magic 0), or a list of one of them, written
``tuple[float, ...]`` (a TOML array, several values after the flag; a single value is read as a list of one).
A field with a fixed set of values declares it with :func:`choice`; each section checks its values in
``__post_init__`` and raises ``ValueError`` naming the field. The ``Attributes:`` section of a docstring is
the help text of its fields (:meth:`Section.field_docs`).

A method or coder section does not restate the settings type of :mod:`sidejax` it fills: :func:`fills`
generates its fields (names, types, defaults and help) from that NamedTuple or dataclass, and
:meth:`Section.library_value` builds the library's value from them. By hand a section adds only what the
library type cannot carry as a scalar (an optimizer's name and learning rate where the library takes an
Optax object) and the experiment's own fields.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

__all__ = ["Section", "FieldType", "by_name", "choice", "fills", "field_type", "coerce_value", "parse_word"]

_SCALARS = (bool, int, float, str)


def by_name(*sections: type) -> dict[str, type]:
    """A table's section classes by their ``name`` (the TOML ``name`` that picks one), in the given order;
    ``ValueError`` names a name two of them claim."""
    table: dict[str, type] = {}
    for section in sections:
        if section.name in table:
            raise ValueError(
                f"{section.__name__} and {table[section.name].__name__} are both named {section.name!r}"
            )
        table[section.name] = section
    return table


def choice(default: Any, choices: tuple[str, ...]) -> Any:
    """A dataclass field with a fixed set of values (checked by :class:`Section`, listed by ``--help``)."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


class FieldType(NamedTuple):
    """A field's scalar type, whether it may be ``None`` and whether it is a list of such scalars."""

    base: type
    optional: bool
    many: bool = False


def _parse_hint(hint: Any) -> FieldType | None:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    optional = union and len(args) != len(typing.get_args(hint))
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return FieldType(args[0], False, True) if args[0] in _SCALARS else None
    base = args[0] if optional and len(args) == 1 else hint
    return FieldType(base, optional) if base in _SCALARS else None


@functools.cache
def _type_hints(cls: type) -> Mapping[str, Any]:
    """``typing.get_type_hints(cls)``, evaluated once per class (read-only): it compiles every annotation's
    string anew (this module's ``from __future__ import annotations``), and once per field of every section
    built it was most of the time of reading a config (measured: 29,382 calls, 20 s of a profile of loading
    and round-tripping the presets)."""
    return types.MappingProxyType(typing.get_type_hints(cls))


def field_type(cls: type, name: str) -> FieldType:
    """The :class:`FieldType` of field ``name`` of the dataclass ``cls`` (``int | None`` gives
    ``(int, True, False)``, ``tuple[float, ...]`` ``(float, False, True)``)."""
    hint = _type_hints(cls)[name]
    kind = _parse_hint(hint)
    if kind is None:
        raise TypeError(f"{cls.__name__}.{name}: unsupported field type {hint!r}")
    return kind


def _type_name(kind: FieldType) -> str:
    return ("a list of " if kind.many else "") + kind.base.__name__ + (" or null" if kind.optional else "")


def _scalar(base: type, value: Any) -> Any:
    if base is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    raise TypeError


def coerce_value(cls: type, name: str, value: Any) -> Any:
    """``value`` checked against the type of field ``name`` of ``cls`` (an int is accepted for a float; a
    list field takes a list or a single value, stored as a tuple).

    Raises:
      TypeError: the value has the wrong type (the message says which type is expected).
    """
    kind = field_type(cls, name)
    if value is None and kind.optional:
        return None
    try:
        if kind.many:
            return tuple(
                _scalar(kind.base, v) for v in (value if isinstance(value, list | tuple) else [value])
            )
        return _scalar(kind.base, value)
    except TypeError:
        raise TypeError(f"must be {_type_name(kind)}, got {value!r}") from None


def parse_word(base: type, optional: bool, text: str) -> Any:
    """One command-line word as a ``base`` scalar: ``none`` for an ``optional`` field's "not set", a bool from
    true/false, yes/no, on/off or 1/0. Raises ``ValueError`` saying what was expected."""
    if optional and text.lower() == "none":
        return None
    if base is bool:
        if text.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return text.lower() in ("1", "true", "yes", "on")
        raise ValueError(f"expected true/false, got {text!r}")
    try:
        return base(text)
    except ValueError:
        raise ValueError(f"expected {base.__name__}, got {text!r}") from None


def _library_defaults(library: type) -> dict[str, Any]:
    if dataclasses.is_dataclass(library):
        return {
            f.name: f.default for f in dataclasses.fields(library) if f.default is not dataclasses.MISSING
        }
    return dict(library._field_defaults)


def fills(
    library: type,
    *,
    skip: tuple[str, ...] = (),
    rename: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    choices: Mapping[str, tuple[str, ...]] | None = None,
):
    """Class decorator (under ``@dataclass``): the section fills the library settings type ``library``.

    Every field of ``library`` not in ``skip`` becomes a field of the section, named as in the library
    (or ``rename[library name]``), with the library's type and default (or ``defaults[section name]``,
    needed where the library has none), a :func:`choice` where ``choices`` names one, and the library's
    ``Attributes:`` line as help (:meth:`Section.field_docs`). A field the section declares itself keeps
    its declaration (a different default or doc). A non-scalar library field (an Optax optimizer) must be
    skipped: the section supplies it to :meth:`Section.library_value`.
    """
    rename, defaults, choices = dict(rename or {}), dict(defaults or {}), dict(choices or {})

    def wrap(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        lib_defaults, added, names = _library_defaults(library), {}, {}
        for lib_name, hint in typing.get_type_hints(library).items():
            if lib_name in skip:
                continue
            name = rename.get(lib_name, lib_name)
            names[name] = lib_name
            if name in own:
                continue
            if _parse_hint(hint) is None:
                raise TypeError(f"{cls.__name__}: {library.__name__}.{lib_name} is not a scalar; skip it")
            if name not in defaults and lib_name not in lib_defaults:
                raise TypeError(f"{cls.__name__}: {library.__name__}.{lib_name} has no default; give one")
            default = defaults.get(name, lib_defaults.get(lib_name))
            added[name] = hint
            setattr(cls, name, choice(default, choices[name]) if name in choices else default)
        cls.__annotations__ = {**added, **own}
        cls.libraries = {**getattr(cls, "libraries", {}), library: names}
        return cls

    return wrap


def _docstring_attributes(text: str, names: Mapping[str, str]) -> dict[str, str]:
    """``{section name: help}`` from the ``Attributes:`` section of ``text``; ``names`` maps a documented
    name to the field's (an entry ``a, b: ...`` documents both)."""
    docs: dict[str, str] = {}
    current: list[str] = []
    for line in text.split("Attributes:", 1)[-1].splitlines() if "Attributes:" in text else []:
        m = re.match(r"^      (\w+(?:, \w+)*): (.*)$", line)
        if m:
            current = [names[n] for n in m.group(1).split(", ") if n in names]
            for name in current:
                docs[name] = m.group(2).strip()
        elif current and line.startswith("        "):
            for name in current:
                docs[name] += " " + line.strip()
        elif line.strip():
            current = []
    return docs


def _within(value: float, rule: str) -> bool:
    """Whether ``value`` satisfies a :attr:`Section.limits` rule (NaN satisfies none)."""
    if m := re.fullmatch(r"(>=|>) (\S+)", rule):
        return value >= float(m[2]) if m[1] == ">=" else value > float(m[2])
    m = re.fullmatch(r"in ([(\[])(\S+), (\S+)([)\]])", rule)
    if m is None:
        raise ValueError(f"unknown limit rule {rule!r}")
    low, high = float(m[2]), float(m[3])
    return (low <= value if m[1] == "[" else low < value) and (value <= high if m[4] == "]" else value < high)


@dataclass(frozen=True)
class Section:
    """Base of a configuration section (a frozen dataclass of scalar and list fields).

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
    #: ``{library settings type: {section field: library field}}``, set by :func:`fills`
    libraries: ClassVar[dict[type, dict[str, str]]] = {}
    #: ``{rule: "field field ..."}``: the range of number fields (every value of a list field), checked for
    #: the class and its subclasses (an unset field passes); a rule is ``">= x"``, ``"> x"`` or an interval
    #: ``"in (a, b]"`` with any brackets (``inf`` allowed), and the error says the field "must be <rule>"
    limits: ClassVar[Mapping[str, str]] = {}

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
        for name, rule in self.field_limits().items():
            value = getattr(self, name)
            if value is not None and not all(
                _within(v, rule) for v in (value if isinstance(value, tuple) else [value])
            ):
                raise ValueError(f"{self.label()}: {name} must be {rule}; got {value!r}")
        self.check()

    def check(self) -> None:
        """Value checks beyond types and choices (raise ``ValueError`` via :meth:`require`)."""

    def require(self, ok: bool, name: str, rule: str) -> None:
        """Raises ``ValueError`` naming the field ``name`` and its value unless ``ok``."""
        if not ok:
            raise ValueError(f"{self.label()}: {name} {rule}; got {getattr(self, name)!r}")

    def library_value(self, library: type, **extra: Any) -> Any:
        """The ``library`` settings value (a type this section :func:`fills`) of these fields, with
        ``extra`` for the library fields the section does not carry. An unset (``None``) field whose
        library field has a default leaves that default."""
        lib_defaults = _library_defaults(library)
        values = {
            lib: getattr(self, name)
            for name, lib in self.libraries[library].items()
            if getattr(self, name) is not None or lib not in lib_defaults
        }
        return library(**values, **extra)

    def checked_library_value(self, library: type, **extra: Any) -> Any:
        """:meth:`library_value`, its ``ValueError`` (the library's own validation) naming this section."""
        return self.relabel(self.library_value, library, **extra)

    def relabel(self, fn, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (a library check), its ``ValueError`` prefixed with this section's
        :meth:`label`."""
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            raise ValueError(f"{self.label()}: {e}") from None

    @classmethod
    def field_limits(cls) -> dict[str, str]:
        """``{field: rule}`` of the :attr:`limits` of the class and its bases (a subclass's rule wins; a
        base may name fields that only some subclasses have)."""
        rules: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            for rule, names in klass.__dict__.get("limits", {}).items():
                rules.update(dict.fromkeys(names.split(), rule))
        return {name: rule for name, rule in rules.items() if name in cls.field_names()}

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
        """One line of help per field: the ``Attributes:`` line of the library type a field fills, unless
        the class or a base documents the field itself."""
        docs: dict[str, str] = {}
        fields = {name: name for name in cls.field_names()}
        for library, names in cls.libraries.items():
            docs.update(_docstring_attributes(library.__doc__ or "", {v: k for k, v in names.items()}))
        for klass in reversed(cls.__mro__):
            docs.update(_docstring_attributes(klass.__dict__.get("__doc__") or "", fields))
        return {
            k: re.sub(r":\w+:`~?([^`]*)`", r"\1", v).replace("``", "").replace("\\", "")
            for k, v in docs.items()
        }

    def to_dict(self) -> dict[str, Any]:
        """The fields (``None`` for unset ones, lists as lists), with ``name`` first for a named section."""
        name = getattr(type(self), "name", None)
        head = {"name": name} if isinstance(name, str) else {}
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**head, **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}}
