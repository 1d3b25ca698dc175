"""The engine of ``ckptool scan``: every pickle in a byte container (zip members, nested zips, legacy streams and
tars, plain pickles, data appended after any of them) read with the restricted unpickler, each global rated into
a :class:`~ckptool.scanning.results.ScanResult` (policy: :mod:`ckptool.scanning.entry`; DCP folders:
:mod:`~ckptool.scanning.dcp`; legacy tars: :mod:`~ckptool.scanning.tar`; wrappers and legacy streams: the base
classes in :mod:`~ckptool.scanning.wrappers`, :mod:`~ckptool.scanning.legacy_stream`). Nothing is imported or run.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from itertools import compress, repeat
from operator import not_, or_
from typing import Any, BinaryIO, TypeAlias

from ckptool import _source as source
from ckptool.errors import CkptError, CorruptCheckpointError, TruncatedError
from ckptool.formats import detect as formats
from ckptool.formats import plugin
from ckptool.formats.nodes import StorageRef, qualified_name
from ckptool.formats.pickle_check import PickleBuffer, check_pickle
from ckptool.formats.unpickler import RestrictedUnpickler, load_pickle_at, partial_globals, thread_pool
from ckptool.formats.zipdir import MAX_RATIO, TorchRecords, ZipEntry, duplicate_member, read_member, read_member_head
from ckptool.model.allowlist import ALLOWED, NOT_IMPORTABLE, rate_global
from ckptool.scanning import layouts, wrappers
from ckptool.scanning.byte_windows import ZIP_LOCAL, Container, Window, as_file, end_record, zip_end, zip_start
from ckptool.scanning.directories import first_of_group, record_problem, zip_directories
from ckptool.scanning.key_paths import MAX_KEY_PATHS, key_paths
from ckptool.scanning.layouts import Layout
from ckptool.scanning.legacy_stream import STREAM_LOADER, LegacyWalk, failed
from ckptool.scanning.results import GlobalFinding, PickleFinding, ScanResult
from ckptool.scanning.tar import MAX_PICKLES_IN_A_ROW, PICKLE_FIRST, inside, join_where, leaves_archive
from ckptool.scanning.wrappers import INFLATE_BUDGET, MAX_ZIP_DEPTH, NotAPickle, WrapperWalk

__all__ = ["INFLATE_BUDGET", "MAX_KEY_PATHS", "MAX_ZIP_DEPTH", "Container", "NotAPickle", "Scanner", "Window",
           "as_file", "failed", "key_paths"]

# ------------------------------------------------------------------------------------------------ scanning
#: what a caller (``inspect``) already read of a pickle: its globals, its root node, the offset after its STOP opcode
#: (None: unknown), and the dense bytes of the root's tensors beside the bytes of their distinct storages, as the
#: caller counted them listing the tensors (None: not counted; scan's expansion note walks the root for them)
Preparsed: TypeAlias = tuple[list[str], Any, int | None, tuple[int, int] | None]
_PICKLE_SUFFIXES = (".pkl", ".debug_pkl", ".pickle")
#: folders of a torch zip / TorchScript archive holding tensor bytes and TorchScript source, which no loader unpickles
_STORAGE_DIRS = ("data/", "constants/", ".data/", "code/")




class Scanner(WrapperWalk, LegacyWalk):
    """The container walk of one scan: reads every pickle of a file (zip members, nested zips, legacy streams and
    tars, plain pickles, data appended after them) and records its findings into :attr:`res`."""

    def __init__(self, res: ScanResult, preparsed: Mapping[str, Preparsed] | None = None, *,
                 key_paths: bool = True) -> None:
        self.res = res
        #: whether :meth:`record` locates the globals not allowed (:attr:`PickleFinding.key_paths`): not for a
        #: report that does not show them (``scan``'s text report; a walk of each pickle's graph, issue 52)
        self.want_key_paths = key_paths
        self.torchscript = False
        #: classify the globals of DCP ``.metadata`` (its own record classes and pathlib paths are data there)
        self.dcp_metadata = False
        #: the pickles torch's loader reads (every other one is hidden)
        self.loaded: set[str] = set()
        #: ``where`` -> (globals, root, end) of pickles the caller already read whole (``inspect``), not read again;
        #: ``end``: the offset after its STOP opcode, or None (unknown: the opcodes are walked to find it)
        self.preparsed = dict(preparsed or {})
        #: the zip member being scanned when its bytes match its CRC-32
        self._crc_checked: str | None = None
        self._globals: dict[tuple[str, str], GlobalFinding] = {}
        self.root: Any = None  # the root of the first pickle torch's loader reads
        #: the storages (persistent ids) each pickle the loader reads names, by ``where`` (read here, not preparsed)
        self.storages_of: dict[str, dict[str, Any]] = {}
        #: (dense bytes, storage bytes) of :attr:`root`'s tensors when the caller counted them (:data:`Preparsed`)
        self.root_bytes: tuple[int, int] | None = None
        #: per torch.export zip (by ``where``): the members its loader unpickles, and its raw tensor members
        self.pt2_roles: dict[str, tuple[set[str], set[str]]] = {}
        #: bytes left to inflate from zip members (:data:`INFLATE_BUDGET`), set from the file's size
        self.inflate_left: int | None = None
        #: labels of the members of the zip being walked whose name another member has too (by ``id`` of the entry)
        self._labels: dict[int, str] = {}

    # -- recording -------------------------------------------------------------------------------------------
    def record(self, finding: PickleFinding, root: Any = None, uncalled: Collection[str] = ()) -> None:
        """Add ``finding`` to the result and rate its globals (:func:`~ckptool.model.allowlist.rate_global`);
        ``uncalled``: those the pickle, read to its STOP, holds only as values (never called nor passed to a call).
        A global that is no Python name makes the pickle unreadable (no loader can import it)."""
        finding.hidden = finding.where not in self.loaded
        if not finding.hidden and self.root is None and root is not None:
            self.root = root
        self.res.pickles.append(finding)
        if not finding.globals:  # nothing to rate (most pickles of a legacy stream)
            return
        rated = [(name, *rate_global(name, called=name not in uncalled, torchscript=self.torchscript,
                                     dcp_metadata=self.dcp_metadata))
                 for name in finding.globals]
        bad_name = next((name for name, _s, reason in rated if reason == NOT_IMPORTABLE), None)  # no Python name
        if bad_name is not None and finding.error is None:
            finding.error = (f"it names the global {bad_name!r}, which is not a Python name: a loader fails there "
                             "(nothing is imported or called)")
        if self.want_key_paths and root is not None and any(status != ALLOWED for _n, status, _r in rated):
            finding.key_paths = key_paths(root, {n for n, status, _r in rated if status != ALLOWED})
        for name, status, reason in rated:
            g = self._globals.get((name, status))
            if g is None:
                g = self._globals[name, status] = GlobalFinding(name, status, reason)
                self.res.globals.append(g)
            if finding.where not in g.where:
                g.where.append(finding.where)

    def take_preparsed(self, buf: PickleBuffer, where: str) -> int | None:
        """Record the pickle at the start of ``buf`` from :attr:`preparsed` if the caller read it already (and none
        of its globals is one whose level depends on whether the pickle calls it), and return where it ends (its
        opcodes walked again, not unpickled, unless the caller gave its end and ``buf`` is a zip member whose CRC-32
        matched: the bytes the caller's reader checked against the same CRC); None if not."""
        got = self.preparsed.pop(where, None)
        if got is None:
            return None
        names, root, known_end, counted = got
        if any(rate_global(n, called=False)[0] != rate_global(n)[0] for n in names) or STREAM_LOADER in names:
            return None  # whether it calls them decides their level, its streams are walked: read the ordinary way
        if known_end is not None and where == self._crc_checked and 0 < known_end <= len(buf):
            end = known_end
        else:
            try:
                end = check_pickle(buf, 0, what=where, exact=False, blobs=[])  # blobs: walked pages handed back
            except CkptError:
                return None  # read it the ordinary way
        self.record(PickleFinding(where, 0, list(names)), root)
        if self.root is root:
            self.root_bytes = counted
        return end

    def _unreadable_member(self, label: str, is_pickle: bool, err: Exception) -> None:
        """A zip member that could not be read: a finding for a pickle member, a note for anything else."""
        if is_pickle:
            self.record(failed(label, 0, [], err))
        else:
            self.note(f"member {label} could not be read ({err})")

    def note(self, text: str) -> None:
        self.res.notes.append(text)

    @property
    def budget_words(self) -> str:
        """The inflate budget in words (:data:`INFLATE_BUDGET`, :data:`MAX_RATIO`)."""
        return f"{INFLATE_BUDGET >> 20} MiB + {MAX_RATIO} times the file's size"

    def load_at(self, buf: PickleBuffer, pos: int, where: str, storages: dict[str, StorageRef] | None,
                stop: int | None = None) -> tuple[Any, RestrictedUnpickler, int]:
        """The pickle at ``buf[pos]`` (the data ending at ``stop``), read with views
        (:func:`~ckptool.formats.unpickler.load_pickle_at`, which raises :class:`~ckptool.errors.CkptError`), its
        persistent ids into ``storages``: (root, unpickler, end). Its placeholders come from this thread's pool
        (:func:`~ckptool.formats.unpickler.thread_pool`): each pickle's uses are read (:meth:`record`,
        :meth:`nested_streams`) before the next pickle is read."""
        return load_pickle_at(buf, pos, where, storages=storages, views=True, end=stop, pool=thread_pool())

    # -- one pickle ------------------------------------------------------------------------------------------
    def parse(self, buf: PickleBuffer, pos: int, where: str, *, required: bool = True, base: int = 0,
              stop: int | None = None) -> int | None:
        """Read the pickle at ``buf[pos]`` (the data from ``base`` to ``stop``: a window, its offsets counted from
        ``base``); record it and walk the streams of its ``_load_from_bytes`` calls (:meth:`nested_streams`); return
        the offset after its STOP, or None if it failed. A failed optional pickle (data after the last pickle) is
        recorded only when it named a global."""
        if pos == 0 and where in self.preparsed and where in self.loaded:
            end = self.take_preparsed(buf, where)
            if end is not None:
                return end
        try:
            root, up, end = self.load_at(buf, pos, where, None, stop)
        except CkptError as e:
            names = self.globals_before_failure(buf, pos, where, e, stop)
            if required or names:
                self.record(failed(where, pos - base, names, e))
            self.nested_streams(buf, getattr(e, "unpickler", None), where, pos)
            return None
        self.record(PickleFinding(where, pos - base, [qualified_name(m, n) for m, n in up.globals_seen]), root,
                    up.uncalled_globals())
        if pos == 0 and where in self.loaded:
            self.storages_of[where] = up.storages
        self.nested_streams(buf, up, where, pos)
        return end

    def globals_before_failure(self, buf: PickleBuffer, pos: int, what: str, e: CkptError,
                               stop: int | None = None) -> list[str]:
        up = getattr(e, "unpickler", None)
        if up is not None:  # unpickling itself failed: what it named so far
            return [qualified_name(m, n) for m, n in up.globals_seen]
        at = getattr(e, "offset", None)
        if at is None:
            return []
        cut = isinstance(e, TruncatedError)  # a cut frame's opcodes count (partial_globals)
        try:  # refused by the checks: read the flat stream (frames ignored) as far as it is sound
            end = check_pickle(buf, pos, stop, what=what, exact=False, strict_frames=False, blobs=[])
            seen = partial_globals(buf, pos, end, cut=cut)
        except CkptError as e2:
            seen = partial_globals(buf, pos, getattr(e2, "offset", at), cut=cut)
        return [qualified_name(m, n) for m, n in seen]

    def parse_root(self, buf: PickleBuffer, pos: int, where: str) -> tuple[Any, int] | None:
        """:meth:`parse` that also returns the pickle's root: ``(root, end)``, or None when it failed (recorded)."""
        try:
            root, up, end = self.load_at(buf, pos, where, None)
        except CkptError as e:
            self.record(failed(where, pos, self.globals_before_failure(buf, pos, where, e), e))
            self.nested_streams(buf, getattr(e, "unpickler", None), where, pos)
            return None
        self.record(PickleFinding(where, pos, [qualified_name(m, n) for m, n in up.globals_seen]), root,
                    up.uncalled_globals())
        self.nested_streams(buf, up, where, pos)
        return root, end

    def pickles_in_a_row(self, buf: PickleBuffer, pos: int, where: str, *, first_required: bool = True,
                         base: int = 0, stop: int | None = None) -> int | None:
        """Read pickles in a row from ``pos`` while the data looks like one; the offset where reading stopped, or
        None when the first, required, one failed. ``base``, ``stop``: the window ``buf[base:stop]`` (``len(buf)``)."""
        n = 0
        size = len(buf) if stop is None else stop
        while pos < size and n < MAX_PICKLES_IN_A_ROW:
            if n and (buf[pos] not in PICKLE_FIRST or buf[pos:pos + 4] == ZIP_LOCAL):
                return pos
            label = where if n == 0 else f"{where} (pickle {n + 1} in a row, byte {pos - base})"
            end = self.parse(buf, pos, label, required=n == 0 and first_required, base=base, stop=size)
            if end is None:
                return None if n == 0 and first_required else pos
            pos = end
            n += 1
        return pos

    # -- containers ------------------------------------------------------------------------------------------
    def any(self, buf: PickleBuffer, where: str, depth: int, f: BinaryIO | None = None) -> Layout:
        """Scan ``buf`` (bytes or mmap, optionally its open file ``f``) as whatever its bytes say it is, by the
        readers' one classifier (:func:`ckptool.formats.detect.head_kinds`, torch.load's order: a zip, a tar
        ``tarfile`` accepts, a legacy stream, safetensors, a pickle), each answer walked in turn until one reads
        (its layout's :attr:`~ckptool.scanning.layouts.Layout.walk`); then as bytes that begin like a pickle of
        any protocol. The file ``torch.load`` would read: its own pickles are not hidden. Returns what it was.

        Raises:
            NotAPickle: none of these, and the first byte is no opcode a pickle begins with.
        """
        if self.inflate_left is None:
            self.inflate_left = INFLATE_BUDGET + MAX_RATIO * len(buf)
        head = bytes(buf[:512])
        for kind in formats.head_kinds(head):
            layout = layouts.head_layout(kind)
            walk: Callable[[PickleBuffer, bytes, str, int, BinaryIO | None], Layout | None] = getattr(
                self, layout.walk)
            walked = walk(buf, head, where, depth, f)
            if walked is not None:
                return layout if layout.read_by_reader else walked
        # what no checkpoint reader reads but a loader may unpack: scan reads inside it
        if head.startswith(wrappers.GZIP_MAGIC):
            self.gzip(buf, where, depth)
            return layouts.GZIP
        if head.startswith(wrappers.NPY_MAGIC):
            self.npy(buf, where, depth)
            return layouts.NPY
        if wrappers.is_zlib(head):
            self.inflated(buf, where, depth, "zlib")
            return layouts.ZLIB
        if head.startswith(wrappers.SEVEN_ZIP_MAGIC):
            plugin("ckptool.scanning.seven_zip:scan_7z")(self, buf, where, depth)
            return layouts.SEVEN_ZIP
        if not head or head[0] not in PICKLE_FIRST:
            raise NotAPickle()
        return self.walk_pickle(buf, head, where, depth, f)

    def walk_zip(self, buf: PickleBuffer, head: bytes, where: str, depth: int, f: BinaryIO | None) -> Layout:
        """The classifier's ``zip``: :meth:`zip`, read as the file torch's loader reads."""
        return self.zip(buf, where, depth, f, loaded=True)

    def walk_tar(self, buf: PickleBuffer, head: bytes, where: str, depth: int, f: BinaryIO | None) -> Layout | None:
        """The classifier's ``legacy-tar`` (a tar ``tarfile`` accepts): :meth:`tar_archive` (a legacy tar, or a tar of
        other files); None when ``tarfile`` cannot read it after all."""
        return self.tar_archive(buf, head, where, depth)

    def walk_legacy(self, buf: PickleBuffer, head: bytes, where: str, depth: int, f: BinaryIO | None) -> Layout:
        """The classifier's ``torch-legacy``: :meth:`legacy`."""
        self.legacy(buf, where, depth)
        return layouts.LEGACY

    def walk_safetensors(self, buf: PickleBuffer, head: bytes, where: str, depth: int,
                         f: BinaryIO | None) -> Layout | None:
        """The classifier's ``safetensors``: a zip appended after its data; None when the header's length runs
        past the end (then read as whatever else the bytes may be)."""
        end = struct.unpack("<Q", head[:8])[0] + 8
        if end > len(buf):
            return None
        self.appended_zip(buf, end, where, depth)
        return layouts.SAFETENSORS

    def walk_tensor_file(self, buf: PickleBuffer, head: bytes, where: str, depth: int,
                         f: BinaryIO | None) -> Layout:
        """A classifier answer with no layout of its own (:func:`ckptool.scanning.layouts.head_layout`): tensor
        bytes and a header, nothing unpickled here; at the top level the registry's reader reads the file
        (:func:`ckptool.scanning.entry.scan_file`)."""
        return layouts.TENSOR_FILE  # :meth:`any` returns the answer's own (its name)

    def walk_pickle(self, buf: PickleBuffer, head: bytes, where: str, depth: int, f: BinaryIO | None) -> Layout:
        """The classifier's ``pickle`` (and bytes that begin like one): :meth:`pickle_file`."""
        self.pickle_file(buf, where, depth)
        return layouts.PICKLE


    def record_global(self, name: str, status: str, reason: str, where: str) -> None:
        """Add the rated name ``name`` (a Hydra target) found at ``where`` to the result's globals."""
        g = self._globals.get((name, status))
        if g is None:
            g = self._globals[name, status] = GlobalFinding(name, status, reason)
            self.res.globals.append(g)
        if where not in g.where:
            g.where.append(where)


    def pickle_file(self, buf: PickleBuffer, where: str, depth: int, *, loaded: bool = True) -> None:
        """A plain pickle (``pickle.load`` and ``torch.load`` read its first pickle), then any data after it."""
        label = where or "pickle at byte 0"
        if loaded:
            self.loaded.add(label)
        end = self.parse(buf, 0, label)
        if end is not None and end < len(buf):
            self.trailing(buf, end, where, depth)

    def trailing(self, buf: PickleBuffer, pos: int, where: str, depth: int, *, base: int = 0,
                 stop: int | None = None) -> None:
        """Data after the structures a loader reads: further pickles in a row, then possibly an appended zip.
        ``base``, ``stop``: the data is the window ``buf[base:stop]`` (its offsets counted from ``base``)."""
        stop = len(buf) if stop is None else stop
        rest = pos
        if buf[pos] in PICKLE_FIRST and buf[pos:pos + 4] != ZIP_LOCAL:
            rest = self.pickles_in_a_row(buf, pos, join_where(where, f"data after the last pickle, byte {pos - base}"),
                                         first_required=False, base=base, stop=stop) or pos
        window = buf if base == 0 and stop == len(buf) else Window(buf, base, stop - base)
        if not self.appended_zip(window, rest - base, where, depth) and rest < stop:
            self.note(f"{stop - rest} bytes at byte {rest - base}{inside(where)} are not a pickle (no loader reads "
                      "them)")

    def appended_zip(self, buf: Container, pos: int, where: str, depth: int) -> bool:
        """Scan the zip whose end record lies after byte ``pos`` of ``buf`` (after a pickle, a safetensors header,
        a legacy stream or a tar), as torch's zip reader (offsets from the file's start) and ``zipfile`` (offsets
        from the zip's start) read it: both views, whichever holds. Returns False when there is no such record."""
        found = end_record(buf)
        if found is None or found[0] < pos:
            return False
        start = zip_start(buf, pos)
        if start is not None and start > pos:
            self.note(f"{start - pos} bytes at byte {pos}{inside(where)} are not a pickle")
        at = start if start is not None else found[0]
        what = "appended at byte" if start is not None else "appended (offsets from the file's start), its end at byte"
        self.note(f"a zip archive is {what} {at}{inside(where)} (zipfile-based tools and torch's zip reader read it "
                  "instead)")
        window = buf if isinstance(buf, Window) else Window(buf, 0, len(buf))
        try:
            self.zip(window, join_where(where, f"appended zip at byte {at}"), depth + 1)
        except CkptError as err:
            self.note(f"the zip at byte {at}{inside(where)} could not be read ({err})")
        return True

    def zip(self, buf: Container, where: str, depth: int, f: BinaryIO | None = None, *,
            loaded: bool = False) -> Layout:
        """Every pickle-bearing member of the zip in ``buf`` (``f``: the same bytes as a file), then data after
        its end. The members are those of torch's central directory and of ``zipfile``'s, both
        (:func:`~ckptool.scanning.directories.zip_directories`). ``loaded``: torch's loader reads this zip (the file
        itself, a DCP item), so the members it unpickles (``data.pkl`` as torch finds it, ignoring case;
        ``constants.pkl`` of a TorchScript archive) are not hidden. Returns what the zip is.

        Raises:
            CorruptCheckpointError: neither torch's reader nor ``zipfile`` reads its directory, or it is empty.
        """
        if depth > MAX_ZIP_DEPTH:
            self.record(PickleFinding(where, 0, [], f"zips nested more than {MAX_ZIP_DEPTH} deep: not scanned"))
            return layouts.ZIP
        f = f if f is not None else as_file(buf)
        size = len(buf)
        if self.inflate_left is None:
            self.inflate_left = INFLATE_BUDGET + MAX_RATIO * size
        top_file = depth == 0 and not where and not source.is_url(self.res.path) and \
            size == os.path.getsize(self.res.path)
        torch_view, entries = zip_directories(f, size, where, self.res.path, top_file, self.note)
        if not entries:
            raise CorruptCheckpointError(f"empty zip archive{inside(where)}")
        recs = TorchRecords(torch_view if torch_view else entries)
        top = recs.prefix or ""
        names = [e.name for e in entries]
        layout = self._zip_layout(f, size, where, depth, entries, recs)
        labels = self._labels = self._duplicate_labels(where, entries, names)
        self._escape_notes(where, names)
        if loaded and torch_view is not None:
            self._mark_loaded(where, layout, recs, names)
        self._case_notes(where, recs, layout.loaded_records or ("data.pkl",))
        if labels:
            self._duplicate_errors(where, entries)
        shared: dict[tuple[int, int, int, int], list[str]] = {}
        for e in self._candidates(entries, names, top, layout):
            self._labels = labels  # (a nested zip, or one in a member's _load_from_bytes stream, has its own)
            self.zip_member(f, e, top, layout, where, depth, shared)
        self._labels = labels
        self._shared_notes(shared)
        if loaded and (layout.storage_record or layout.required_records):
            self._missing_records(where, layout, recs)
        self._after_zip(buf, size, where, depth)
        return layout

    def _zip_layout(self, f: BinaryIO, size: int, where: str, depth: int, entries: list[ZipEntry],
                    recs: TorchRecords) -> Layout:
        """What the zip is: the readers' answer (:func:`ckptool.formats.detect.zip_kind`: a torch.package archive,
        TorchScript, a torch zip, a torch.export archive, whose members its loader unpickles are then read from its
        configs into :attr:`pt2_roles`), or a plain zip."""
        layout = layouts.zip_layout(formats.zip_kind(entries, recs))
        self.torchscript = self.torchscript or (depth == 0 and layout.script)
        if not layout.export:
            return layout
        try:
            self.pt2_roles[where] = plugin("ckptool.formats.pt2:member_roles")(f, size, entries, where or self.res.path)
        except CkptError as err:
            self.note(f"the torch.export configs{inside(where)} could not be read ({err}); members were scanned by "
                      "their first bytes")
        return layouts.EXPORT

    def _escape_notes(self, where: str, names: list[str]) -> None:
        """A note for each member whose path leaves the folder it is extracted to (zip-slip: ``..``, an absolute
        path; :func:`~ckptool.scanning.tar.leaves_archive`). The names are searched as one string first (50,000
        members of a big checkpoint, none suspect)."""
        text = "\n" + "\n".join(names)
        if ".." not in text and "\n/" not in text and "\n\\" not in text and ":" not in text:
            return
        for name in names:
            why = leaves_archive(name)
            if why is not None:
                self.note(f"zip member {name!r}{inside(where)} {why}")

    @staticmethod
    def _duplicate_labels(where: str, entries: list[ZipEntry], names: list[str]) -> dict[int, str]:
        """The labels of the members whose name another member has too (by ``id`` of the entry: the name and the
        local header)."""
        if len(set(names)) == len(names):
            return {}
        dups = {n for n, c in Counter(names).items() if c > 1}
        return {id(e): join_where(where, f"{e.name} (local header at byte {e.header_offset})")
                for e in entries if e.name in dups}

    def _duplicate_errors(self, where: str, entries: list[ZipEntry]) -> None:
        """The result's error for each member whose name an earlier member has: a zip-confusion, which ``inspect``
        and every reader refuse with the same words (:func:`~ckptool.formats.zipdir.duplicate_member`); the scan
        still reads both members (a dangerous global in either makes the verdict dangerous)."""
        seen: set[str] = set()
        for e in entries:
            if e.name in seen:
                why = f"{where + ': ' if where else ''}{duplicate_member(e.name)}; both were scanned"
                self.res.error = why if self.res.error is None else f"{self.res.error}; {why}"
            seen.add(e.name)

    @staticmethod
    def _candidates(entries: list[ZipEntry], names: list[str], top: str, layout: Layout) -> Iterable[ZipEntry]:
        """The members worth a :meth:`zip_member` call: in torch's record layout, tensor records (50,000 in a big
        state_dict) are left out here, as zip_member would skip them, without a call each: the members under the
        top folder's storage folders whose names do not end as a pickle's (in any case)."""
        if not layout.torch_records:
            return entries
        in_storage = map(str.startswith, names, repeat(tuple(top + d for d in _STORAGE_DIRS)))
        pickled = map(str.endswith, map(str.lower, names), repeat(_PICKLE_SUFFIXES))
        return compress(entries, map(or_, map(not_, in_storage), pickled))

    def _shared_notes(self, shared: dict[tuple[int, int, int, int], list[str]]) -> None:
        """A note for each group of members that share one local header (scanned once)."""
        for group in shared.values():
            if len(group) > 1:
                more = f" and {len(group) - 4} more" if len(group) > 4 else ""
                self.note(f"members {', '.join(group[1:4])}{more} have the data of {group[0]} (one local header): "
                          "scanned once")

    def _after_zip(self, buf: Container, size: int, where: str, depth: int) -> None:
        """The data after the zip's end record, if any (:meth:`trailing`)."""
        end = zip_end(buf)
        if end is None or end >= size:
            return
        if isinstance(buf, Window):  # the bytes after the zip, by themselves (hostile or odd: rarely big)
            self.trailing(buf[end:], 0, join_where(where, f"data after the zip's end at byte {end}"), depth)
        else:
            self.trailing(buf, end, where, depth)

    def _missing_records(self, where: str, layout: Layout, recs: TorchRecords) -> None:
        """A finding when ``data.pkl`` (as torch's reader finds it) names a storage whose record the zip lacks
        (``data/<key>``, ``.data/<key>.storage`` in a torch.package): its loader fails there, and the readers
        refuse the file as damaged, so the scan cannot call it safe; likewise a record the loader requires
        (:attr:`Layout.required_records`)."""
        absent = [r for r in layout.required_records if recs.find(r) is None]
        if absent:
            self.record(PickleFinding(join_where(where, absent[0]), 0, [],
                                      f"the {layout.format} archive has no {absent[0]}: its loader fails there"))
        e = recs.find("data.pkl")
        label = None if e is None else (self._labels.get(id(e)) or join_where(where, e.name))
        storages = self.storages_of.get(label or "")
        if not storages:
            return
        problem = record_problem(recs, layout.storage_record, storages)  # a record missing or short
        if problem:
            self.record(PickleFinding(f"{label} (its storages)", 0, [], problem))

    def _mark_loaded(self, where: str, layout: Layout, recs: TorchRecords, names: list[str]) -> None:
        """Mark the members torch's loader unpickles in a zip it reads (as it finds them: ignoring case)."""
        if layout.export:  # torch.export.load unpickles these members
            self.loaded.update(join_where(where, n) for n in self.pt2_roles.get(where, (set(), set()))[0])
        for rec in layout.loaded_records:
            e = recs.find(rec)
            if e is not None:
                self.loaded.add(self._labels.get(id(e)) or join_where(where, e.name))
        if layout.script:  # torch.jit.load also unpickles the source ranges of code/
            self.loaded.update(join_where(where, n) for n in names if n.endswith(".debug_pkl"))

    def _case_notes(self, where: str, recs: TorchRecords, records: Iterable[str]) -> None:
        """A note for each pickle record several members match but for case, or only in another case (torch's
        reader ignores case, ``zipfile`` does not)."""
        for rec in records:
            found = recs.variants(rec)
            exact = (recs.prefix or "") + rec
            if len(found) > 1 or (found and found[0].name != exact):
                chosen = recs.find(rec)
                self.note(f"the zip{inside(where)} holds {', '.join(repr(e.name) for e in found)} for {rec}: "
                          f"torch's reader ignores case and reads {chosen.name if chosen else None!r}, zipfile-based "
                          f"tools read {exact!r}{'' if exact in {e.name for e in found} else ' (absent)'}; all were "
                          "scanned")

    def zip_member(self, f: BinaryIO, e: ZipEntry, top: str, layout: Layout, where: str, depth: int,
                   shared: dict[tuple[int, int, int, int], list[str]] | None = None) -> None:
        """One member, read if its name or first bytes say pickle or zip; data another member already had (same
        local header, sizes, method) is not inflated again; inflating is capped (:data:`INFLATE_BUDGET`)."""
        name = e.name
        label = self._labels.get(id(e)) or join_where(where, name)
        if name.endswith("/"):
            return
        is_pickle = self._member_role(e, top, layout, where)
        if is_pickle is None or not first_of_group(shared, e, label):
            return
        try:
            head = read_member_head(f, e, label)
        except CkptError as err:
            self._unreadable_member(label, is_pickle, err)
            return
        nested = head.startswith(ZIP_LOCAL)
        looks_pickled = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
        npy = head.startswith(wrappers.NPY_MAGIC)  # an .npz member: an object array holds a pickle
        wrapped = wrappers.is_wrapper(head)  # a .pkl.gz, a 7z, a zlib joblib dump inside the zip
        if not (is_pickle or nested or looks_pickled or npy or wrapped) or not self._within_budget(e, label):
            return
        try:
            data = read_member(f, e, label, check_crc=False)
        except CkptError as err:
            self._unreadable_member(label, is_pickle, err)
            return
        self._check_crc(e, data, label)
        if npy:
            self.npy(data, label, depth)
            return
        if wrapped:
            self.member_file(data, label, depth + 1)
            return
        if nested:
            self.note(f"member {label} is a zip archive; scanned it too")
            try:
                self.zip(data, label, depth + 1)
            except CkptError as err:
                self.note(f"the zip in member {label} could not be read ({err})")
            return
        rest = self.pickles_in_a_row(data, 0, label, first_required=is_pickle)
        if rest is not None and rest < len(data):
            self.trailing(data, rest, label, depth)

    def _member_role(self, e: ZipEntry, top: str, layout: Layout, where: str) -> bool | None:
        """Whether the member is a pickle by its name (or a torch.export config's word); None for tensor bytes and
        TorchScript source, which no loader unpickles (not read)."""
        name = e.name
        rel = name[len(top):] if name.startswith(top) else name
        pickled, raw = self.pt2_roles.get(where, (set(), set()))
        storage = (layout.torch_records and rel.startswith(_STORAGE_DIRS)) or name in raw
        is_pickle = name.lower().endswith(_PICKLE_SUFFIXES) or name in pickled
        return None if storage and not is_pickle else is_pickle

    def _within_budget(self, e: ZipEntry, label: str) -> bool:
        """Take the member's inflated size from :attr:`inflate_left`; False (an unreadable finding) past it."""
        cost = e.file_size if e.method != 0 else e.compress_size
        if self.inflate_left is None:
            return True
        if cost > self.inflate_left:
            self.record(PickleFinding(label, 0, [], (
                f"not read: the file's members come to more than {self.budget_words} once inflated (members sharing "
                "or overlapping their data: a zip bomb?)")))
            return False
        self.inflate_left -= cost
        return True

    def _check_crc(self, e: ZipEntry, data: bytes, label: str) -> None:
        """Note a member whose bytes fail its CRC-32; remember it (:meth:`take_preparsed`) when they match."""
        crc_ok = (e.crc & 0xFFFFFFFF) == zlib.crc32(data)
        if not crc_ok:
            self.note(f"member {label} fails its CRC-32 check (torch does not check it); scanned anyway")
        self._crc_checked = label if crc_ok else None
