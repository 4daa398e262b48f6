"""What every ``moe`` subcommand's parser shares: the one-line usage error and the option
types. A bad argument ends the command with exit status 2 and a single line naming the option,
what it needs and what it got."""

from __future__ import annotations

import argparse

__all__ = ["UsageError"]


class UsageError(Exception):
    """A bad argument: the command exits 2 with this one-line message."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{message} (see {self.prog} --help)")


def _fmt(prog):
    return argparse.ArgumentDefaultsHelpFormatter(prog, max_help_position=32, width=100)


def _positive(name):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v

    return parse
