"""argparse types shared by the command-line tools: each turns a bad value into one
line naming the option's problem and fix (argparse prefixes the option name)."""
from __future__ import annotations

import argparse
import os


def positive_int(text: str) -> int:
    """An int >= 1 (batch sizes, sequence lengths, runs, threads)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def output_file(text: str) -> str:
    """A path a file can be written to: not a directory, in a directory that exists."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text} is a directory; give a file name, e.g. {os.path.join(text, 'out.json')}")
    parent = os.path.dirname(text) or "."
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"directory {parent} does not exist; create it first")
    return text
