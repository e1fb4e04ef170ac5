"""Typed, frozen settings per service, each field overridable by an environment variable.

`load_settings(GatewaySettings, "SPLITFLASH_GATEWAY_", port=9000)` reads defaults from the
dataclass, then SPLITFLASH_GATEWAY_<FIELD> from the environment, then explicit overrides
(command-line flags). A value that does not parse is an error naming the variable.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _parse(raw: str, kind: Any, name: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        if raw.strip().lower() in ("", "none", "null"):
            return None
        return _parse(raw, options[0], name)
    if origin is tuple:
        (inner, *_rest) = typing.get_args(kind)
        return tuple(_parse(p.strip(), inner, name) for p in raw.split(",") if p.strip())
    try:
        if kind is bool:
            if raw.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if raw.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind in (int, float, str):
            return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
    raise TypeError(f"settings field type {kind!r} of {name} is not supported")


def load_settings(cls: type[T], prefix: str, **overrides: Any) -> T:
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        env_name = prefix + field.name.upper()
        if env_name in os.environ:
            values[field.name] = _parse(os.environ[env_name], hints[field.name], env_name)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)


def redacted(settings) -> dict[str, Any]:
    """Settings as a dict fit for logs: secrets (keys, API keys) shown only as set/unset."""
    out = {}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if "secret" in field.name or field.name == "api_keys":
            value = "<set>" if value else "<unset>"
        out[field.name] = value
    return out
