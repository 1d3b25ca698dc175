"""Opcode pre-check of a pickle, run before the C unpickler sees it, and a stack sized for deep tuple nesting.

:func:`check_pickle` walks the opcodes without building anything and refuses what would make CPython's C unpickler
allocate or recurse out of proportion to the input; :func:`call_with_stack` runs the unpickler in a thread whose C
stack is large enough for the tuple nesting :func:`tuple_levels` bounds. Every refusal is a
:class:`~ckptool.errors.CorruptCheckpointError` (or :class:`~ckptool.errors.UnsupportedError` for a stack over
:data:`MAX_UNPICKLE_STACK`; both live in :mod:`ckptool.formats.pickle_stack` and are re-exported here). Used by
:mod:`ckptool.formats.unpickler`.
"""

from __future__ import annotations

import contextlib
import mmap
import pickle
import re
import sys
from collections.abc import Callable
from typing import TypeAlias

from ckptool.errors import CorruptCheckpointError, TruncatedError
from ckptool.formats.pickle_stack import MAX_UNPICKLE_STACK as MAX_UNPICKLE_STACK  # re-exported: the stack limit
from ckptool.formats.pickle_stack import call_with_stack as call_with_stack
from ckptool.formats.pickle_stack import tuple_levels as tuple_levels

# The C unpickler trusts the lengths and indices written in the stream. Before it runs, check_pickle() walks the
# opcodes (pickletools' opcode table: the same argument layout the C unpickler reads) and refuses what would make
# it allocate or recurse out of proportion to the input:
#
# * memo bombs: PUT / LONG_BINPUT with a huge index make CPython's C unpickler grow its memo array to twice the
#   index (``_Unpickler_MemoPut``): 16 bytes per unit of index, 64 GiB for ``r\xff\xff\xff\xff``, all written
#   with NULLs. Picklers number memo entries 0, 1, 2, ... so at byte offset p an index above p cannot come from
#   a real pickler. An index is accepted when it is below p or below the pickle's size rounded down to a power of
#   two (at least 65,536; for a stream of unknown length at most 4 Mi): the memo stays under 16 bytes per byte of
#   input (1 MiB at least).
# * lengths beyond the data: a string, bytes or FRAME whose declared length runs past the end is refused before
#   anything is allocated for it.
# * FRAMEs (protocol 4+) must hold whole opcodes and follow one another, as every pickler writes them: CPython's
#   C unpickler reading a file without ``peek`` (torch.load's data.pkl) drops the rest of a frame an opcode runs
#   past, so a malformed frame would make it see other opcodes than the ones checked here.
# * deep tuple nesting: hashing a tuple recurses in C without a depth check, so a dict key or set element made of
#   a million nested tuples (one byte each: TUPLE1 repeated) overflows the C stack (a segfault). The nesting depth
#   of tuples is at most the number of tuple-building opcodes; when that bound is large, the unpickler runs in a
#   helper thread whose stack is sized for it.
#
# Scanning uses one regular expression that consumes runs of ordinary opcodes in C (strings shorter than 128 bytes
# included) and stops at anything it cannot vouch for; those opcodes are checked one by one in Python.

_NOARG = b"(012NQR}abdel]ostu)\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94\x97\x98"  # no argument (STOP apart)
_ARG1 = b"Khq\x80\x82"  # BININT1 BINGET BINPUT PROTO EXT1
_ARG2 = b"M\x83"  # BININT2 EXT2
_ARG4 = b"Jj\x84r"  # BININT LONG_BINGET EXT4 LONG_BINPUT
_ARG8 = b"G\x95"  # BINFLOAT FRAME (FRAME is checked in Python: frames must hold whole opcodes)
_LEN1 = b"UC\x8c\x8a"  # SHORT_BINSTRING SHORT_BINBYTES SHORT_BINUNICODE LONG1: 1-byte length
_LEN4_UNSIGNED = b"XB"  # BINUNICODE BINBYTES: 4-byte unsigned length
_LEN4_SIGNED = b"T\x8b"  # BINSTRING LONG4: 4-byte signed length
_LEN8 = b"\x8d\x8e\x96"  # BINUNICODE8 BINBYTES8 BYTEARRAY8: 8-byte length
_LINE1 = b"ILFSVPgp"  # INT LONG FLOAT STRING UNICODE PERSID GET PUT: argument up to a newline
_LINE2 = b"ci"  # GLOBAL INST: two lines
_STOP = 0x2E
_FRAME = 0x95
_LONG_BINPUT = 0x72
_PUT = 0x70

_ARG_SIZE: dict[int, int] = {}
for _ops, _n in ((_NOARG, 0), (_ARG1, 1), (_ARG2, 2), (_ARG4, 4), (_ARG8, 8)):
    for _op in _ops:
        _ARG_SIZE[_op] = _n


#: what the checks and the unpickler read: the bytes of a pickle, or a mapped file holding one
PickleBuffer: TypeAlias = "bytes | bytearray | mmap.mmap"


def _cls(ops: bytes) -> bytes:
    return b"[" + b"".join(b"\\x%02x" % c for c in ops) + b"]"


def _counted(lengths: bytes, below: int = 128) -> bytes:
    """Alternatives ``<length prefix><that many bytes>`` for lengths 0..``below - 1`` (prefix = byte + ``lengths``
    zeros); longer values are rare in checkpoints (keys, location tags) and are checked in Python."""
    return b"(?:" + b"|".join(
        b"\\x%02x" % n + b"\\x00" * len(lengths) + (b".{%d}" % n if n else b"") for n in range(below)) + b")"


_patterns: dict[int, re.Pattern[bytes]] = {}

#: possessive repetition (Python 3.11+): no backtracking points kept. Python 3.10's ``re`` has none; there the plain
#: greedy loop ends at the same offset (nothing follows it that could make it give back), keeping its points
_POSSESSIVE = b"+" if sys.version_info >= (3, 11) else b""


def _run_pattern(k: int) -> re.Pattern[bytes]:
    """The opcode-run expression that accepts LONG_BINPUT indices below ``2**k`` (16 <= k <= 32)."""
    pat = _patterns.get(k)
    if pat is None:
        alts = [
            _long_binput(k),  # memo puts first: the commonest opcode of a torch pickle
            _cls(_ARG1) + b".",
            _cls(_NOARG) + b"+" + _POSSESSIVE,  # a run of argument-less opcodes in one step
            _cls(_LEN4_UNSIGNED + _LEN4_SIGNED) + _counted(b"\x00\x00\x00"),
            _cls(b"M\x83") + b".{2}",
            _cls(b"Jj\x84") + b".{4}",
            b"G.{8}",
            _cls(_LEN1) + _counted(b""),
            _cls(b"ILFSVPg") + b"[^\\n]*\\n",
            _cls(_LINE2) + b"[^\\n]*\\n[^\\n]*\\n",
            b"p[0-9]{1,4}\\n",  # text PUT with a small index
        ]
        # DOTALL: ``.`` is any byte, newline included (faster to parse and to match than ``[\s\S]``)
        pat = _patterns[k] = re.compile(b"(?:" + b"|".join(alts) + b")*" + _POSSESSIVE, re.DOTALL)
    return pat


#: a stretch of opcodes this long or longer is walked by RE2 (``google-re2``, a dependency: an automaton, linear in
#: the bytes, about 6x faster than ``re`` on the opcodes of a torch pickle); shorter ones by ``re``, whose compiled
#: expression costs a few milliseconds where RE2's costs about 20
LINEAR_FROM = 1 << 20
_linear: dict[bytes, Callable[[PickleBuffer, int, int], re.Match[bytes] | None]] = {}


def linear_match(pat: re.Pattern[bytes]) -> Callable[[PickleBuffer, int, int], re.Match[bytes] | None]:
    """The ``match(buf, pos, endpos)`` of the opcode-run expression ``pat`` (:func:`_run_pattern`,
    :func:`_weights_only_run_pattern`) compiled by RE2, which reads bytes and ``mmap`` objects in place. RE2 picks
    the match Python's ``re`` picks (leftmost-first); it has no possessive loops, and none is needed: nothing follows
    a run that could make it give back (see :data:`_POSSESSIVE`), so the plain loop ends at the same offset."""
    got = _linear.get(pat.pattern)
    if got is None:
        import re2  # noqa: PLC0415 (only pickles of a megabyte or more pay for the import)

        options = re2.Options()
        options.dot_nl = True  # as re.DOTALL: ``.`` is any byte
        options.encoding = re2.Options.Encoding.LATIN1  # bytes, not UTF-8 text: \xNN is the byte NN
        options.max_mem = 64 << 20  # the automaton's cache; past it RE2 runs slower, never differently
        # every opcode byte is written \xNN (:func:`_cls`), so ``++`` and ``*+`` can only be possessive loops
        source = pat.pattern.replace(b"++", b"+").replace(b"*+", b"*")
        got = _linear[pat.pattern] = re2.compile(source, options).match
    return got


def _run_matcher(k: int, weights_only: bool, room: int) -> Callable[[PickleBuffer, int, int], re.Match[bytes] | None]:
    """The ``match`` of the opcode-run expression (:func:`_weights_only_run_pattern` while no opcode outside the
    weights_only list was met, else :func:`_run_pattern`) for a walk of ``room`` bytes: RE2's from
    :data:`LINEAR_FROM` on, else ``re``'s."""
    pat = (_weights_only_run_pattern if weights_only else _run_pattern)(k)
    return _probing(pat.match, linear_match(pat)) if room >= LINEAR_FROM else pat.match


#: :func:`_probing` reads this many bytes with ``re`` before it hands a run that goes on to RE2
_PROBE = 4096
#: a run that ``re`` ended this close to the probe's end may go on past it (the longest step of the expression but
#: for text lines: a 127-byte string and its 5-byte header)
_PROBE_SLACK = 256


def _probing(small: Callable[[PickleBuffer, int, int], re.Match[bytes] | None],
             large: Callable[[PickleBuffer, int, int], re.Match[bytes] | None]
             ) -> Callable[[PickleBuffer, int, int], re.Match[bytes] | None]:
    """A run matcher that tries ``re``'s ``small`` on the next :data:`_PROBE` bytes first and goes on with RE2's
    ``large`` only when the run reaches the probe's end: each call of RE2 costs about 10 us before it reads a byte,
    and a pickle of many blobs (the opcodes between them a few dozen bytes) calls it once per blob. The match
    returned ends where the run ends (only its ``end()`` is used); a run cut at the probe's end by an opcode that
    crosses it ends there, and that opcode is checked by the walk in Python, as any opcode the expression stops at."""

    def match(buf: PickleBuffer, pos: int, endpos: int) -> re.Match[bytes] | None:
        cap = pos + _PROBE
        if cap >= endpos:
            return small(buf, pos, endpos)
        m = small(buf, pos, cap)
        if m is None or cap - m.end() > _PROBE_SLACK:
            return m
        return large(buf, m.end(), endpos)

    return match


def _long_binput(k: int) -> bytes:
    """The expression of a LONG_BINPUT whose memo index is below ``2**k`` (16 <= k <= 32)."""
    nb, rem = divmod(k, 8)
    put = b"r" + b"." * nb
    if nb < 4:
        put += b"[\\x00-\\x%02x]" % ((1 << rem) - 1) + b"\\x00" * (3 - nb)
    return put


_wo_run_patterns: dict[int, re.Pattern[bytes]] = {}


def _weights_only_run_pattern(k: int) -> re.Pattern[bytes]:
    """The opcode-run expression of :func:`_run_pattern` (LONG_BINPUT indices below ``2**k``) restricted to the
    opcodes torch's weights_only unpickler reads (:data:`WEIGHTS_ONLY_OPCODES`): where it stops at an opcode outside
    the list, that opcode is the one the weights_only unpickler refuses (:func:`check_pickle`'s ``weights_only``)."""
    pat = _wo_run_patterns.get(k)
    if pat is None:
        alts = [_long_binput(k)]
        for group, arg in _WEIGHTS_ONLY_BY_ARGUMENT:
            ops = group.replace(b"r", b"").replace(b".", b"")  # LONG_BINPUT as above; STOP ends the walk
            if ops:
                alts.append(_cls(ops) + arg)
        pat = _wo_run_patterns[k] = re.compile(b"(?:" + b"|".join(alts) + b")*" + _POSSESSIVE, re.DOTALL)
    return pat


def _corrupt(what: str, detail: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{what} is corrupted or truncated ({detail}); re-download or re-save the checkpoint")


def _truncated(what: str, detail: str) -> TruncatedError:
    return TruncatedError(f"{what} is corrupted or truncated ({detail}); re-download or re-save the checkpoint")


#: a length running past the end of the data is a truncation (:class:`~ckptool.errors.TruncatedError`) when the
#: pickle it declares is at most this many times the data there is, plus :data:`_CUT_SLACK` bytes; beyond, a
#: hostile length (``BINUNICODE8`` of 2^62 bytes in a 13-byte file), which is damage, not a cut
_CUT_RATIO = 16
_CUT_SLACK = 1 << 20


def _past_end(what: str, detail: str, declared: int, size: int) -> CorruptCheckpointError:
    """A length that runs past the end of the ``size`` bytes there are, to byte ``declared``: truncated, or a
    length no cut explains (see :data:`_CUT_RATIO`)."""
    if declared <= _CUT_RATIO * size + _CUT_SLACK:
        return _truncated(what, detail)
    return _corrupt(what, f"{detail}, to byte {declared}: a length no truncation explains")


def _declared_end(buf: PickleBuffer, op: int, pos: int, end: int) -> int:
    """Where the opcode at ``pos`` says it ends (its length argument read where it is complete), else ``end + 1``."""
    if op in _LEN1 or op in _LEN4_UNSIGNED or op in _LEN4_SIGNED or op in _LEN8:
        width = 1 if op in _LEN1 else 8 if op in _LEN8 else 4
        if pos + 1 + width <= end:
            return pos + 1 + width + int.from_bytes(buf[pos + 1:pos + 1 + width], "little")
    return end + 1


def _memo_bomb(what: str, idx: int, pos: int, start: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{what} is malformed or hostile: memo index {idx} at byte {pos - start} is larger than the pickle could "
        "have numbered (it would make the unpickler allocate gigabytes); refusing to read it")


#: a bytes, bytearray or string argument this long or longer is a blob: :func:`check_pickle` steps over it by its
#: declared length without reading it, and with ``blobs`` says where it is (the unpickler can then leave it in place)
BLOB_MIN = 4096
#: the opcodes whose argument is a value's payload: BINBYTES BINBYTES8 BYTEARRAY8 BINUNICODE BINUNICODE8 BINSTRING
#: (SHORT_BINBYTES and SHORT_BINSTRING hold under 256 bytes, never a blob), by the type they build
BLOB_KINDS: dict[int, str] = {0x42: "bytes", 0x8E: "bytes", 0x96: "bytearray", 0x58: "str", 0x8D: "str",
                              0x54: "latin1"}
#: what ``blobs`` collects: ``(opcode offset, offset after the argument, opcode)`` of each blob and each FRAME
Span: TypeAlias = "tuple[int, int, int]"


_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
#: with ``blobs``, the pages of a mapped file that a walk has gone past are handed back every this many bytes
RELEASE_EVERY = 8 << 20


def release_pages(buf: PickleBuffer, start: int, stop: int) -> None:
    """Drop from this process's memory the pages of ``buf[start:stop]`` when ``buf`` is a read-only mapped file
    (``mmap`` with ``ACCESS_READ``: a shared mapping nobody writes, whose pages come back from the page cache when
    read again), so that stepping over blobs does not leave the kernel's fault-around pages (64 KiB around each page
    touched) counted in the RSS; nothing for bytes or a writable mapping (dropping its pages could lose data)."""
    if _DONTNEED is None or not isinstance(buf, mmap.mmap):
        return
    page = mmap.PAGESIZE
    a, b = -(-start // page) * page, stop // page * page
    if b <= a:
        return
    with memoryview(buf) as view:
        if not view.readonly:
            return
    with contextlib.suppress(OSError, ValueError):  # advice only
        buf.madvise(_DONTNEED, a, b - a)


def check_pickle(buf: PickleBuffer, start: int = 0, end: int | None = None, *, what: str = "pickle",
                 exact: bool = True, strict_frames: bool = True,
                 weights_only: list[str | None] | None = None, blobs: list[Span] | None = None,
                 gaps: list[tuple[bytes, bytes]] | None = None) -> int:
    """Walk the opcodes of the pickle at ``buf[start:]`` (bytes or ``mmap``) without building anything and return
    the offset just after its STOP opcode.

    ``exact=True`` says the pickle fills ``buf[start:end]`` (a zip record); ``False`` that more data may follow
    (the legacy stream). See the comment above for what is refused. With ``strict_frames`` (the default) every
    FRAME (protocol 4+) must hold whole opcodes and end where the next FRAME starts, as every pickler writes them:
    CPython's C unpickler reading from a file without ``peek`` (what ``torch.load`` does with ``data.pkl``) drops
    the bytes of a frame that an opcode runs past, so a malformed frame makes it see other opcodes than an
    in-memory read does. ``strict_frames=False`` reads the opcodes as one flat stream (frames are ignored).
    ``weights_only`` (a list of one item): set to what :func:`weights_only_refusal` says of the pickle, found in
    the same walk (one pass over the bytes instead of two: its opcodes are walked with the weights_only subset of
    the expression until one outside the list is met). ``blobs``: a list that receives, in stream order, the
    :data:`Span` of every blob (an argument of :data:`BLOB_KINDS` of :data:`BLOB_MIN` bytes or more, stepped over by
    its declared length: its bytes are never read) and of every FRAME opcode, opcodes before a refusal included.
    ``gaps`` (with ``blobs``): for each span, the bytes between the previous span (or ``start``) and it, and the
    first 16 bytes of its payload, copied as the walk passes them (their pages in memory then; the walk hands
    pages back behind it).

    Raises:
        CorruptCheckpointError: an unknown opcode, an argument or length running past ``end``, no STOP opcode, a
            memo index no pickler could have written (a memo bomb), or (``strict_frames``) a malformed FRAME.
    """
    end = len(buf) if end is None else end
    at = [start]
    if weights_only is not None:
        weights_only[:] = [None]
    try:
        return _walk(buf, start, end, what, exact, strict_frames, at, weights_only,
                     _span_note(buf, start, blobs, gaps))
    except CorruptCheckpointError as e:
        e.offset = at[0]  # type: ignore[attr-defined] # where the refused opcode starts: what precedes was checked
        raise


#: opcodes in the first bytes of a pickle are checked one by one in Python: compiling the fast expression costs
#: a few milliseconds, more than walking a small pickle (the legacy stream's headers, small checkpoints); an exact
#: pickle of :data:`_FAST_FROM_START` bytes or more is walked with the expression from its first opcode
_PY_PREFIX = 24 << 10
_FAST_FROM_START = 1 << 20
#: after this many walks of a first :data:`_PY_PREFIX` bytes (a scan of a folder of small pickles), those bytes are
#: walked by :func:`_prefix_pattern` (compiled once, about 2 ms), not in Python (3 times slower on a small pickle)
PREFIX_COMPILE_AFTER = 64
_prefix_walks = [0]  # such walks so far in this process
_prefix_patterns: dict[bool, re.Pattern[bytes]] = {}


def _prefix_pattern(weights_only: bool) -> re.Pattern[bytes]:
    """The expression that walks the first :data:`_PY_PREFIX` bytes of a pickle as :func:`_check_one` does:
    :func:`_run_pattern`'s (:func:`_weights_only_run_pattern`'s) without the memo puts with an index (LONG_BINPUT,
    PUT: checked against their offset in Python) and with strings under 64 bytes (faster to compile)."""
    pat = _prefix_patterns.get(weights_only)
    if pat is None:
        c1, c4 = _counted(b"", 64), _counted(b"\x00\x00\x00", 64)
        groups = [(ops.replace(b"r", b"").replace(b".", b""), arg) for ops, arg in _WEIGHTS_ONLY_BY_ARGUMENT] \
            if weights_only else [(_ARG1, b"."), (_NOARG, b"+" + _POSSESSIVE), (_LEN4_UNSIGNED + _LEN4_SIGNED, c4),
                                  (b"M\x83", b".{2}"), (b"Jj\x84", b".{4}"), (b"G", b".{8}"), (_LEN1, c1),
                                  (b"ILFSVPg", b"[^\\n]*\\n"), (_LINE2, b"[^\\n]*\\n[^\\n]*\\n")]
        short = {_counted(b""): c1, _counted(b"\x00\x00\x00"): c4}
        alts = [_cls(ops) + short.get(arg, arg) for ops, arg in groups if ops]
        pat = _prefix_patterns[weights_only] = re.compile(b"(?:" + b"|".join(alts) + b")*" + _POSSESSIVE, re.DOTALL)
    return pat


def _walk(buf: PickleBuffer, start: int, end: int, what: str, exact: bool, strict_frames: bool, at: list[int],
          wo: list[str | None] | None, note: Callable[[int, int, int], None]) -> int:
    size = end - start
    k = max(16, min(32, size.bit_length() - 1)) if exact else max(16, min(22, size.bit_length() - 1))
    fast_from = start if exact and size >= _FAST_FROM_START else start + _PY_PREFIX
    match = None
    pos = start
    limit = end  # the end of the current frame, or ``end``
    wo_left = wo is not None  # no opcode outside the weights_only list met yet (its expression walks)
    prefix = _counted_prefix_walk(fast_from - start)  # the first bytes walked by _prefix_pattern (not in Python)
    while True:
        if pos >= fast_from:
            if match is None:
                match = _run_matcher(k, wo_left, limit - pos)
            m = match(buf, pos, limit)
            assert m is not None  # the expression ends in a loop (``*``): it always matches, if only the empty string
            pos = m.end()
        elif prefix:
            pos = _prefix_end(buf, pos, min(limit, fast_from), wo_left)
            if pos >= fast_from:  # the rest is the fast expression's
                continue
        at[0] = pos
        if pos == limit and limit != end:  # the frame is used up exactly
            limit = end
            continue
        if pos >= end:
            raise _truncated(what, "no STOP opcode: the pickle is cut short")
        op = buf[pos]
        if wo_left and op not in WEIGHTS_ONLY_OPCODES:  # the first opcode torch's weights_only unpickler refuses
            assert wo is not None
            wo[0] = f"opcode {_OPCODE_NAMES.get(op, 'unknown')} (0x{op:02x}) at byte {pos - start}"
            wo_left, match = False, None  # the whole expression from here
        if op == _STOP:
            return pos + 1
        if op == _FRAME:
            limit = _frame_limit(buf, pos, start, end, limit, what, strict_frames)
            note(pos, pos + 9, op)
            pos += 9
            continue
        nxt = _check_one(buf, op, pos, start, limit, what)
        if nxt < 0:
            raise _runs_past(buf, op, pos, start, end, limit, what)
        note(pos, nxt, op)
        pos = nxt


def _counted_prefix_walk(prefix: int) -> bool:
    """Whether a walk of a first ``prefix`` bytes (none: 0) runs :func:`_prefix_pattern` on them (counted)."""
    _prefix_walks[0] += prefix > 0
    return prefix > 0 and _prefix_walks[0] > PREFIX_COMPILE_AFTER


def _prefix_end(buf: PickleBuffer, pos: int, stop: int, weights_only: bool) -> int:
    """Where :func:`_prefix_pattern` (``weights_only``'s) stops walking ``buf`` from ``pos``, at ``stop`` at most."""
    return _prefix_pattern(weights_only).match(buf, pos, stop).end()  # type: ignore[union-attr] # ``*``: a match


def _runs_past(buf: PickleBuffer, op: int, pos: int, start: int, end: int, limit: int, what: str
               ) -> CorruptCheckpointError:
    """The error of the opcode at ``pos`` that runs past ``limit`` (the end of its FRAME, or ``end``)."""
    if limit != end and _check_one(buf, op, pos, start, end, what) >= 0:
        return _bad_frame(what, pos - start, "an opcode runs past the end of its FRAME")
    return _past_end(what, f"opcode {bytes([op])!r} at byte {pos - start} runs past the end of the data",
                     _declared_end(buf, op, pos, end) - start, end - start)


def _ignore(pos: int, nxt: int, op: int) -> None:
    """The span note of a walk that collects no blobs."""


def _span_note(buf: PickleBuffer, start: int, blobs: list[Span] | None, gaps: list[tuple[bytes, bytes]] | None
               ) -> Callable[[int, int, int], None]:
    """What :func:`_walk` calls with each opcode it checks in Python, ``(offset, next offset, opcode)``: appends
    FRAMEs and blobs to ``blobs`` (and what precedes each, and its first bytes, to ``gaps``) and hands back the
    pages walked past every :data:`RELEASE_EVERY` bytes; nothing when ``blobs`` is None."""
    if blobs is None:
        return _ignore
    released = [start]  # the pages before this offset were handed back (release_pages)
    prev = [start]  # where the bytes of the next gap start

    def note(pos: int, nxt: int, op: int) -> None:
        if op == _FRAME or (nxt - pos >= BLOB_MIN and op in BLOB_KINDS):
            blobs.append((pos, nxt, op))
            if gaps is not None:
                first = pos + 1 + (8 if op in (0x8D, 0x8E, 0x96) else 4)
                gaps.append((bytes(buf[prev[0]:pos]), bytes(buf[first:first + 16]) if op != _FRAME else b""))
                prev[0] = nxt
            if nxt - released[0] >= RELEASE_EVERY:
                release_pages(buf, released[0], nxt)
                released[0] = nxt

    return note


def _frame_limit(buf: PickleBuffer, pos: int, start: int, end: int, limit: int, what: str, strict: bool) -> int:
    """Where the opcodes after the FRAME at ``pos`` must end (``limit``: the end of the frame it would be in, ``end``
    when none): with ``strict`` frames the end of the new frame (its 8-byte length read), else ``limit``.

    Raises:
        CorruptCheckpointError: the FRAME is cut short; (``strict``) it starts inside the previous frame or runs
            past ``end``."""
    if pos + 9 > end:
        raise _truncated(what, f"FRAME at byte {pos - start} is cut short")
    if not strict:
        return limit
    if limit != end:
        raise _bad_frame(what, pos - start, "a FRAME starts inside the previous frame")
    frame_end = pos + 9 + int.from_bytes(buf[pos + 1:pos + 9], "little")
    if frame_end > end:
        raise _past_end(what, f"FRAME at byte {pos - start} runs past the end of the data", frame_end - start,
                        end - start)
    return frame_end


def walk_prefix(buf: PickleBuffer, start: int, pos: int, what: str = "pickle") -> int:
    """Walk the complete opcodes of the pickle that starts at ``buf[start]``, from opcode boundary ``pos`` to the
    end of what has arrived so far (a pickle being inflated); frames are read as one flat stream.

    Returns the offset just after the STOP opcode when it has arrived, else ``~p`` (negative) where ``p`` is the
    offset of the first opcode not complete yet: call again from ``p`` when more data is there. The same opcodes
    :func:`check_pickle` refuses are refused here, as soon as they arrive.

    Raises:
        CorruptCheckpointError: an unknown opcode, a negative length, or a memo index no pickler could have written.
    """
    end = len(buf)
    match = _run_pattern(22).match if end - pos >= _PY_PREFIX else None
    while True:
        if match is not None:
            m = match(buf, pos, end)
            assert m is not None
            pos = m.end()
        if pos >= end:
            return ~pos
        op = buf[pos]
        if op == _STOP:
            return pos + 1
        if op == _FRAME:
            if pos + 9 > end:
                return ~pos
            pos += 9
            continue
        nxt = _check_one(buf, op, pos, start, end, what)
        if nxt < 0:
            return ~pos
        pos = nxt


def _bad_frame(what: str, at: int, detail: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{what} is malformed or hostile: {detail} (byte {at}); loaders would disagree on what the pickle holds")


def _check_one(buf: PickleBuffer, op: int, pos: int, start: int, end: int, what: str) -> int:
    """Check one opcode the fast expression stopped at; return the offset of the next one, or -1 when the opcode
    or its argument runs past ``end``."""
    n = _ARG_SIZE.get(op)
    if n is not None:
        if pos + 1 + n > end:
            return -1
        if op == _LONG_BINPUT:
            idx = int.from_bytes(buf[pos + 1:pos + 5], "little")
            if idx > pos - start:
                raise _memo_bomb(what, idx, pos, start)
        return pos + 1 + n
    if op in _LEN1 or op in _LEN4_UNSIGNED or op in _LEN4_SIGNED or op in _LEN8:
        return _counted_end(buf, op, pos, start, end, what)
    if op in _LINE1 or op in _LINE2:
        return _lines_end(buf, op, pos, start, end, what)
    raise _corrupt(what, f"invalid opcode {bytes([op])!r} at byte {pos - start}")


def _counted_end(buf: PickleBuffer, op: int, pos: int, start: int, end: int, what: str) -> int:
    """The end of an opcode whose argument is a length (1, 4 or 8 bytes) and that many bytes, or -1 past ``end``."""
    width = 1 if op in _LEN1 else 8 if op in _LEN8 else 4
    if pos + 1 + width > end:
        return -1
    length = int.from_bytes(buf[pos + 1:pos + 1 + width], "little", signed=op in _LEN4_SIGNED)
    if length < 0:
        raise _corrupt(what, f"negative length {length} at byte {pos - start}")
    nxt = pos + 1 + width + length
    return nxt if nxt <= end else -1


def _lines_end(buf: PickleBuffer, op: int, pos: int, start: int, end: int, what: str) -> int:
    """The end of an opcode whose argument is one or two text lines (a PUT's memo index checked), or -1 past
    ``end``."""
    nl = buf.find(b"\n", pos + 1, end)
    if nl < 0:
        return -1
    if op == _PUT:
        try:
            idx = int(bytes(buf[pos + 1:nl]))
        except ValueError:
            raise _corrupt(what, f"bad PUT argument at byte {pos - start}") from None
        if idx > pos - start:
            raise _memo_bomb(what, idx, pos, start)
    if op in _LINE2:
        nl = buf.find(b"\n", nl + 1, end)
        if nl < 0:
            return -1
    return nl + 1


# ------------------------------------------------------------------------------------------------ weights_only
#: the opcodes torch 2.13's weights_only unpickler reads (torch/_weights_only_unpickler.py ``Unpickler.load``): any
#: other opcode (FRAME and MEMOIZE of protocol 4+, SHORT_BINUNICODE, BINBYTES, STACK_GLOBAL, the text opcodes of
#: protocols 0-1...) makes it raise "Unsupported operand", whatever the globals
#: the one list, by the regular expression of each group's argument (a memo index, a length-prefixed string, two
#: text lines...); the commonest opcodes of a torch pickle first (memo puts and gets, then argument-less runs)
_WEIGHTS_ONLY_BY_ARGUMENT: tuple[tuple[bytes, bytes], ...] = (
    (b"qhK\x80", b"."),  # BINPUT BINGET BININT1 PROTO: one byte
    (b"rjJ", b".{4}"),  # LONG_BINPUT LONG_BINGET BININT: four bytes
    (b"\x81Rbaesu(t\x85\x86\x87N\x89\x88)]}\x8fQ", b"+" + _POSSESSIVE),  # no argument, in runs
    (b"X", _counted(b"\x00\x00\x00")),  # BINUNICODE: a 4-byte length and that many bytes
    (b"M", b".{2}"),  # BININT2
    (b"G", b".{8}"),  # BINFLOAT
    (b"U\x8a", _counted(b"")),  # SHORT_BINSTRING LONG1: a 1-byte length and that many bytes
    (b"c", b"[^\\n]*\\n[^\\n]*\\n"),  # GLOBAL: module and name lines
    (b".", b""),  # STOP (matched by weights_only_refusal itself)
)
WEIGHTS_ONLY_OPCODES = frozenset(b"".join(ops for ops, _arg in _WEIGHTS_ONLY_BY_ARGUMENT))
_wo_patterns: list[re.Pattern[bytes]] = []  # compiled on first use
#: opcode byte -> its name in the ``pickle`` module (``FRAME``, ``SHORT_BINUNICODE``...)
_OPCODE_NAMES = {v[0]: k for k, v in vars(pickle).items()
                 if k.isupper() and isinstance(v, bytes) and len(v) == 1 and not k.startswith(("HIGHEST", "DEFAULT"))}


def weights_only_refusal(buf: PickleBuffer, start: int = 0, end: int | None = None) -> str | None:
    """Why torch 2.13's ``weights_only`` unpickler refuses the pickle at ``buf[start:]`` because of an opcode it
    does not read (:data:`WEIGHTS_ONLY_OPCODES`): ``"opcode FRAME (0x95) at byte 2"``; None when it reads every
    opcode up to STOP. Globals are judged elsewhere (:mod:`ckptool.model.allowlist`). The pickle must have passed
    :func:`check_pickle` (its lengths are trusted). Runs in C over runs of supported opcodes; long strings are
    stepped over in Python."""
    end = len(buf) if end is None else end
    if not _wo_patterns:
        alts = [_cls(ops) + arg for ops, arg in _WEIGHTS_ONLY_BY_ARGUMENT if ops != b"."]
        _wo_patterns.append(re.compile(b"(?:" + b"|".join(alts) + b")*" + _POSSESSIVE, re.DOTALL))
    match = _wo_patterns[0].match
    pos = start
    while pos < end:
        m = match(buf, pos, end)
        assert m is not None
        pos = m.end()
        if pos >= end:
            break
        op = buf[pos]
        if op == _STOP:
            return None
        if op == 0x58 and pos + 5 <= end:  # BINUNICODE of 128 bytes or more
            pos += 5 + int.from_bytes(buf[pos + 1:pos + 5], "little")
        elif op in (0x55, 0x8A) and pos + 2 <= end:  # SHORT_BINSTRING / LONG1 of 128 bytes or more
            pos += 2 + buf[pos + 1]
        else:
            name = _OPCODE_NAMES.get(op, "unknown")
            return f"opcode {name} (0x{op:02x}) at byte {pos - start}"
    return None
