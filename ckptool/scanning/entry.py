"""``ckptool scan``: list every global each pickle in a file would import, and say whether loading it is safe.

How a global is classified
--------------------------
Each global gets a status and a level from :func:`ckptool.model.allowlist.classify_global` (the rules, with the
reason for each list, are in :mod:`ckptool.model.allowlist`):

* **safe** (status ``allowed``): ``torch.load(weights_only=True)`` accepts it
  (:data:`ckptool.model.allowlist.WEIGHTS_ONLY_ALLOWED`, taken from torch's
  ``_weights_only_unpickler._get_allowed_globals()``). In a TorchScript archive (a zip holding ``constants.pkl``,
  the test ``torch.load`` itself uses to hand the file to ``torch.jit.load``) the names that TorchScript's C++
  unpickler resolves without Python are safe too: ``__torch__.*`` and ``torch.jit._pickle.*``.
* **needs-trust** (status ``needs-trust`` or ``unknown``): a library class or rebuilder that runs no code of the
  file's choosing (``torch.nn`` modules, optimizers, numpy arrays and RNG state, ``argparse.Namespace``, ``pathlib``
  paths, DCP metadata records), or a class on no list (``mypkg.Net``: loading imports its package).
* **dangerous**: a known process, file, network, import or code-evaluation gadget (``os.system``,
  ``builtins.eval``, ``subprocess.Popen``, ``functools.partial``, ``torch.load`` inside a pickle...), or a
  function on no list: loading would call it with arguments the file chooses.

A file's ``verdict`` (:class:`ckptool.model.verdict.Verdict`, computed by
:func:`ckptool.model.verdict.verdict_of`) is ``dangerous`` when any global or shipped code is (even if the pickle is
damaged after it: ``torch.load`` would already have run it), else ``error`` when a pickle (or the file) could not be
read to its end (ckptool cannot vouch for what follows), else ``needs-trust``, else ``incomplete`` when the data is
cut short, else ``safe``. ``ckptool scan --strict`` is a policy on that verdict (needs-trust exits 1, as dangerous
does), not a second vocabulary.

Which pickles are read
----------------------
Scanning looks at the bytes, never at the file name, and reads every place a loader might find a pickle:

* a zip (torch >= 1.6 or TorchScript): the members of the central directory torch's reader reads and of the one
  ``zipfile`` reads (they differ for hand-made zips: ZIP64 records, entries past the count, data before the zip;
  :mod:`ckptool.formats.zipdir`), ``data.pkl`` as torch finds it (ignoring case); every member named ``*.pkl`` /
  ``*.debug_pkl`` / ``*.pickle`` (in any case) in any folder, duplicates included, with a bad CRC-32 noted but
  still read (torch does not check it); members that are themselves zips are scanned recursively; other members
  that start like a pickle are read too;
* a ``torch.export`` archive (``.pt2``): the members its loader unpickles, whatever their first bytes: by name
  (sample inputs, every ``data/constants/opaque_obj_*`` / ``custom_obj_*`` member, which ``torch.export.load``
  unpickles whatever the configs say) and by every payload config (pickled payloads:
  :func:`ckptool.formats.pt2.member_roles`); its raw tensor members are not read as pickles;
* a legacy stream: its five pickles (magic number, protocol, ``sys_info``, main object, storage keys);
* a legacy tar (torch < 0.4; any file whose first block ``tarfile`` accepts, V7 tars without ``ustar`` too, as
  ``torch.load`` tries tar first): its ``sys_info``, ``pickle``, ``storages`` and ``tensors`` members (the last two
  as pickles between raw blocks, as ``legacy_load`` reads them);
* a plain pickle (whatever its name: ``.pt``, ``.bin``...);
* in every case, data after the last pickle: further pickles in a row are read, and a zip appended to the file
  (which ``zipfile`` and some scanners see instead of the leading pickle) is scanned as well;
* safetensors files hold no pickle: their header is checked and they are safe;
* a torch.distributed.checkpoint folder (or its ``.metadata`` / ``.distcp`` files) is read the way DCP reads it:
  ``.metadata``, then each record's byte range of the ``.distcp`` files (:mod:`ckptool.scanning.dcp`);
* in a folder, also what its loaders read outside it: the tag folder DeepSpeed's ``latest`` names and symlinked tag
  folders, the shards an ``*.index.json`` names (``../x``, absolute, through a symlinked subfolder), each scanned
  with a note saying which name leads there (:mod:`ckptool.scanning.targets`); a folder (or index) in which
  nothing is found is a :class:`~ckptool.errors.UsageError`, not an empty pass.

Each pickle found says whether ``torch.load`` reads it today (``hidden`` when not: another zip member, a nested
zip, data after the end): ``ckptool inspect`` reports the same analysis, so both give one verdict and say where a
hidden pickle sits. The tensor bytes (``data/<key>`` records, DCP tensor data, legacy storage blocks) are never read:
scanning costs what ``inspect`` costs. A file whose content is a known library file type is recognised
(:func:`ckptool.model.allowlist.recognise_file`: accelerate's RNG state), to say what a needs-trust file is.

Code that ships in a zip outside any pickle (native libraries, torch.package modules, TorchScript source) is
reported too, and counts in the verdict (:mod:`ckptool.scanning.shipped_code`).

Nothing is imported or called while scanning: the pickles are read by :mod:`ckptool.formats.unpickler`.
"""


from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any, BinaryIO, cast

from ckptool import _source as source
from ckptool._source import RangeView
from ckptool.errors import CkptError, TruncatedError, UnsupportedError
from ckptool.formats import detect as formats
from ckptool.formats import plugin
from ckptool.formats.detect import CHECKPOINT_SUFFIXES, INDEX_SUFFIX
from ckptool.formats.dtypes import EXPAND_FLOOR, MAX_EXPAND, element_size, numel, storage_element, tensor_dtype
from ckptool.formats.nodes import TensorNode
from ckptool.formats.pickle_check import PickleBuffer
from ckptool.model.allowlist import is_importable_name, recognise_file
from ckptool.model.graph import TooDeepError, iter_tensors
from ckptool.model.units import human_bytes
from ckptool.scanning import layouts
from ckptool.scanning.byte_windows import ZIP_EOCD, ZIP_LOCAL, zip_end
from ckptool.scanning.configs import HF_CONFIG_NAMES, MAX_CONFIG_BYTES, is_code_config, parse_config
from ckptool.scanning.layouts import Layout
from ckptool.scanning.pickles import NotAPickle, Preparsed, Scanner
from ckptool.scanning.results import (
    EXIT_CODES,
    STRICT_EXIT_CODES,
    GlobalFinding,
    PickleFinding,
    ScanResult,
    exit_status,
)
from ckptool.scanning.shipped_code import CodeScanner
from ckptool.scanning.targets import index_refusal, iter_paths, iter_targets, unreadable

__all__ = ["CHECKPOINT_SUFFIXES", "EXIT_CODES", "STRICT_EXIT_CODES", "GlobalFinding", "PickleFinding", "ScanResult",
           "add_results", "combine_results", "exit_status", "iter_paths", "iter_targets", "scan", "scan_file",
           "scan_listed", "scans_as_one", "unreadable"]


def scan_file(path: str | os.PathLike[str], *,
              preparsed: Mapping[str, Preparsed] | None = None, key_paths: bool = True) -> ScanResult:
    """Scan one file, or one DCP folder: every pickle in it (see the module docstring), each global classified.

    Reads the file without importing or running anything from it, in time and memory bounded by its size (tensor
    bytes are never read). Problems with the file's content never raise: they make the result's ``verdict``
    ``error`` (with ``error`` or a pickle's ``error`` saying what happened), ``incomplete`` when the data is cut
    short (``incomplete``, a pickle's ``truncated``), or ``dangerous`` when a dangerous global was found first.
    ``preparsed`` maps the ``where`` of a pickle the caller already read whole with the
    restricted unpickler (``inspect``: ``archive/data.pkl``) to its globals, root and end offset (or None), which
    are then not read again. ``key_paths=False`` leaves each pickle's :attr:`~PickleFinding.key_paths` empty (a
    walk of its object graph a pickle that names a global not allowed), for a report that does not show them
    (``scan``'s text report); the verdicts are the same.

    Returns:
        A :class:`ScanResult`; its ``exit_code`` is 0 (safe), 1 (dangerous), 2 (unreadable), 4 (needs trust) or
        5 (incomplete), its ``strict_exit_code`` 0 (safe), 1 (dangerous or needs trust), 2 (unreadable) or
        5 (incomplete).
    """
    path = os.fspath(path)
    if path.endswith(INDEX_SUFFIX) and not source.is_url(path) and os.path.isfile(path):
        refused = index_refusal(path)
        if refused is not None:  # the set's readers refuse it: so does scan (never safe with a shard skipped)
            from ckptool.formats.sharded import index_format  # noqa: PLC0415  (imported when a set is met)

            return ScanResult(path, index_format(path), error=refused)
    url = source.is_url(path)
    st = None if url else _stat(path)  # one stat a file: the folder test here, check_readable, the open in _scan_one
    dcp = _dcp_part(path) if (st is not None and stat.S_ISDIR(st.st_mode)) or path.endswith(_DCP_NAMES) else None
    if dcp is not None:
        from ckptool.scanning.dcp import scan_dcp_folder  # noqa: PLC0415  (imported when a DCP folder is met)

        return scan_dcp_folder(*dcp)
    if url:  # its opens share one HEAD and the ranges fetched (format check, directory, code finder)
        with source.object_reads(path):
            return _scan_one(path, preparsed, key_paths)
    return _scan_one(path, preparsed, key_paths, st)


def _stat(path: str) -> os.stat_result | None:
    """``os.stat(path)`` of a local path; None where it fails (its callers ask again, and say why)."""
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


def scans_as_one(path: str | os.PathLike[str]) -> bool:
    """True when :func:`scan_file` reads ``path`` as one unit, as ``ckptool scan PATH`` does: a file or URL, or a
    DCP folder (its ``.metadata`` and every record); False for any other local folder (a sharded set, a DeepSpeed or
    Megatron folder), whose files are scanned one by one, each as it is opened."""
    path = os.fspath(path)
    return not os.path.isdir(path) or _dcp_part(path) is not None


def _scan_one(path: str, preparsed: Mapping[str, Preparsed] | None, key_paths: bool = True,
              st: os.stat_result | None = None) -> ScanResult:
    """:func:`scan_file` of the file (or URL) ``path``; ``st``: its ``os.stat``, made already."""
    res = ScanResult(path)
    # the pickles, and the code that ships in each zip (scanning/shipped_code.py)
    sc = CodeScanner(res, preparsed, key_paths=key_paths)
    url = source.is_url(path)
    start = source.thread_bytes_transferred() if url else 0
    layout: Layout | None = None  # what the file was found to be (None: unreadable)
    head = b""
    try:
        formats.check_readable(path, st)
        small = source.read_small(path, st) if st is not None else None  # no file object for a small file
        if small is not None:
            head = small[:2]
            layout = _walk_bytes(sc, path, small, None)
        else:
            # a URL: the zip / safetensors paths read by range (its directory, pickles and headers); others copied
            with source.open_binary(path, mode=None if st is None else st.st_mode) as f, \
                    source.whole_view(f, lazy=_indexed) as buf:
                head = bytes(buf[:2])
                layout = _walk_bytes(sc, path, buf, f)
    except NotAPickle:
        if is_code_config(path) and not url:
            layout = _scan_code_config(sc, path)
            res.format = layout.format
        else:
            res.error = _not_a_pickle(path)
    except TruncatedError as e:  # a zip without its end of central directory: cut short, not unreadable
        res.incomplete.append(str(e))
    except CkptError as e:
        res.error = str(e)
    except RecursionError:
        res.error = f"{path}: nested too deeply to scan"
    if layout is not None:
        _layout_findings(res, layout, head)
    if type(sc.root) is dict:
        res.recognised = recognise_file(sc.root, [g.name for g in res.globals])
    if sc.root is not None:
        try:
            res.notes += _expansion_notes(sc.root, sc.root_bytes)
        except TooDeepError as e:  # the limit of every walk of the graph (inspect's refusal, in its words)
            res.error = str(e) if res.error is None else f"{res.error}; {e}"
    if url:
        res.bytes_read = source.thread_bytes_transferred() - start
    return res


def _walk_bytes(sc: CodeScanner, path: str, buf: Any, f: BinaryIO | None) -> Layout:
    """The walk of the file ``path`` whose bytes are ``buf`` (``f``: the open file, or None), as its bytes say
    (:meth:`~ckptool.scanning.pickles.Scanner.any`); then the registry's reader of a format with no layout of its
    own. Returns what the file was found to be (the result's ``format`` set)."""
    layout = sc.any(buf, "", 0, f)
    sc.res.format = layout.format
    if layout.header:
        plugin("ckptool.formats.safetensors:read_header")(path)
    elif layout.read_by_reader:
        _read_by_reader(path, layout.format)
    return layout


def _read_by_reader(path: str, fmt: str) -> None:
    """A classifier answer with no scan layout of its own (:func:`ckptool.scanning.layouts.head_layout`): the
    registry's reader of ``fmt`` reads the file's tensors as every command reads them (no tensor bytes).

    Raises:
        UnsupportedError: ``fmt`` is no registry format, or one whose structure is a pickle
            (:attr:`ckptool.readers.Format.pickled`): a scan that walked no pickle does not say safe.
        CkptError: what the reader raises (a damaged header).
    """
    opened = plugin("ckptool.readers:Opened")(path, fmt, path)
    try:
        pickled = opened.spec.pickled
    except KeyError:  # a classifier answer the registry does not list
        pickled = True
    if pickled:
        raise UnsupportedError(f"{path}: scan has no layout for a {fmt} file, so its pickles were not walked")
    opened.state_dict()


#: the names of the files of a DCP folder (``.metadata``, ``*.distcp``), the only files :func:`scan_file` reads
#: as a part of a folder (:func:`_dcp_part`); the code of the folder formats is imported when a folder is met:
#: a scan of one file does without it
_DCP_NAMES = (".metadata", ".distcp")


def _dcp_part(path: str) -> tuple[str, str | None] | None:
    """``(folder, part)`` when ``path`` is a folder the folder classifier names a format written as
    ``torch.distributed.checkpoint`` (:func:`ckptool.formats.folders.is_dcp_unit`: DCP, Megatron-Core's torch_dist)
    (``part`` None), or the ``.metadata`` or a ``.distcp`` file of one (``part`` = its file name), else None."""
    from ckptool.formats import folders  # noqa: PLC0415  (the folder formats' code, imported when one is met)

    folder, name = (path, None) if os.path.isdir(path) else os.path.split(os.path.abspath(path))
    if name is not None and name != ".metadata" and not name.endswith(".distcp"):
        return None
    try:
        unit = folders.is_dcp_unit(folders.listing(folder))
    except OSError:  # a folder that cannot be listed is no unit: its walk reports it (an unreadable row)
        return None
    if not unit:
        return None
    return (path, None) if name is None else (os.path.dirname(path) or ".", name)


def _indexed(view: RangeView) -> bool:
    """True for the layouts scanned through their index, which a remote file gives by range requests: safetensors
    (its header) and a zip with nothing after its end record (its directory and members). Anything else is walked
    from the start (pickles in a row, data appended after a zip) and read whole."""
    head = view[:512]
    if head[8:9] == b"{":
        return True
    # zip_end only takes len() and slices, which a RangeView gives by range requests
    return head.startswith((ZIP_LOCAL, ZIP_EOCD)) and zip_end(cast("PickleBuffer", view)) == len(view)


def _expansion_notes(root: Any, counted: tuple[int, int] | None = None) -> list[str]:
    """A note (not a danger: nothing runs) when the tensors of the pickle torch loads are far larger dense than the
    bytes their storages hold, past the budget every command that makes them dense holds to
    (:mod:`ckptool.readers.budget`: :data:`~ckptool.formats.dtypes.MAX_EXPAND` times, above
    :data:`~ckptool.formats.dtypes.EXPAND_FLOOR`): a stride-0 view such as ``zeros(1).expand(2**20, 2**20)``.
    ``counted``: the (dense, storage) bytes of ``root``'s tensors as ``inspect`` added them up listing the tensors;
    within the budget they spare the walk, past it the walk names the most expanded tensor.

    Raises:
        TooDeepError: ``root`` nests containers deeper than :data:`ckptool.model.graph.MAX_DEPTH` (the walk every
            command that lists the tensors makes: ``inspect`` refuses such a file in the same words).
    """
    if counted is not None and counted[0] <= max(MAX_EXPAND * counted[1], EXPAND_FLOOR):
        return []
    held: dict[str, int] = {}
    dense = 0
    worst: tuple[float, str, TensorNode, int, int] | None = None
    # (tensor, storage) element sizes per (storage class, dtype global) pair: the lookups once per pair, not per
    # tensor (a 50,000-tensor file has one or two pairs); the placeholders live as long as ``root``
    sizes: dict[tuple[int, int], tuple[int, int]] = {}
    try:
        for key, t, _rg in iter_tensors(root):
            ref = t.storage
            if ref is None:
                continue
            pair = (id(ref.storage_type), id(t.dtype_global))
            each = sizes.get(pair)
            if each is None:
                each = sizes[pair] = (element_size(tensor_dtype(t)), storage_element(ref)[1])
            n, stored = numel(t.shape) * each[0], ref.numel * each[1]
            held[str(ref.key)] = stored
            dense += n
            if worst is None or n / max(stored, 1) > worst[0]:
                worst = (n / max(stored, 1), key, t, n, stored)
    except TooDeepError:  # what inspect refuses: the caller makes it the file's error
        raise
    except (CkptError, TypeError, ValueError):  # a malformed tensor: what the scan reports already
        return []
    if worst is None or dense <= max(MAX_EXPAND * sum(held.values()), EXPAND_FLOOR):
        return []
    factor, key, t, n, stored = worst
    return [(f"tensor {key!r} {list(t.shape)} is {human_bytes(n)} dense over a storage of {human_bytes(stored)} "
             f"({factor:.3g}x: a view that repeats elements, as expand() saves); commands that make tensors dense "
             f"(convert, diff, average, report) refuse it past --max-expand {MAX_EXPAND:g}")]


def combine_results(path: str, fmt: str, parts: Iterable[tuple[str, ScanResult]]) -> ScanResult:
    """One result for a set of files (the shards of a sharded checkpoint): every part's pickles, globals, notes and
    errors, each ``where`` prefixed by the part's name (``shard.bin!archive/data.pkl``)."""
    res = ScanResult(path, fmt)
    add_results(res, parts)
    return res


def add_results(res: ScanResult, parts: Iterable[tuple[str, ScanResult]]) -> None:
    """Add to ``res`` every part's pickles, globals, notes, cut-short parts, code and errors, each ``where`` prefixed
    by the part's name (``shard.bin!archive/data.pkl``): what :func:`combine_results` and ``inspect`` of a model
    folder (the files beside its weights that ``scan`` of the folder reads) report as one result."""
    found: dict[tuple[str, str], GlobalFinding] = {(g.name, g.status): g for g in res.globals}
    errors = [res.error] if res.error else []
    for name, part in parts:
        res.pickles += [replace(p, where=f"{name}!{p.where}", globals=list(p.globals)) for p in part.pickles]
        for g in part.globals:
            acc = found.get((g.name, g.status))
            if acc is None:
                acc = found[g.name, g.status] = GlobalFinding(g.name, g.status, g.reason)
                res.globals.append(acc)
            acc.where += [f"{name}!{w}" for w in g.where]
        res.notes += [f"{name}: {n}" for n in part.notes]
        res.incomplete += [f"{name}: {n}" for n in part.incomplete]
        res.code += [replace(c, member=f"{name}!{c.member}") for c in part.code]
        if part.error:
            errors.append(f"{name}: {part.error}")
    res.error = "; ".join(errors) or None


def _layout_findings(res: ScanResult, layout: Layout, head: bytes) -> None:
    """What the layout found says beyond the pickles: a plain pickle failing at once with no global is no pickle
    at all (a PNG starts with a byte that is also an opcode), unless it is a pickle cut short (its PROTO header,
    ``head``: the file's first two bytes); so is one without that header whose globals are all no Python name (a
    YAML file starting ``chat_template:`` reads as a GLOBAL opcode, no loader can import it); a zip holding no
    pickle."""
    first = res.pickles[0] if res.pickles else None
    names_only = bool(res.globals) and not _protocol_header(head) and \
        all(not is_importable_name(g.name) for g in res.globals)
    if layout.plain_pickle and first is not None and first.error and (
            names_only or (not res.globals and not (first.truncated and _protocol_header(head)))):
        res.error = _not_a_pickle(res.path)
        if res.globals:  # what no loader can import is not listed as a global of a pickle that is not one
            res.globals, res.pickles = [], []
    if layout.expects_pickles and not res.pickles and not res.error:
        res.notes.append("the zip holds no pickle")


def _protocol_header(head: bytes) -> bool:
    """``head`` (a file's first two bytes) is the PROTO opcode of protocol 2 to 5, as ``pickle.dump`` begins: a
    pickle cut short, not other bytes whose first byte happens to be an opcode."""
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _not_a_pickle(path: str) -> str:
    try:
        formats.detect_format(path)
    except CkptError as e:
        return str(e)
    return f"{path} is not a pickle, a torch checkpoint or safetensors; nothing to scan"


#: file name endings scanned inside a directory (explicit file arguments are always scanned)


def _scan_code_config(sc: Scanner, path: str) -> Layout:
    """A config that makes a loader run code (:func:`~ckptool.scanning.configs.is_code_config`): a Hugging
    Face config's ``auto_map`` modules (:func:`~ckptool.scanning.remote_code.hf_remote_code`) into the result's
    code, a NeMo config's Hydra targets into its globals; one that cannot be read within the bounds is the
    result's error."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if os.path.basename(path) in HF_CONFIG_NAMES:
            # the module parser (ast, hashlib) loads only for a folder that has such a config
            from ckptool.scanning.remote_code import hf_remote_code  # noqa: PLC0415

            found, notes = hf_remote_code(path, data)
            sc.res.code += found
            sc.res.notes += notes
        else:
            parse_config(data, os.path.basename(path))  # the bounds: an error here is the file's error
            sc.config_member(data, os.path.basename(path))
    except (CkptError, OSError) as err:
        sc.res.error = f"{path}: {err}"
    return layouts.CONFIG


def scan(paths: Iterable[str | os.PathLike[str]], *, key_paths: bool = True) -> list[ScanResult]:
    """:func:`scan_file` for everything :func:`iter_paths` yields (files as given, directories walked, DCP folders
    as one each); ``key_paths``: :func:`scan_file`'s.

    Raises:
        InputNotFoundError: a path does not exist.
        UsageError: a directory (or a sharded index) holds no checkpoint file.
    """
    return [scan_listed(p, notes, key_paths=key_paths) for p, notes in iter_targets(paths)]


def scan_listed(path: str, notes: list[str], *, key_paths: bool = True) -> ScanResult:
    """:func:`scan_file` of one path :func:`iter_targets` yielded with ``notes`` (added to its result); a path it
    could not list or read (:func:`unreadable`) is a result with that error, not read."""
    why = unreadable(notes)
    if why is not None:
        return ScanResult(path, error=why)
    res = scan_file(path, key_paths=key_paths)
    res.notes += notes
    return res
