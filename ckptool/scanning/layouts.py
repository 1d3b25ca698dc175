"""What ``ckptool scan`` found a container to be (:class:`Layout`): the format name it reports, and the facts its
walk follows from that (which records torch's loader unpickles, which folders hold tensor bytes, whether the
safetensors header is read). The walk asks these facts; it never compares the names."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ckptool.formats import detect

__all__ = ["CONFIG", "EXPORT", "GZIP", "HEAD_LAYOUTS", "LEGACY", "LEGACY_TAR", "NPY", "PICKLE", "SAFETENSORS",
           "SEVEN_ZIP", "TAR", "TENSOR_FILE", "TORCHSCRIPT", "TORCH_PACKAGE", "TORCH_ZIP", "ZIP", "ZIP_LAYOUTS",
           "ZLIB", "Layout", "head_layout", "zip_layout"]


@dataclass(frozen=True)
class Layout:
    """One kind of container the scan walks."""

    #: the name the scan reports (:attr:`ckptool.scanning.results.ScanResult.format`)
    format: str
    #: the records torch's loader unpickles from a zip it reads (found as torch finds them, ignoring case)
    loaded_records: tuple[str, ...] = ()
    #: torch's record layout: members under ``data/``, ``constants/``, ``.data/`` and ``code/`` are tensor bytes
    #: and TorchScript source, which no loader unpickles
    torch_records: bool = False
    #: a TorchScript archive: ``code/`` sources; ``torch.jit.load`` also unpickles code/'s ``.debug_pkl`` members
    script: bool = False
    #: a torch.export archive: the members its loader unpickles are named by its configs
    export: bool = False
    #: a zip no torch loader recognises (no ``data.pkl``, not torch.export): a DCP item so is no torch.save record
    bare_zip: bool = False
    #: "the zip holds no pickle" is worth a note when the walk found none
    expects_pickles: bool = False
    #: the safetensors header is read as the readers read it (its errors are the scan's error)
    header: bool = False
    #: a plain pickle file (bytes that merely begin like one, a PNG, are "not a pickle")
    plain_pickle: bool = False
    #: where its loader finds the bytes of the storage ``{key}`` that ``data.pkl`` names (``""``: not checked); a
    #: missing record makes the file unreadable, as it makes the readers refuse it
    storage_record: str = ""
    #: the records its loader cannot do without (``torch.jit.load`` fails on an archive without ``data.pkl``)
    required_records: tuple[str, ...] = ()
    #: a classifier answer with no layout of its own (:func:`head_layout`): a registry format of tensor bytes and
    #: a header, no pickle, whose reader reads the file as every command reads it (its error is the scan's error)
    read_by_reader: bool = False
    #: the :class:`~ckptool.scanning.pickles.Scanner` method that walks a file the classifier's first bytes call
    #: this (:data:`ckptool.formats.detect.HEAD_ACCEPTS`); ``""`` for the layouts a zip's members decide
    walk: str = ""


ZIP = Layout(detect.ZIP, bare_zip=True, expects_pickles=True, walk="walk_zip")
TORCH_ZIP = Layout(detect.TORCH_ZIP, ("data.pkl",), torch_records=True, expects_pickles=True,
                   storage_record="data/{key}")
TORCHSCRIPT = Layout(detect.TORCHSCRIPT, ("data.pkl", "constants.pkl"), torch_records=True, script=True,
                     storage_record="data/{key}", required_records=("data.pkl",))
EXPORT = Layout(detect.PT2, export=True)
#: a torch.package archive: ``torch.load`` would read a ``data.pkl`` it holds; its other pickles are read by
#: ``PackageImporter.load_pickle``, by name (hidden to torch.load), its modules are code (shipped_code)
TORCH_PACKAGE = Layout(detect.TORCH_PACKAGE, ("data.pkl",), expects_pickles=True,
                       storage_record=".data/{key}.storage")
#: the layout of each answer of :func:`ckptool.formats.detect.zip_kind`, by the format it reports
ZIP_LAYOUTS: dict[str, Layout] = {layout.format: layout for layout in (TORCH_PACKAGE, TORCHSCRIPT, TORCH_ZIP, EXPORT)}

LEGACY_TAR = Layout(detect.LEGACY_TAR, walk="walk_tar")
LEGACY = Layout(detect.TORCH_LEGACY, walk="walk_legacy")
SAFETENSORS = Layout(detect.SAFETENSORS, header=True, walk="walk_safetensors")
PICKLE = Layout(detect.PICKLE, plain_pickle=True, walk="walk_pickle")
#: a tar archive with no legacy torch record (a NeMo ``.nemo`` archive): its members are scanned as files
TAR = Layout("tar")
#: a gzip stream: its inflated bytes are scanned as a file
GZIP = Layout("gzip")
#: a zlib stream (joblib's ``compress``), a 7z archive: their bytes are scanned as files; a .npy array (an object
#: array's pickle is read)
ZLIB = Layout("zlib")
SEVEN_ZIP = Layout("7z")
NPY = Layout("npy")
#: a config that makes a loader run code (a Hugging Face ``auto_map``, NeMo's Hydra ``_target_`` entries)
CONFIG = Layout("config")
#: what :func:`head_layout` gives a classifier answer with no layout here, under the answer's name
TENSOR_FILE = Layout("tensor-file", read_by_reader=True, walk="walk_tensor_file")
#: the layout of each answer of the one classifier of first bytes (:func:`ckptool.formats.detect.head_kinds`)
HEAD_LAYOUTS: dict[str, Layout] = {layout.format: layout for layout in (ZIP, LEGACY_TAR, LEGACY, SAFETENSORS, PICKLE)}


def head_layout(kind: str) -> Layout:
    """The layout of the classifier's answer ``kind`` (:func:`ckptool.formats.detect.head_kinds`): its own in
    :data:`HEAD_LAYOUTS`, else one that walks no pickle and has the registry's reader read the file
    (:attr:`Layout.read_by_reader`), so that a format added to the registry and the classifier is scanned without a
    layout here."""
    found = HEAD_LAYOUTS.get(kind)
    return found if found is not None else replace(TENSOR_FILE, format=kind)


def zip_layout(kind: str | None) -> Layout:
    """The layout of the zip :func:`ckptool.formats.detect.zip_kind` calls ``kind`` (None: :data:`ZIP`)."""
    return ZIP_LAYOUTS.get(kind or "", ZIP)
