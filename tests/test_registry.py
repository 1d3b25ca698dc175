"""Formats are objects: each registry entry (:data:`ckptool.readers.FORMATS`) names what differs per format in the
readers layer (its tensor reader, its support-matrix row); the layers above register what differs in them (the
describer for ``inspect``, the loader for ``load_into``, the load hint, remap's rewriter) in a typed
:class:`~ckptool.readers.registry.Role` of their own, so that no layer names a higher one, in code or in a string;
``torch_ops`` takes an :class:`~ckptool.readers.Opened` and reads through its cached readers."""

from __future__ import annotations

import dataclasses
import inspect as pyinspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptool import readers
from ckptool.errors import UnsupportedError
from ckptool.ops.inspect.entry import CheckpointInfo, inspect
from ckptool.ops.matrix import FORMATS as MATRIX_FORMATS
from ckptool.ops.matrix import MATRIX, OPERATIONS, matrix_of
from ckptool.readers import FORMATS, Format, Opened, open_checkpoint
from ckptool.readers.registry import Role
from ckptool.readers.support import WORKS, Cell

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"read": "reader", "dcp": "dcp"}


def _roles() -> dict[str, tuple[Role[Any], type]]:
    """Every role the layers above declare, with its Protocol."""
    from ckptool.ops.hints import HINT, HintMaker
    from ckptool.ops.inspect.entry import DESCRIBE, Describer
    from ckptool.ops.rewrite.remap import REWRITE, Rewriter
    from ckptool.torch_ops.loaders import LOAD, Loader

    return {"describe": (DESCRIBE, Describer), "load": (LOAD, Loader), "hint": (HINT, HintMaker),
            "rewrite": (REWRITE, Rewriter)}


@pytest.mark.torchfree
def test_every_reference_resolves_to_a_callable() -> None:
    """Each plug-in a registry entry names imports and is callable; every format is described and loaded, and every
    format whose tensors ckptool reads has a tensor reader (a format that registers no describer or loader gets the
    role's default, its reader's tensors)."""
    from ckptool.ops.inspect.entry import inspect_tensors
    from ckptool.torch_ops.loaders import load_tensors

    roles = _roles()
    for f in FORMATS.values():
        for role, name in ROLES.items():
            if getattr(f, name):
                assert callable(f.behaviour(role)), (f.name, role)  # type: ignore[arg-type]
        assert callable(roles["describe"][0].get(f.name, inspect_tensors)), f.name
        assert callable(roles["load"][0].get(f.name, load_tensors)), f.name
        assert f.reader, f.name  # every format has a reader class (its tensors refused first where not read)
        assert f.keyed or not f.tensors or f.flat, f.name  # a flat mapping says what it is when --key is refused


@pytest.mark.torchfree
def test_every_lazy_plugin_matches_its_role() -> None:
    """Every plug-in a layer registers lazily (a ``"module:function"`` string) names a module of that layer, imports,
    and takes the arguments its role's Protocol passes (the ones registered as functions mypy checks)."""
    seen = 0
    for name, (role, protocol) in _roles().items():
        want = len(pyinspect.signature(protocol.__call__).parameters) - 1  # type: ignore[operator]
        for fmt, ref in role.references().items():
            assert ref.startswith(role.owner + "."), (name, fmt, ref)
            fn = role.get(fmt)
            params = pyinspect.signature(fn).parameters.values()
            required = [p for p in params if p.default is p.empty and p.kind != p.KEYWORD_ONLY]
            assert len(required) <= want <= len(params), (name, fmt, ref)
            seen += 1
    assert seen >= 8  # inspect's describers of the formats met rarely, Megatron's loaders, the package rewriter


@pytest.mark.torchfree
def test_a_role_refuses_what_would_point_up_or_name_no_format() -> None:
    role: Role[Any] = Role("toy", "ckptool.ops")
    with pytest.raises(ValueError, match=r"not a module of ckptool\.ops"):
        role.register_lazy("safetensors", "ckptool.cli.inspect:main")
    with pytest.raises(KeyError, match="no registered format"):
        role.register("no-such-format", print)
    with pytest.raises(UnsupportedError, match="has no toy behaviour"):
        role.get("safetensors")
    assert role.get("safetensors", print) is print
    role.register("safetensors", len)
    assert role.get("safetensors") is len and role.find("pickle") is None


@pytest.mark.torchfree
def test_a_missing_behaviour_is_refused_or_defaulted() -> None:
    pickle = FORMATS["pickle"]
    with pytest.raises(UnsupportedError, match="no dcp behaviour"):
        pickle.behaviour("dcp")
    assert pickle.behaviour("dcp", print) is print


@pytest.mark.torchfree
def test_the_registry_names_no_higher_layer() -> None:
    """No module names a module of a layer above its own, in an import inside a function or in a plug-in string
    (``tools/architecture_figures.py``'s ``upward plug-ins`` reads every string and every such import)."""
    # the last one (torch_ops' trusted load scanning with ops' scanner, named as a string) went when the scan engine
    # moved to ckptool/scanning, the reading layer below torch_ops
    assert _figures().upward_plugins() == []


@pytest.mark.torchfree
def test_no_operation_tests_a_single_format_fact() -> None:
    """ops, torch_ops and cli ask the reader (:meth:`Opened.source`, :meth:`Opened.tensor_header`,
    :meth:`Opened.dcp_layout`, the registry's refusals, a Role) instead of testing a registry fact that is true for
    one format (``spec.header``, ``spec.tagged``, ``spec.dcp``, ``spec.consolidate``, ...)."""
    # the last one (the trusted load testing spec.torch_distributed) asks scanning.entry.scans_as_one now
    assert _figures().single_format_facts() == []


@pytest.mark.torchfree
def test_folders_that_need_consolidating_are_refused_by_their_registry_entry(tmp_path: Path) -> None:
    """The rewriting commands refuse a DeepSpeed folder and a Megatron legacy tree with the registry's sentence
    (``refusals["rewrite-folder"]``), and take a DCP-layout folder (DCP's own, Megatron's torch_dist) as a folder."""
    from ckptool.errors import UsageError
    from ckptool.ops.rewrite.sets import set_index

    for fmt, words in (("deepspeed", "DeepSpeed ZeRO checkpoint"), ("megatron-legacy", "Megatron checkpoint")):
        with pytest.raises(UsageError, match=re.escape(f"{words} folder, which this command does not rewrite: "
                                                       f"consolidate it first with `ckptool convert {tmp_path}")):
            set_index(Opened(str(tmp_path), fmt, str(tmp_path)))
    for fmt in ("dcp", "megatron-dist"):
        assert Opened(str(tmp_path), fmt, str(tmp_path)).dcp_layout() is not None
        assert set_index(Opened(str(tmp_path), fmt, str(tmp_path))) is None
    assert Opened(str(tmp_path), "deepspeed", str(tmp_path)).dcp_layout() is None


@pytest.mark.torchfree
def test_plugins_are_imported_when_their_format_is_met() -> None:
    """The readers layer imports no operation: the layers above register their plug-ins when imported."""
    code = ("import sys, ckptool.readers\n"
            "bad = [m for m in sys.modules if m.startswith(('ckptool.ops', 'ckptool.torch_ops'))]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.torchfree
def test_the_matrix_is_the_registry_rows() -> None:
    """``ops/matrix.py`` keeps no table of its own: each row is the entry's ``support``, ``works`` elsewhere."""
    assert matrix_of(FORMATS) == MATRIX
    for fmt in MATRIX_FORMATS:
        row = FORMATS[fmt].support or {}
        for op in OPERATIONS:
            assert MATRIX[fmt, op] == row.get(op, WORKS)
    with pytest.raises(ValueError, match="operations that do not exist"):
        matrix_of({"x": Format("x", "x", "file", support={"transmogrify": WORKS})})


def _toy_describe(o: Opened, _limits: Any) -> CheckpointInfo:
    return CheckpointInfo(o.target, o.format, "tensors", 0, [], {}, {}, [], [])


def _toy_load(o: Opened, req: Any) -> tuple[Any, dict[str, int]]:
    return {"loaded": o.target, "device": str(req.device)}, {"cpu": 1}


def test_a_new_format_is_its_registry_entry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A format added to the registry alone is described by inspect, loaded by load_checkpoint and has its row in
    the support matrix: no operation names it."""
    from ckptool.ops.inspect.entry import DESCRIBE
    from ckptool.torch_ops.load import load_checkpoint
    from ckptool.torch_ops.loaders import LOAD

    toy = Format("toy", "a toy format", "file", tensors=False, refusal="is a toy",
                 support={"convert": Cell("refused", "is a toy", "play with it")})
    monkeypatch.setitem(FORMATS, "toy", toy)
    for role in (DESCRIBE, LOAD):  # put back what the test registers
        monkeypatch.setattr(role, "_plugins", dict(role._plugins))
    DESCRIBE.register("toy", _toy_describe)
    LOAD.register("toy", _toy_load)
    path = str(tmp_path / "x.toy")
    opened = Opened(path, "toy", path)
    assert inspect(opened).format == "toy"
    assert load_checkpoint(opened) == ({"loaded": path, "device": "cpu"}, {"cpu": 1})
    rows = matrix_of(FORMATS)
    assert rows["toy", "convert"].route == "play with it" and rows["toy", "scan"] == WORKS
    with pytest.raises(UnsupportedError, match="is a toy"):
        opened.state_dict()


def _figures() -> Any:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import architecture_figures
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return architecture_figures


@pytest.mark.torchfree
def test_no_operation_of_the_registry_slice_names_a_format() -> None:
    """torch_ops, the load hints, the support matrix, inspect's dispatch and the model layer compare no format name
    and call no parser: what differs per format is the registry's (``tools/architecture_figures.py``)."""
    figures = _figures()
    mine = ("ckptool/torch_ops/", "ckptool/ops/hints.py", "ckptool/ops/matrix.py", "ckptool/model/")
    assert [p for p in figures.format_comparisons() if p.startswith(mine)] == []
    assert [p for p in figures.format_comparisons() if p.startswith("ckptool/ops/inspect/entry.py")
            and "(table)" in p] == []
    assert [p for p in figures.parser_calls() if p.startswith(mine)] == []


def test_load_checkpoint_reads_through_the_opened(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """load_checkpoint of an Opened reads its pickle / header once, through the Opened's cache."""
    import torch
    from safetensors.torch import save_file

    from ckptool.torch_ops.load import load_checkpoint

    pt, st = tmp_path / "m.pt", tmp_path / "m.safetensors"
    torch.save({"w": torch.arange(4.0)}, pt)
    save_file({"w": torch.arange(4.0)}, str(st))
    zipped, header = open_checkpoint(pt), open_checkpoint(st)
    zipped.graph()
    header.safetensors_header()

    def fail(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("read a second time")

    monkeypatch.setattr(readers, "read_checkpoint", fail)
    monkeypatch.setattr(readers, "plugin", fail)  # read_header, as the other formats' readers, is a plug-in
    assert torch.equal(load_checkpoint(zipped)[0]["w"], torch.arange(4.0))
    assert torch.equal(load_checkpoint(header)[0]["w"], torch.arange(4.0))


def test_each_format_has_a_reader_class(tmp_path: Path) -> None:
    """Every registry format names a reader class (:class:`ckptool.readers.Reader`); what differs by format is
    its methods: a safetensors file's header and ``__metadata__`` values, a pickle's nesting, a set's flat mapping,
    the finished Source of a safetensors file with the tied names the library left out."""
    import torch
    from safetensors.torch import save_file, save_model

    for f in FORMATS.values():
        opened = Opened(str(tmp_path), f.name, str(tmp_path))
        assert isinstance(opened.reader, readers.Reader), f.name
        assert opened.reader is opened.reader  # made once per checkpoint
    st, pt = tmp_path / "m.safetensors", tmp_path / "m.pt"
    save_file({"w": torch.arange(4.0)}, str(st), metadata={"format": "pt"})
    torch.save({"model": {"w": torch.arange(4.0)}, "epoch": 3}, pt)
    s, p = open_checkpoint(st), open_checkpoint(pt)
    assert type(s.reader).__name__ == "SafetensorsReader" and type(p.reader).__name__ == "PickledReader"
    assert s.tensor_header() is s.safetensors_header() and p.tensor_header() is None
    assert s.values() == {"format": "pt"} and p.values() == {"epoch": 3}
    assert s.tree() is None and p.tree() is p.graph().root
    # the structures of one format are parsed and kept by its reader; the other readers refuse them
    assert s.reader.safetensors_header() is s.safetensors_header()
    for accessor, what in ((p.safetensors_header, "not a safetensors file"), (p.index, "not a sharded set"),
                           (p.pt2, "not a torch.export archive"), (p.package, "not a torch.package archive"),
                           (p.dcp_metadata, "not a DCP folder"), (lambda: p.zero(None), "not a DeepSpeed folder")):
        with pytest.raises(UnsupportedError, match=what):
            accessor()
    assert [e.path for e in p.state_dicts()] == ["model"] and [e.keys for e in s.state_dicts()] == [("w",)]

    tied = torch.nn.Linear(2, 2, bias=False)
    model = torch.nn.ModuleDict({"a": tied, "b": tied})
    save_model(model, str(tmp_path / "tied.safetensors"))
    o = open_checkpoint(tmp_path / "tied.safetensors")
    assert len(o.state_dict().tensors) == 1 and sorted(t.name for t in o.source().tensors) == ["a.weight", "b.weight"]


@pytest.mark.torchfree
def test_format_entries_stay_hashable() -> None:
    """The support row (a dict) is left out of a Format's hash, so entries stay usable as keys."""
    assert len({f: f.name for f in FORMATS.values()}) == len(FORMATS)
    assert dataclasses.replace(FORMATS["dcp"]) == FORMATS["dcp"]
