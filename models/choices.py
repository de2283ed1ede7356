"""Config fields that take one of a fixed set of values are typed `Literal[...]`: jsonargparse lists the
values in --help and rejects any other when it parses a command line or YAML file. `check_choices`
gives a config built in Python the same check, from the same types, so the allowed values are written
once, in the type."""

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal


def check_choices(config: Any) -> None:
    """Raises ValueError naming the field, its value and the allowed values if a field of dataclass
    `config` typed Literal[...] (or Literal[...] | None, or dict[str, Literal[...]]) holds another value."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        _check(f"{type(config).__name__}.{field.name}", getattr(config, field.name), hints[field.name])


def _check(where: str, value: Any, hint: Any) -> None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{where}={value!r} is not one of {', '.join(map(str, args))}")
    elif origin in (typing.Union, types.UnionType):  # X | None: X's check, unless None
        options = [option for option in args if option is not type(None)]
        if len(options) == 1 and value is not None:
            _check(where, value, options[0])
    elif origin is dict and isinstance(value, Mapping):
        for key, item in value.items():
            _check(f"{where}[{key!r}]", item, args[1])
