"""The ``moe`` command: ``moe train | generate | export | data | plan | bench``.

Arguments are checked before anything heavy is imported or read; a bad one ends the command
with exit status 2 and a single line naming the option, what it needs and what it got.
``moe.cli.main`` is the entry point; each subcommand's parser and runner live in this
package's modules (`train`, `checks`, `commands`).
"""

from __future__ import annotations

import argparse
import sys

from .checks import _check_train, _check_writable, _run_config
from .commands import (
    _bench,
    _bench_parser,
    _data,
    _data_parser,
    _export,
    _export_parser,
    _generate,
    _generate_parser,
    _plan,
    _plan_parser,
)  # fmt: skip
from .common import UsageError, _Parser
from .train import SHUTDOWN_S, _train, _train_parser

__all__ = [
    "SHUTDOWN_S", "UsageError", "_check_train", "_check_writable", "_explicit", "_config_file", "_run_config",
    "build_parser", "main",
]  # fmt: skip


def _explicit(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The options the command line gives (a resumed run keeps its own values for the rest)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    quiet = _Parser(add_help=False)
    cmd = sub.choices.get(argv[0]) if argv else None
    if cmd is None:
        return set()
    for action in cmd._actions:
        if action.option_strings and action.dest != "help":
            quiet._add_action(_copy_suppressed(action))
    given, _ = quiet.parse_known_args(argv[1:])
    return set(vars(given))


def _config_file(parser: argparse.ArgumentParser, argv: list[str]) -> dict:
    """``moe train --config FILE``: the file's values become the train parser's defaults (so
    flags override them) and count as given; returns them. Its sections are --help's groups
    (model, data, optimiser, run, layout), its keys the options with underscores."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(argv[1:])[0].config
    if path is None:
        return {}
    from ..train.config_file import read_config

    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    try:
        values = read_config(path, train)
    except ValueError as err:
        raise UsageError(str(err)) from None
    train.set_defaults(**values)
    return values


def _copy_suppressed(action):
    import copy

    a = copy.copy(action)
    a.default = argparse.SUPPRESS
    a.required = False
    return a


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moe", description="Mixture-of-Experts models: train, generate, export, data, plan, bench")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for make, run in ((_train_parser, _train), (_generate_parser, _generate), (_export_parser, _export),
                      (_data_parser, _data), (_plan_parser, None), (_bench_parser, _bench)):  # fmt: skip
        make(sub).set_defaults(_run=run)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        return _plan(argv[1:])
    parser = build_parser()
    try:
        from_file = _config_file(parser, argv) if argv[:1] == ["train"] else {}
        args = parser.parse_args(argv)
        args._explicit = _explicit(parser, argv) | set(from_file)
        return args._run(args, parser, argv)
    except UsageError as err:
        print(f"moe {argv[0] if argv else ''}: error: {err}".replace("  ", " "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
