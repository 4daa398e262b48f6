"""``moe train --config run.toml``: every option of ``moe train`` as a TOML key, in the section
of its ``--help`` group, named as the option with underscores::

    [model]
    preset = "small"
    router = "base"
    [data]
    seq_len = 128
    [optimiser]
    lr = 3e-3
    [run]
    out = "runs/demo"
    [layout]
    layout = "tp=2,ep=2"        # or nproc, tp, ep, ... one by one

A value is checked as the option checks it (its type, its range, its choices); an unknown
section or key, or a wrong type, is an error naming the key and the file.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

__all__ = ["read_config", "sections"]


def sections(parser: argparse.ArgumentParser) -> dict[str, dict[str, argparse.Action]]:
    """{section: {key: action}} of the train parser: the first word of each group's title."""
    out: dict[str, dict[str, argparse.Action]] = {}
    for group in parser._action_groups:
        name = (group.title or "").split()[0].lower()
        actions = {a.dest: a for a in group._group_actions if a.option_strings and a.dest not in ("help", "config")}
        if actions and name not in ("options", "optional", "positional"):
            out[name] = actions
    return out


def _what(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), type(value).__name__
    )


def _check(action: argparse.Action, value, where: str):
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r} ({_what(value)})")
        return value
    kind = action.type
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where} must be a number, got {value!r} ({_what(value)})")
        return float(value)
    if kind is not None:  # int, or one of the command's positive-int parsers
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, got {value!r} ({_what(value)})")
        try:
            return kind(str(value))
        except argparse.ArgumentTypeError as err:
            raise ValueError(f"{where}: {err}") from None
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {value!r} ({_what(value)})")
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where} must be one of {sorted(action.choices)}, got {value!r}")
    return value


def read_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """The options of a TOML file, checked against the train parser; {dest: value}."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"--config {path}: cannot be read ({err.strerror})") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--config {path}: not valid TOML ({err})") from None
    known = sections(parser)
    out: dict = {}
    for section, table in data.items():
        if section not in known or not isinstance(table, dict):
            raise ValueError(f"--config {path}: unknown section [{section}]; sections: {', '.join(known)}")
        for key, value in table.items():
            if key not in known[section]:
                other = next((s for s, keys in known.items() if key in keys), None)
                hint = f" (it belongs in [{other}])" if other else ""
                raise ValueError(f"--config {path}: unknown key {key!r} in [{section}]{hint}")
            out[key] = _check(known[section][key], value, f"--config {path}: [{section}] {key}")
    return out
