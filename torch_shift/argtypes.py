"""argparse types the command line's parsers share (`torch-shift` and its `bench` options)."""

from __future__ import annotations

import argparse


def typed(kind):
    """An argparse type that names what it wanted: argparse reports 'invalid int value' with the option's name."""
    def parse(value: str):
        try:
            return kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{'an integer' if kind is int else 'a number'}, got {value!r}") from None
    parse.__name__ = kind.__name__
    return parse


def positive(kind):
    """An argparse type of `kind` (int or float) above 0 (a count, a size or a rate: 0 ran empty work)."""
    parse_number = typed(kind)

    def parse(value: str):
        number = parse_number(value)
        if not number > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {value!r}")
        return number
    parse.__name__ = kind.__name__
    return parse
