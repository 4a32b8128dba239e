"""Typed config trees: build nested dataclasses from plain dicts, with errors that name the key.

Every component owns a small dataclass beside its code and checks its values in `__post_init__`
with `check(...)`; `plait/config.py` composes them into one tree. This module only knows how to
turn a dict (YAML plus `key=value` overrides) into such a tree and back. It does not know plait's
keys, so it is also what component tests use to build a single config.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin


class ConfigError(ValueError):
    """A bad config key, type or value. `key` is the dotted path once the tree builder sees it.
    `partial`: the config built with the bad keys at their defaults, when one builds (load_config sets
    it), so the checks that need a built config (files, model dirs) report in the same pass."""

    partial: Any = None

    def __init__(self, key: str, value: Any, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"{key}={value!r}: {expected}")

    def under(self, prefix: str) -> "ConfigError":
        return ConfigError(f"{prefix}.{self.key}" if prefix else self.key, self.value, self.expected)


class ConfigErrors(ConfigError):
    """Several config errors found in one pass, reported together; `key`/`value`/`expected` are the first's."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = [e for err in errors for e in (err.errors if isinstance(err, ConfigErrors) else [err])]
        first = self.errors[0]
        ValueError.__init__(self, "\n".join(str(e) for e in self.errors))
        self.key, self.value, self.expected = first.key, first.value, first.expected

    def under(self, prefix: str) -> "ConfigError":
        return ConfigErrors([e.under(prefix) for e in self.errors])


def raise_all(errors: list[ConfigError]) -> None:
    """Raise the errors found, if any: one as itself, several as a ConfigErrors."""
    if errors:
        raise errors[0] if len(errors) == 1 else ConfigErrors(errors)


def check(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise a ConfigError for field `key` unless `ok`; used in `__post_init__`."""
    if not ok:
        raise ConfigError(key, value, expected)


def build(cls: type, data: dict | None, prefix: str = "") -> Any:
    """Build dataclass `cls` from `data`, recursing into nested dataclasses.

    Unknown keys name the closest valid key; values are checked against the field's type
    annotation; all such errors of the tree are raised together. `__post_init__` errors get the
    dotted path of their node.
    """
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(prefix or "<root>", data, f"expected a mapping of {cls.__name__} keys")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs, errors = {}, []
    for name, value in data.items():
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1, cutoff=0.5)
            hint = f"unknown key; did you mean '{_join(prefix, close[0])}'?" if close else (
                f"unknown key; valid keys here: {', '.join(sorted(fields))}")
            errors.append(ConfigError(_join(prefix, str(name)), value, hint))
            continue
        try:
            kwargs[name] = _coerce(hints[name], value, _join(prefix, name))
        except ConfigError as err:
            errors.append(err)
    raise_all(errors)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(prefix) from None


def build_without(cls: type, tree: dict, errors: list[ConfigError], rounds: int = 6) -> tuple[list[ConfigError], Any]:
    """`cls` built from `tree` with each erroneous key dropped (its default instead): the errors that were
    hidden behind the first ones (a node's `__post_init__` stops at its first failed check), and the
    config when it builds (None when dropping a key does not clear its error), for checks that need one."""
    import copy
    tree, keys, hidden = copy.deepcopy(tree), {e.key for e in errors}, []
    for _ in range(rounds):
        for err in [*errors, *hidden]:
            _drop(tree, err.key.split("[")[0])
        try:
            return hidden, build(cls, tree)
        except ConfigError as err:
            # a key already reported is not reported again (its default may fail the same check)
            new = [e for e in (err.errors if isinstance(err, ConfigErrors) else [err]) if e.key not in keys]
            if not new:
                return hidden, None
            keys |= {e.key for e in new}
            hidden += new
    return hidden, None


def _drop(tree: dict, key: str) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.get(part) if isinstance(tree, dict) else None
    if isinstance(tree, dict):
        tree.pop(last, None)


def to_dict(node: Any) -> Any:
    """The plain-dict form of a config tree (what `plait config show` prints and checkpoints store)."""
    if dataclasses.is_dataclass(node):
        return {f.name: to_dict(getattr(node, f.name)) for f in dataclasses.fields(node)}
    if isinstance(node, (list, tuple)):
        return [to_dict(v) for v in node]
    if isinstance(node, dict):
        return {k: to_dict(v) for k, v in node.items()}
    return node


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """`value` as the type `tp` (a dataclass, union, Literal, list, dict or scalar), or a ConfigError naming `key`."""
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(key, value, f"must not be null; expected {_name(tp)}")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(key, value, f"expected {_name(tp)}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(key, value, f"expected one of {', '.join(repr(a) for a in args)}")
    if origin in (list, tuple):
        if isinstance(value, str) and args and args[0] is str:  # verl takes one string where a list goes
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, value, f"expected a list ({_name(tp)})")
        item = args[0] if args else Any
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, value, f"expected a mapping ({_name(tp)})")
        if len(args) == 2 and dataclasses.is_dataclass(args[1]):  # named entries of one node type
            return {name: build(args[1], entry, _join(key, str(name))) for name, entry in value.items()}
        return dict(value)
    if tp is Any:
        return value
    return _coerce_scalar(tp, value, key)


def _coerce_scalar(tp: Any, value: Any, key: str) -> Any:
    """A bool, int, float or str leaf: YAML's value checked and, where verl's loader would, converted."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, value, "expected a boolean (true or false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(key, value, "expected an integer")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):  # inf or nan is never a setting
            return number
        raise ConfigError(key, value, "expected a finite number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(key, value, "expected a string")
    return value


def _name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_name(args[0])}" if args else "list"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def shipped_tool_config(path: str | None, folder: str = "tools", ext: str = ".yaml") -> str | None:
    """`calculator` names plait/configs/tools/calculator.yaml (shipped in the package, so a packaged
    preset needs no user path; agents: plait/configs/agents/<name>.py; reward files:
    plait/configs/rewards/<name>.py); an existing path, or a name with no shipped file, is kept as given."""
    shipped = os.path.join(os.path.dirname(__file__), "configs", folder, f"{path}{ext}")
    if path is None or os.path.exists(path) or os.sep in path or not os.path.isfile(shipped):
        return path
    return shipped
