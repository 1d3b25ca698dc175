"""Native code recognised by its header: ELF (Linux, BSD), Mach-O (macOS) and PE (Windows) executables, shared
libraries and object files, with the architecture they run on.

Only the first bytes are read (:data:`HEAD_BYTES`), as the system loaders read them before mapping the file:
ELF: ``\\x7fELF``, class (32/64-bit), byte order, ``e_type`` and ``e_machine`` (System V gABI, "ELF header");
Mach-O: the magic ``0xfeedface`` / ``0xfeedfacf`` in either byte order, ``cputype`` and ``filetype``
(``<mach-o/loader.h>``), or a universal (fat) header ``0xcafebabe`` / ``0xcafebabf`` with its first slice's
``cputype`` (``<mach-o/fat.h>``; a Java class file shares the magic and is told apart by the count that follows: a
class file's major version is 45 or more, a fat header has a handful of slices); PE: ``MZ``, ``e_lfanew`` at 0x3c,
``PE\\0\\0`` there, then the COFF ``Machine`` and ``Characteristics`` (Microsoft PE format). An ``MZ`` file without
a PE signature in the head is not reported (a DOS program: no current loader runs it). Nothing is executed.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ckptool.formats.detect import NATIVE_HEAD_BYTES

__all__ = ["HEAD_BYTES", "NativeCode", "describe_native"]

#: the bytes :func:`describe_native` needs (a PE header may start a few hundred bytes in); which first bytes are worth
#: reading so far is :func:`ckptool.formats.detect.may_be_native` (scan looks at every zip member's)
HEAD_BYTES = NATIVE_HEAD_BYTES

_ELF_MACHINES = {3: "x86", 8: "MIPS", 0x14: "PowerPC", 0x15: "PowerPC64", 0x16: "s390x", 0x28: "ARM",
                 0x2B: "SPARC v9", 0x3E: "x86-64", 0xB7: "AArch64", 0xF3: "RISC-V", 0x102: "LoongArch"}
_ELF_TYPES = {1: "relocatable object", 2: "executable", 3: "shared library", 4: "core dump"}
_MACHO_CPUS = {7: "x86", 0x01000007: "x86-64", 12: "ARM", 0x0100000C: "arm64", 0x0200000C: "arm64_32",
               18: "PowerPC", 0x01000012: "PowerPC64"}
_MACHO_TYPES = {1: "object", 2: "executable", 6: "dynamic library", 8: "bundle"}
_PE_MACHINES = {0x14C: "x86", 0x8664: "x86-64", 0xAA64: "ARM64", 0x1C0: "ARM", 0x1C4: "ARMv7"}


class NativeCode(NamedTuple):
    """What a native binary header says: ``format`` (``ELF``, ``Mach-O``, ``PE``), ``kind`` (``shared
    library``, ``executable``, ...), ``arch`` (``x86-64``, ``AArch64``, ... or ``machine 0x...`` when unknown) and
    ``bits`` (32 or 64, 0 when the header does not say)."""

    format: str
    kind: str
    arch: str
    bits: int

    def __str__(self) -> str:
        bits = f" {self.bits}-bit" if self.bits else ""
        return f"{self.format}{bits} {self.kind} for {self.arch}"


def describe_native(head: bytes) -> NativeCode | None:
    """The native binary whose first bytes are ``head`` (give :data:`HEAD_BYTES`), or None when ``head`` is not
    an ELF, Mach-O or PE header (see the module docstring for the fields read). Never raises."""
    if head[:4] == b"\x7fELF" and len(head) >= 20:
        return _elf(head)
    if head[:4] in (b"\xfe\xed\xfa\xce", b"\xfe\xed\xfa\xcf", b"\xce\xfa\xed\xfe", b"\xcf\xfa\xed\xfe") \
            and len(head) >= 16:
        return _macho(head)
    if head[:4] in (b"\xca\xfe\xba\xbe", b"\xca\xfe\xba\xbf") and len(head) >= 12:
        n, cpu = struct.unpack_from(">II", head, 4)
        if 0 < n < 45:  # a Java class file has its major version (45+) here
            bits = 64 if head[3] == 0xBF else 32
            return NativeCode("Mach-O", f"universal binary ({n} slice{'s' if n != 1 else ''})",
                              _MACHO_CPUS.get(cpu, f"cputype 0x{cpu:x}"), 0 if bits == 32 else 64)
        return None
    if head[:2] == b"MZ" and len(head) >= 0x40:
        return _pe(head)
    return None


def _elf(head: bytes) -> NativeCode | None:
    bits = {1: 32, 2: 64}.get(head[4], 0)
    order = {1: "<", 2: ">"}.get(head[5])
    if order is None:
        return None
    e_type, machine = struct.unpack_from(order + "HH", head, 16)
    return NativeCode("ELF", _ELF_TYPES.get(e_type, f"file of type {e_type}"),
                      _ELF_MACHINES.get(machine, f"machine 0x{machine:x}"), bits)


def _macho(head: bytes) -> NativeCode:
    order = ">" if head[0] == 0xFE else "<"
    bits = 64 if head[:4] in (b"\xfe\xed\xfa\xcf", b"\xcf\xfa\xed\xfe") else 32
    cpu, _sub, ftype = struct.unpack_from(order + "iiI", head, 4)
    cpu &= 0xFFFFFFFF
    return NativeCode("Mach-O", _MACHO_TYPES.get(ftype, f"file of type {ftype}"),
                      _MACHO_CPUS.get(cpu, f"cputype 0x{cpu:x}"), bits)


def _pe(head: bytes) -> NativeCode | None:
    (at,) = struct.unpack_from("<I", head, 0x3C)
    if at + 24 > len(head) or head[at:at + 4] != b"PE\x00\x00":
        return None
    machine, = struct.unpack_from("<H", head, at + 4)
    chars, = struct.unpack_from("<H", head, at + 22)
    magic = head[at + 24:at + 26]
    bits = 64 if magic == b"\x0b\x02" else 32 if magic == b"\x0b\x01" else 0
    kind = "DLL" if chars & 0x2000 else "executable" if chars & 0x0002 else "object"
    return NativeCode("PE", kind, _PE_MACHINES.get(machine, f"machine 0x{machine:x}"), bits)
