"""The checks the option records share, each raising with the record, field and value named."""

from __future__ import annotations

from typing import Any


def need_int(record: str, name: str, value: Any, low: int, *, optional: bool = False) -> None:
    """``value`` is an int (not a bool) >= ``low``, or None when ``optional``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        none = "None or " if optional else ""
        raise ValueError(f"{record}({name}={value!r}): must be {none}an int >= {low}")


def need_choice(record: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{record}({name}={value!r}): must be one of {choices}")


def need_type(record: str, name: str, value: Any, kind: type | tuple[type, ...], *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise TypeError(f"{record}({name}={value!r}): must be {'None or ' if optional else ''}a {names}, "
                        f"got {type(value).__name__}")
