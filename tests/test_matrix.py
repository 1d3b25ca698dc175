"""Every cell of the support matrix (:mod:`ckptool.ops.matrix`) does what the table says, on a fixture of that
format (``tests/matrix_fixtures.py``): a ``works`` cell exits 0 (scan: with its verdict) and its output opens with
the fixture's tensors bit for bit (renamed as the command renames); a ``refused`` or ``bug`` cell exits non-zero
(never 3, an internal error) with one ``Error:`` line containing the table's reason, and writes nothing; a ``bug``
cell that exits 0 prints the table's reason."""

from __future__ import annotations

import fnmatch
import json
import zipfile
from pathlib import Path
from typing import Any

import matrix_fixtures
import pytest
import torch
from click.testing import CliRunner

from ckptool.cli import cli
from ckptool.ops.matrix import FORMATS, MATRIX, OPERATIONS, Cell

_SUFFIX = {"safetensors": ".safetensors", "sharded-safetensors": ".safetensors.index.json",
           "sharded-bin": ".bin.index.json",
           "torch-export": ".pt2"}


def _invoke(*args: Any) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    def convert(*args: Any) -> None:
        res = _invoke(*args)
        assert res.exit_code == 0, res.output

    return matrix_fixtures.build(tmp_path_factory.mktemp("matrix"), convert)


@pytest.fixture(scope="session")
def references(fixtures: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors each fixture holds, as torch's own loaders give them."""
    sd = torch.load(fixtures["torch-zip"], weights_only=True)
    committed = {fmt: torch.load(ref, weights_only=True) for fmt, (_f, ref) in matrix_fixtures.COMMITTED.items()}
    return {fmt: committed.get(fmt, sd) for fmt in FORMATS}


#: the glob ``filter`` drops: ``*bias``, but in a fixture without biases (Megatron-Core's torch_dist folder)
_DROP = {"megatron-dist": "*layernorm*"}


def _model(fmt: str) -> str:
    return f"{matrix_fixtures.__file__}:{matrix_fixtures.MODELS.get(fmt, 'build_model')}"


def _command(fmt: str, op: str, src: Path, out: Path) -> list[Any]:
    """The CLI arguments that run ``op`` on ``src``, writing under the empty folder ``out``."""
    dst = out / ("out" + _SUFFIX.get(fmt, ".pt"))
    return {
        "inspect": ["inspect", src], "scan": ["scan", src], "diff": ["diff", src, src],
        "convert": ["convert", src, "-o", out / "out.safetensors"],
        "remap": ["remap", src, "--to", "cpu", "-o", dst],
        "prefix": ["add-prefix", src, "module.", "-o", dst],
        "extract-state-dict": ["extract-state-dict", src, "-o", out / "out.pt"],
        "sanitize": ["sanitize", src, "-o", dst],
        "verify": ["verify", src, "--model", _model(fmt), "--device", "cpu"],
        "rename": ["rename", src, "--rule", "^=net.", "-o", dst],
        "filter": ["filter", src, "--drop", _DROP.get(fmt, "*bias"), "-o", dst],
        "average": ["average", src, src, "-o", out / "out.safetensors"],
        "average --method": ["average", src, "--method", "ties", "--density", "0.5", "--base", src, "-o",
                             out / "out.safetensors"],
        "merge-lora": ["merge-lora", src, out / ".adapter", "-o", out / "out.safetensors"],
        "report": ["report", src, "-o", out / "out.html"],
    }[op]


def _expected(op: str, ref: dict[str, torch.Tensor], fmt: str = "") -> dict[str, torch.Tensor]:
    """``ref`` as ``op``'s output should hold it (see :func:`_command` for the arguments)."""
    if op == "prefix":
        return {f"module.{k}": v for k, v in ref.items()}
    if op == "rename":
        return {f"net.{k}": v for k, v in ref.items()}
    if op == "filter":
        return {k: v for k, v in ref.items() if not fnmatch.fnmatchcase(k, _DROP.get(fmt, "*bias"))}
    return ref


def _open_dcp(folder: Path) -> dict[str, torch.Tensor]:
    """A DCP output folder read by torch's own ``dcp_to_torch_save``; the matrix fixture's one nested state_dict
    (``{"model": state_dict}``) is returned itself."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, folder.parent / "back.pt")
    loaded: Any = torch.load(folder.parent / "back.pt", weights_only=True)
    (folder.parent / "back.pt").unlink()
    while isinstance(loaded, dict) and len(loaded) == 1 and isinstance(next(iter(loaded.values())), dict):
        loaded = next(iter(loaded.values()))
    return dict(loaded)


def _open(out: Path) -> dict[str, torch.Tensor]:
    """The one output file under ``out`` (or the set its ``*.index.json`` names, shard by shard; or the DCP folder),
    opened by torch's or safetensors' own loader (a torch.package archive: ``PackageImporter.load_pickle`` of the
    fixture's pickle)."""
    from safetensors.torch import load_file

    index = [p for p in out.iterdir() if p.name.endswith(".index.json")]
    if index:
        shards = sorted(set(json.loads(index[0].read_text(encoding="utf-8"))["weight_map"].values()))
        merged: dict[str, torch.Tensor] = {}
        for name in shards:
            shard = out / name
            merged.update(load_file(str(shard)) if shard.suffix == ".safetensors"
                          else torch.load(shard, weights_only=True))
        return merged
    (path,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    if (path / ".metadata").is_file():
        return _open_dcp(path)
    if path.suffix == ".safetensors":
        return load_file(str(path))
    if _is_package(path):
        from torch.package import PackageImporter  # a torch.package archive (the fixture's pickle: our own package)

        package: dict[str, torch.Tensor] = PackageImporter(str(path)).load_pickle("model", "state_dict.pkl")
        return package
    loaded: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return loaded


def _is_package(path: Path) -> bool:
    """True for a torch.package archive (a zip holding ``<top>/.data/extern_modules``)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(n.endswith("/.data/extern_modules") for n in z.namelist())


def _write_adapter(folder: Path, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PEFT-style LoRA adapter (r=2, lora_alpha=4) on the first 2-D floating weight of ``ref``, written to
    ``folder``; returns ``ref`` with that weight merged as PEFT merges it (``W + 2.0 * (B @ A)`` in float32, rounded
    once to W's dtype)."""
    from safetensors.torch import save_file

    key = next(k for k, v in ref.items() if v.dim() == 2 and v.is_floating_point() and k.endswith(".weight"))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, ref[key].shape[1], generator=g), torch.randn(ref[key].shape[0], 2, generator=g)
    folder.mkdir(exist_ok=True)
    module = key[:-len(".weight")]
    save_file({f"base_model.model.{module}.lora_A.weight": a, f"base_model.model.{module}.lora_B.weight": b},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    w = ref[key]
    return {**ref, key: (w.float() + (b @ a) * 2.0).to(w.dtype)}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``got`` equals ``want``'s bit for bit; a key of ``want`` may be missing only when its tensor
    is tied to one that is there (safetensors writes a tied tensor once)."""
    assert set(got) <= set(want), sorted(set(got) - set(want))
    for key, t in got.items():
        assert t.dtype == want[key].dtype and torch.equal(t, want[key]), key
    for key in set(want) - set(got):
        assert any(want[key].untyped_storage().data_ptr() == want[k].untyped_storage().data_ptr() for k in got), key


def _check_works(cell: Cell, fmt: str, op: str, res: Any, out: Path, ref: dict[str, torch.Tensor]) -> None:
    ok_codes = {0, 1, 4} if op == "scan" else {0}  # scan: its verdict is the exit status
    assert res.exit_code in ok_codes, res.output
    assert cell.reason in res.output
    if op == "report":
        assert (out / "out.html").read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")
    elif op in {"convert", "remap", "prefix", "extract-state-dict", "sanitize", "rename", "filter", "average",
                "average --method", "merge-lora"}:
        _same(_open(out), _expected(op, ref, fmt))


def _load_into(cell: Cell, fmt: str, src: Path, ref: dict[str, torch.Tensor]) -> None:
    from ckptool import errors
    from ckptool.torch_ops.load import load_into

    model = getattr(matrix_fixtures, matrix_fixtures.MODELS.get(fmt, "build_model"))()
    if cell.status == "works":
        load_into(model, src)
        got = model.state_dict()
        for key, t in ref.items():
            assert torch.equal(got[key], t.to(got[key].dtype)), key
        return
    with pytest.raises(errors.CkptError) as exc:  # a refusal the CLI turns into exit 1 or 2
        load_into(model, src)
    assert cell.reason in str(exc.value)


_STRIP = (["strip-dataparallel"], ["strip-prefix", "module."], ["unwrap"])


def _prefix_row(cell: Cell, fmt: str, src: Path, out: Path, ref: dict[str, torch.Tensor]) -> None:
    """The ``prefix`` row is four commands: add-prefix (checked by :func:`test_cell`), then strip-dataparallel,
    strip-prefix and unwrap, each on add-prefix's output (giving back the fixture) or, for a refused format, on the
    fixture itself (refusing the same way)."""
    made = sorted(out.iterdir(), key=lambda p: not p.name.endswith(".index.json"))  # a set: its index
    added = made[0] if cell.status == "works" else src
    for i, (cmd, *rest) in enumerate(_STRIP):
        dst = out / f"strip{i}" / added.name if cell.status == "works" else out / f"strip{i}-{added.name}"
        dst.parent.mkdir(exist_ok=True)
        res = _invoke(cmd, added, *rest, "-o", dst)
        if cell.status == "works":
            assert res.exit_code == 0, res.output
            _same(_open(dst.parent), ref)
        else:
            assert res.exit_code not in (0, 3) and cell.reason in res.output, (cmd, res.output)


@pytest.mark.parametrize(("fmt", "op"), [(f, o) for f in FORMATS for o in OPERATIONS])
def test_cell(fmt: str, op: str, fixtures: dict[str, Path], references: dict[str, dict[str, torch.Tensor]],
              tmp_path: Path) -> None:
    cell = MATRIX[fmt, op]
    if op == "load_into":
        _load_into(cell, fmt, fixtures[fmt], references[fmt])
        return
    if op == "merge-lora":
        references = {**references, fmt: _write_adapter(tmp_path / ".adapter", references[fmt])}
    res = _invoke(*_command(fmt, op, fixtures[fmt], tmp_path))
    if cell.status == "works":
        _check_works(cell, fmt, op, res, tmp_path, references[fmt])
    if op == "prefix":
        _prefix_row(cell, fmt, fixtures[fmt], tmp_path, references[fmt])
    if cell.status == "works":
        return
    assert res.exit_code != 3, res.output
    if cell.status == "bug" and res.exit_code == 0:  # a wrong success (e.g. says more than it checked)
        assert cell.reason in res.output
        return
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert res.exit_code != 0, res.output
    assert len(errors) == 1 and cell.reason in errors[0], res.output
    assert not any(p.name != ".adapter" for p in tmp_path.iterdir()), "a refused run left output behind"


def test_every_pair_has_a_cell() -> None:
    assert set(MATRIX) == {(f, o) for f in FORMATS for o in OPERATIONS}
    assert all(c.route for c in MATRIX.values() if c.status != "works")
