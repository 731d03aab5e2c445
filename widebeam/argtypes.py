"""argparse pieces shared by the command line's subcommands (`cli.py`, `server/serve_cli.py`): the
one-line parser and value types whose errors name the allowed range."""

from __future__ import annotations

import argparse
import math

from widebeam.units import parse_bytes

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage on error; users asked for one line they can read (exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def positive_float(allow_inf: bool = False):
    """An argparse type: a number > 0, finite unless `allow_inf` (`inf` then means "without limit")."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number > 0{' (or inf)' if allow_inf else ''}, "
                                             f"got {text!r}") from None
        if not value > 0 or not (allow_inf or math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a {'' if allow_inf else 'finite '}number > 0, "
                                             f"got {text!r}")
        return value

    return parse


def width_schedule(text: str) -> tuple[int, ...]:
    """A beam-width schedule: comma-separated integer widths >= 1, e.g. `64,256,1024`."""
    parts = [part.strip() for part in text.split(",")]
    try:
        widths = tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integer widths >= 1 (e.g. 64,256,1024), "
                                         f"got {text!r}") from None
    if any(w < 1 for w in widths):
        raise argparse.ArgumentTypeError(f"widths must be >= 1, got {text!r}")
    return widths


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def byte_size(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {text!r}")
    return value
