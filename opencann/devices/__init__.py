"""Devices opencann compiles for: the host ``cpu`` and the virtual NPU ``vnpu``.

`parse_device` is the one reader of device strings; everything that takes a device
string (the compiler, the passes, the runtime, acl, estimate) goes through it once, at
its entry point, and carries the `Device` from there on (`PassContext.device`,
``Node.device``): its ``kind``, the string as given, the `NpuSpec` of a vnpu, and
capabilities (storage formats, memory size in bytes, on-chip tile buffer). A `Device`
prints, hashes and compares equal as the string it was parsed from, so reports, logs,
generated code and model files (which store the string) read as before. Device strings:

- ``cpu`` (or ``cpu:0``): the host (`cpu` module: ISA, oneDNN / MKL availability, L2).
- ``vnpu``: the ascend910b preset; ``vnpu:<preset>`` (ascend910, ascend910b, ascend310);
  ``vnpu:<spec file .json|.toml>`` (`vnpu.load_spec`).

This package is the bottom layer: it imports neither the IR nor the op library.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

from . import cpu
from .vnpu import NpuSpec, get_preset, load_spec
from .vnpu.presets import PRESETS

KINDS = ("cpu", "vnpu")            # device kinds the compiler supports
DEFAULT_NPU_PRESET = "ascend910b"  # the chip of a bare ``vnpu``
NPU_FORMATS = ("ND", "NCHW", "NC1HWC0", "FRACTAL_Z", "FRACTAL_NZ")


class DeviceError(ValueError):
    """A device string opencann cannot use. ``reason``: "kind" (not a supported kind),
    "index" (``cpu:<n>`` other than 0), "preset" (``vnpu:<unknown preset>``), "expected"
    (a kind other than the one asked for); ``kind`` and ``preset`` as parsed."""

    def __init__(self, msg: str, reason: str, kind: str = "", preset: str = ""):
        super().__init__(msg)
        self.reason, self.kind, self.preset = reason, kind, preset


@dataclass(frozen=True)
class Device:
    """A parsed device string.

    ``kind``: "cpu" or "vnpu"; ``name``: the string as given (what reports show);
    ``preset``: the text after ``vnpu:`` ("" for a bare ``vnpu`` or the cpu); ``spec``:
    the vnpu's `NpuSpec` (None for the cpu, and for a spec file not loaded).
    """

    kind: str
    name: str
    preset: str = ""
    spec: Optional[NpuSpec] = field(default=None, compare=False)

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other) -> bool:
        if isinstance(other, Device):
            return self.name == other.name
        if isinstance(other, str):
            return self.name == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __copy__(self) -> "Device":
        return self

    def __deepcopy__(self, memo) -> "Device":
        return self   # immutable: graph copies share it

    @property
    def formats(self) -> Tuple[str, ...]:
        """Storage formats tensors may take on this device (format names)."""
        return NPU_FORMATS if self.kind == "vnpu" else cpu.FORMATS

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes: the vnpu preset's HBM, or host RAM."""
        if self.spec is not None:
            return int(self.spec.hbm_bytes)
        return cpu.memory_bytes()

    def tile_buffer(self) -> Tuple[int, str]:
        """(bytes, source) of the on-chip buffer attention tiles must fit: the vnpu's
        Unified Buffer, or the CPU's L2 cache."""
        if self.spec is not None:
            return int(self.spec.ub_bytes), f"{self.spec.name} Unified Buffer"
        return cpu.cpu_l2()


def parse_device(device, kind: Optional[str] = None, load: bool = True) -> Device:
    """The `Device` of the string ``device`` (see the module docstring for the forms); a
    `Device` is returned as it is (checked against ``kind``; re-read when ``load`` asks
    for a spec file it was parsed without).

    ``kind``: require this kind ("vnpu"), so a cpu (or unknown) device is an error that
    says how to write one; ``load=False`` does not read ``vnpu:<spec file>`` (spec None).
    Raises `DeviceError` (a ValueError), one line naming what to write instead: an
    unknown kind lists the supported ones, ``vnpu:<unknown>`` lists the presets,
    ``cpu:1`` says the host is one device."""
    if isinstance(device, Device) and (kind is None or device.kind == kind) and \
            (device.spec is not None or device.kind == "cpu" or not load):
        return device
    text = str(device)
    k, _, rest = text.partition(":")
    if kind is not None and k != kind:
        raise DeviceError(f"{text!r} is not a {kind} device; use 'vnpu:<preset>', e.g. "
                          f"'vnpu:{DEFAULT_NPU_PRESET}'", "expected", k, rest)
    if k not in KINDS:
        raise DeviceError(f"device {text!r} is not supported by the compiler yet; use one of "
                          f"{list(KINDS)} (vnpu as vnpu:<preset> or vnpu:<spec file>)", "kind", k, rest)
    if k == "cpu":
        if text not in ("cpu", "cpu:0"):
            raise DeviceError(f"device {text!r}: the host is one device, 'cpu'", "index", k, rest)
        return CPU if text == "cpu" else Device("cpu", text)
    return Device("vnpu", text, rest, _npu_spec(text, rest, load))


CPU = Device("cpu", "cpu")   # the host: the default device of nodes and compiles


def _npu_spec(text: str, name: str, load: bool) -> Optional[NpuSpec]:
    if not name:
        return get_preset(DEFAULT_NPU_PRESET)
    if name.endswith((".json", ".toml")):
        return load_spec(name) if load else None
    try:
        return get_preset(name)
    except ValueError as e:
        if os.path.exists(name):  # a path without .json/.toml: load_spec says what is wrong
            return load_spec(name) if load else None
        raise DeviceError(f"device {text!r}: {e}; as a device write 'vnpu:<preset>' or "
                          "'vnpu:<spec.json|spec.toml>'", "preset", "vnpu", name) from None


__all__ = ["CPU", "Device", "DeviceError", "KINDS", "NPU_FORMATS", "PRESETS", "cpu", "parse_device"]
