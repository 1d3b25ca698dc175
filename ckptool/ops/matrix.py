"""The support matrix: for every checkpoint format and every ckptool operation, what happens today.

Data only. ``MATRIX[(format, operation)]`` is a :class:`Cell`:

- ``works``: the operation succeeds on that format; ``reason`` is a phrase its output contains (scan: the verdict
  of the fixture, e.g. DeepSpeed's optimizer files are ``DANGEROUS`` because of ``fragment_address``);
- ``refused``: it stops with one ``Error:`` line containing ``reason`` (exit 1 or 2, never 3); ``route`` is the
  nearest route that works;
- ``bug``: what it does today is wrong (a refusal whose message misleads or gives no route, or an output that
  claims more than was checked); ``reason`` is the phrase it prints today, ``route`` the way around it.

``docs/formats.md`` holds a table generated from this one (``python docs/generate.py``), and
``tests/test_matrix.py`` runs every cell through the CLI (``load_into`` through the Python API) on a fixture of
that format and checks it behaves as written here. Change a cell together with the behaviour.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from ckptool.readers import FORMATS as READERS

Status = Literal["works", "refused", "bug"]


class Cell(NamedTuple):
    """One (format, operation) pair: ``status``, the ``reason`` phrase printed, the ``route`` that works."""

    status: Status
    reason: str = ""
    route: str = ""


#: the formats, in table order: every format of the readers layer's registry (:data:`ckptool.readers.FORMATS`) but
#: plain pickles, which only ``inspect`` and ``scan`` read
FORMATS: tuple[str, ...] = (
    "torch-zip", "torch-legacy", "torchscript", "torch-package", "safetensors", "sharded-safetensors",
    "sharded-bin", "dcp", "torch-export", "deepspeed",
)

#: what each format is, for the generated table of ``docs/formats.md``: the registry's labels
FORMAT_LABELS: dict[str, str] = {name: READERS[name].label for name in FORMATS}

#: the operations: CLI commands, ``prefix`` for strip-dataparallel / strip-prefix / add-prefix / unwrap (and the
#: same flags of remap), ``load_into`` for :func:`ckptool.load_into`
OPERATIONS: tuple[str, ...] = (
    "inspect", "scan", "diff", "convert", "remap", "prefix", "extract-state-dict", "sanitize", "verify",
    "load_into", "rename", "filter", "average", "report",
)

_W = Cell("works")
_CONVERT = "`ckptool convert SRC -o model.safetensors`, then run the command on that file"
_JIT = "torch.jit.load(path, map_location='cpu'), torch.save(model.state_dict()), then the command on that file"
_PT2_SD = "`ckptool extract-state-dict SRC -o weights.pt` (or convert), then the command on that file"
_NO_MODULE = Cell("refused", "holds no pickled nn.Module", "the file already is a state_dict: use it as it is")
_PKG = Cell("refused", "is a torch.package archive",
            "`ckptool convert SRC -o model.safetensors` (or -o model.pt) writes its state_dict without running the "
            "package's code, then the command on that file; torch.package.PackageImporter(path).load_pickle(...) "
            "runs the package's code (trusted files only)")
_DIR = Cell("refused", "is a folder, and this command reads one checkpoint file", _CONVERT)
#: DCP stores every tensor chunk from CPU; only a non-tensor entry's torch.save record can carry a GPU tag
_DCP_REMAP = Cell("refused", "nothing to remap",
                  "none needed: `dcp.load` places tensors where the state_dict you pass lives; a folder whose "
                  "non-tensor entries hold GPU-tagged tensors is remapped (`ckptool remap SRC --to cpu -o OUT/`)")
_ZERO = Cell("refused", "is a DeepSpeed ZeRO checkpoint folder", "`ckptool convert SRC -o model.pt`, then the command")
_SHARD_NOT_CKPT = Cell("refused", "is the index of a sharded set", _CONVERT)


def _row(fmt: str, **cells: Cell) -> dict[tuple[str, str], Cell]:
    """``fmt``'s cells: ``works`` unless named in ``cells`` (operation names with ``_`` for ``-``)."""
    return {(fmt, op): cells.get(op.replace("-", "_"), _W) for op in OPERATIONS}


_TORCH = {"scan": Cell("works", "safe"), "diff": Cell("works", "identical"), "extract_state_dict": _NO_MODULE}

MATRIX: dict[tuple[str, str], Cell] = {
    **_row("torch-zip", **_TORCH),
    **_row("torch-legacy", **_TORCH),
    **_row(
        "torchscript",
        scan=Cell("works", "needs-trust"),
        diff=Cell("works", "identical"),
        convert=Cell("refused", "is a TorchScript archive", _JIT),
        remap=Cell("refused", "is a TorchScript archive", "torch.jit.load(path, map_location='cpu')"),
        prefix=Cell("refused", "cannot be renamed", _JIT),
        extract_state_dict=Cell("refused", "is a TorchScript archive", "torch.jit.load(path).state_dict()"),
        sanitize=Cell("refused", "is a TorchScript archive", "torch.jit.load(path, map_location='cpu')"),
        verify=Cell("refused", "--trust", "`ckptool verify --trust` (compiles the archive's code)"),
        load_into=Cell("refused", "trust=True", "ckptool.load_into(model, path, trust=True)"),
        rename=Cell("refused", "cannot be renamed", _JIT),
        filter=Cell("refused", "cannot be filtered", _JIT),
        average=Cell("refused", "is a TorchScript archive", _JIT),
    ),
    **_row(
        "torch-package",
        **{op.replace("-", "_"): _PKG for op in OPERATIONS
           if op not in ("scan", "inspect", "report", "diff", "convert", "average", "remap", "verify", "load_into")},
        scan=Cell("works", "safe"),
        diff=Cell("works", "identical"),
        remap=Cell("works", "re-tagged"),
        verify=Cell("works", "bit-identical"),
    ),
    **_row(
        "safetensors",
        scan=Cell("works", "safe"),
        diff=Cell("works", "identical"),
        remap=Cell("refused", "nothing to remap", "safetensors.torch.load_file(path, device=...)"),
        extract_state_dict=Cell("refused", "already is a state_dict", "use the file as it is"),
        sanitize=Cell("refused", "nothing to sanitize", "safetensors.torch.load_file(path, device=...)"),
    ),
    **{key: cell for fmt in ("sharded-safetensors", "sharded-bin") for key, cell in _row(
        fmt,
        scan=Cell("works", "safe"),
        diff=Cell("works", "identical"),
        remap=(Cell("refused", "carries no device tags", "safetensors.torch.load_file(shard, device=...)")
               if fmt == "sharded-safetensors" else _W),
        extract_state_dict=_SHARD_NOT_CKPT, sanitize=_SHARD_NOT_CKPT,
    ).items()},
    **_row(
        "dcp",
        scan=Cell("works", "safe"),
        diff=Cell("works", "2 of 2 matched tensors equal"),
        remap=_DCP_REMAP,
        extract_state_dict=_DIR, sanitize=_DIR,
    ),
    **_row(
        "torch-export",
        scan=Cell("works", "safe"),
        diff=Cell("works", "identical"),
        remap=Cell("refused", "this command does not apply", _PT2_SD),
        prefix=Cell("refused", "this command does not apply", _PT2_SD),
        sanitize=Cell("refused", "this command does not apply", _PT2_SD),
        rename=Cell("refused", "write its state_dict", _PT2_SD),
        filter=Cell("refused", "write its state_dict", _PT2_SD),
    ),
    **_row(
        "deepspeed",
        scan=Cell("works", "needs-trust"),
        diff=Cell("works", "identical"),
        remap=_ZERO, prefix=_ZERO,
        extract_state_dict=_DIR, sanitize=_DIR, rename=_DIR, filter=_DIR,
    ),
}
