"""The command line's argparse pieces, shared by ``portable-ssm`` and ``portable-ssm bench``: a parser
whose errors are one ``error:`` line with status 2, and option types that refuse impossible values
before anything runs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

#: Exit status of every reported error, as argparse uses for a bad option.
ERROR_STATUS = 2


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are the command line's one ``error:`` line, status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(ERROR_STATUS, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def count(low: int) -> Callable[[str], int]:
    """An argparse type: an int ``>= low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


def number(low: float, high: float, *, low_open: bool) -> Callable[[str], float]:
    """An argparse type: a finite float in ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {interval}, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a number in {interval}, got {text}")
        return value
    return parse


def nonempty_path(text: str) -> str:
    """An argparse type: a non-empty path."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got ''")
    return text
