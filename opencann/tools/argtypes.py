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


def positive_float(text: str) -> float:
    """A finite float > 0 (sampling temperature, repetition penalty)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return v


def probability(text: str) -> float:
    """A float in (0, 1] (nucleus sampling's top-p)."""
    v = positive_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def nonnegative_int(text: str) -> int:
    """An int >= 0 (top-k, where 0 turns it off; seeds)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {v}")
    return v
