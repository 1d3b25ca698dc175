"""The words of the support matrix: a :class:`Cell` (what one operation does on one format), and the cells and
routes several formats' rows share.

Each format's row lives on its registry entry (:attr:`ckptool.readers.Format.support`); :mod:`ckptool.ops.matrix`
assembles the table from them, ``docs/generate.py`` renders it into ``docs/formats.md`` and ``tests/test_matrix.py``
runs every cell.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["DCP_REMAP", "FOLDER", "JIT", "MEGATRON", "NO_MODULE", "PACKAGE", "PT2_STATE_DICT", "SET_ROW", "WORKS",
           "ZERO", "Cell",
           "Status"]

Status = Literal["works", "refused", "bug"]


class Cell(NamedTuple):
    """One (format, operation) pair: ``status``, the ``reason`` phrase printed, the ``route`` that works.

    - ``works``: the operation succeeds on that format; ``reason`` is a phrase its output contains (scan: the
      verdict of the fixture, e.g. DeepSpeed's optimizer files are ``needs-trust`` because of
      ``fragment_address``);
    - ``refused``: it stops with one ``Error:`` line containing ``reason`` (exit 1 or 2, never 3); ``route`` is the
      nearest route that works;
    - ``bug``: what it does today is wrong (a refusal whose message misleads or gives no route, or an output that
      claims more than was checked); ``reason`` is the phrase it prints today, ``route`` the way around it.
    """

    status: Status
    reason: str = ""
    route: str = ""


#: an operation that plainly works
WORKS = Cell("works")
CONVERT = "`ckptool convert SRC -o model.safetensors`, then run the command on that file"
JIT = "torch.jit.load(path, map_location='cpu'), torch.save(model.state_dict()), then the command on that file"
PT2_STATE_DICT = "`ckptool extract-state-dict SRC -o weights.pt` (or convert), then the command on that file"
NO_MODULE = Cell("refused", "holds no pickled nn.Module", "the file already is a state_dict: use it as it is")
PACKAGE = Cell("refused", "is a torch.package archive",
               "`ckptool convert SRC -o model.safetensors` (or -o model.pt) writes its state_dict without running "
               "the package's code, then the command on that file; torch.package.PackageImporter(path)."
               "load_pickle(...) runs the package's code (trusted files only)")
FOLDER = Cell("refused", "is a folder, and this command reads one checkpoint file", CONVERT)
#: DCP stores every tensor chunk from CPU; only a non-tensor entry's torch.save record can carry a GPU tag
DCP_REMAP = Cell("refused", "nothing to remap",
                 "none needed: `dcp.load` places tensors where the state_dict you pass lives; a folder whose "
                 "non-tensor entries hold GPU-tagged tensors is remapped (`ckptool remap SRC --to cpu -o OUT/`)")
MEGATRON = Cell("refused", "is a Megatron checkpoint folder", "`ckptool convert SRC -o model.pt`, then the command")
ZERO = Cell("refused", "is a DeepSpeed ZeRO checkpoint folder", "`ckptool convert SRC -o model.pt`, then the command")
SHARD_NOT_CHECKPOINT = Cell("refused", "is the index of a sharded set", CONVERT)
#: what a sharded set's row shares, both kinds of shards
SET_ROW: dict[str, Cell] = {
    "scan": Cell("works", "safe"),
    "diff": Cell("works", "identical"),
    "extract-state-dict": SHARD_NOT_CHECKPOINT,
    "sanitize": SHARD_NOT_CHECKPOINT,
}
