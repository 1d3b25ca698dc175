"""The globals policy rates the object a name reaches, not the module it starts in: dotted names through
re-exported modules, standard-library and numpy classes with side effects, class mutation via BUILD, allowed
constructors asked for huge allocations, and Python 2 names mapped as ``pickle`` maps them
(:mod:`ckptool.model.allowlist`, :func:`ckptool.formats.nodes.qualified_name`)."""

from __future__ import annotations

import _compat_pickle
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from ckptool.errors import UnsafeCheckpointError
from ckptool.formats.nodes import qualified_name
from ckptool.formats.unpickler import MAX_REQUEST_BYTES, load_structure
from ckptool.model.allowlist import (
    ALLOWED,
    DANGEROUS,
    LEVELS,
    NEEDS_TRUST,
    NEEDS_TRUST_MODULES,
    STDLIB_MODULES,
    UNKNOWN,
    classify_global,
    is_allowed,
    level_of,
)
from ckptool.scanning.entry import scan_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))
import adversarial_allow as aa
import hostile_corpus as hc

pytestmark = pytest.mark.torchfree  # the tests that need torch import it themselves


# ------------------------------------------------------------------------------------------------ dotted names
@pytest.mark.parametrize("name", [
    "torch.utils.cpp_extension.subprocess.Popen",  # STACK_GLOBAL torch.utils.cpp_extension + subprocess.Popen
    "torch.optim.lr_scheduler.types.CodeType",  # lr_scheduler does `import types`
    "torch.optim.lr_scheduler.types.FunctionType",
    "torch.nn.modules.linear.subprocess.Popen",  # a re-export inside a needs-trust module
    "torch._utils.os.system",
    "collections.os.system",
    "numpy.random.os.system",
    "numpy.lib._datasource.DataSource",  # its destructor runs shutil.rmtree(self._destpath)
    "numpy.lib.npyio.DataSource",
    "numpy.DataSource",
    "_pyio.FileIO",
    "_sqlite3.Connection",
    "sqlite3.connect",
    "_multiprocessing.SemLock",
    "torch.distributed.TCPStore",
    "torch.package.package_importer.PackageImporter",
    "mypkg.subprocess.Popen",  # an unknown package that imports subprocess
    "wsgiref.simple_server.WSGIServer",  # a standard-library class on no list (it opens a server socket)
    "numpy.lib._npyio_impl.NpzFile",  # a numpy class on no list
])
def test_a_name_is_rated_as_the_object_it_reaches(name: str) -> None:
    assert classify_global(name)[0] == DANGEROUS, classify_global(name)


@pytest.mark.parametrize(("name", "status"), [
    ("torch.nn.modules.linear.Linear", NEEDS_TRUST),
    ("torch.optim.lr_scheduler.LambdaLR", NEEDS_TRUST),
    ("torch.optim.adamw.AdamW", NEEDS_TRUST),
    ("numpy.random.mtrand.RandomState", NEEDS_TRUST),  # "random" is also a stdlib module: numpy.random is known
    ("numpy.random._pickle.__randomstate_ctor", NEEDS_TRUST),  # "_pickle" too: an exactly listed name
    ("numpy.random._generator.Generator", NEEDS_TRUST),
    ("torch.distributed.checkpoint.metadata.Metadata", NEEDS_TRUST),
    ("torch.distributed.tensor.DTensor", NEEDS_TRUST),  # torch registers it as a safe global
    ("torch.distributed.tensor.placement_types.Shard", NEEDS_TRUST),
    ("collections.OrderedDict", ALLOWED),
    ("pathlib._local.PosixPath", NEEDS_TRUST),
    ("builtins.ValueError", NEEDS_TRUST),
    ("decimal.Decimal", NEEDS_TRUST),
    ("mypkg.models.Net", UNKNOWN),
    ("__main__.Net", UNKNOWN),
    ("torch.optim.lr_scheduler.types.SimpleNamespace", UNKNOWN),  # types.SimpleNamespace is data
    ("mypkg.token.Tokenizer", UNKNOWN),  # token.Tokenizer is on no list: a package's own token submodule
    ("mypkg.random.Layer", UNKNOWN),
])
def test_library_names_keep_their_rating(name: str, status: str) -> None:
    assert classify_global(name)[0] == status, classify_global(name)


def test_the_reason_names_the_object_reached() -> None:
    status, why = classify_global("torch.optim.lr_scheduler.types.CodeType")
    assert status == DANGEROUS and "types.CodeType" in why and "builds functions and code objects" in why


def test_needs_trust_modules_are_exact_modules_not_prefixes() -> None:
    """A class-shaped name one module deeper than a needs-trust module is not that module's class."""
    assert classify_global("torch.optim.adam.Adam")[0] == NEEDS_TRUST
    assert classify_global("torch.optim.adam.something.Adam")[0] == UNKNOWN
    assert all(m.count(".") < 5 for m in NEEDS_TRUST_MODULES)


def test_a_name_too_deep_to_be_real_is_dangerous_and_rated_in_bounded_time() -> None:
    name = "mypkg." + ".".join(["a"] * 100_000) + ".Net"
    assert classify_global(name)[0] == DANGEROUS


@pytest.mark.parametrize("name", sorted(STDLIB_MODULES & {"io", "code", "types", "sqlite3", "_pyio", "shutil"}))
def test_an_unknown_package_whose_part_is_a_dangerous_stdlib_module_is_dangerous(name: str) -> None:
    """Documented over-approximation: ``mypkg.io.Reader`` may be ``io.Reader`` (nothing is imported to tell)."""
    assert classify_global(f"mypkg.{name}.Thing")[0] == DANGEROUS


#: re-exports found in needs-trust modules (torch 2.13, numpy 2.4, Python 3.10-3.13) whose reached object is on a
#: dangerous module's list but builds nothing outside the process: a lock, a read-only mapping view, typing helpers
_HARMLESS_REEXPORTS = frozenset({"threading.RLock", "_thread.RLock", "builtins.mappingproxy",
                                 "types.DynamicClassAttribute", "types.MappingProxyType", "types.GenericAlias",
                                 "types.UnionType"})


def test_needs_trust_modules_reexport_nothing_dangerous() -> None:
    """Independent evidence from the installed libraries (imported here, never by ckptool): every CapWords
    attribute of a needs-trust module that is defined elsewhere (a re-export, which a pickle can name as
    ``module.Name``) is a typing construct or reaches an object that is not dangerous. If torch one day does
    ``from subprocess import Popen`` in such a module, this fails and the module must leave the list."""
    torch = pytest.importorskip("torch")  # noqa: F841  # imports the torch modules of the list
    pytest.importorskip("numpy")
    import importlib
    import inspect
    import typing

    checked, bad = 0, []
    for mod in NEEDS_TRUST_MODULES:
        try:
            m = importlib.import_module(mod)
        except ImportError:  # another numpy or torch version
            continue
        for attr, obj in vars(m).items():
            if not attr[:1].isupper() or inspect.ismodule(obj) or not callable(obj):
                continue
            home = getattr(obj, "__module__", None)
            if home == mod or home in ("typing", "typing_extensions") or isinstance(obj, typing.TypeVar):
                continue
            checked += 1
            reached = f"{home}.{getattr(obj, '__qualname__', attr)}"
            if classify_global(reached)[0] == DANGEROUS and reached not in _HARMLESS_REEXPORTS:
                bad.append((f"{mod}.{attr}", reached))
    assert checked > 10 and not bad, bad


# ------------------------------------------------------------------------------------------------ Python 2 names
@pytest.mark.parametrize(("module", "name", "expected"), [
    ("__builtin__", "long", "builtins.int"),
    ("__builtin__", "unicode", "builtins.str"),
    ("__builtin__", "basestring", "builtins.str"),
    ("__builtin__", "xrange", "builtins.range"),
    ("__builtin__", "set", "builtins.set"),
    ("__builtin__", "reduce", "functools.reduce"),
    ("copy_reg", "_reconstructor", "copyreg._reconstructor"),
    ("exceptions", "ValueError", "builtins.ValueError"),
])
def test_python2_names_resolve_as_pickle_resolves_them(module: str, name: str, expected: str) -> None:
    """Independent evidence: ``pickle`` itself loads a protocol-2 GLOBAL (no call) and gives the object."""
    import importlib

    obj = pickle.loads(b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n.")
    home, _, attr = expected.rpartition(".")
    assert obj is getattr(importlib.import_module(home), attr)
    assert qualified_name(module, name) == expected


def test_a_python2_gadget_stays_dangerous() -> None:
    assert classify_global(qualified_name("__builtin__", "eval"))[0] == DANGEROUS
    assert classify_global(qualified_name("__builtin__", "intern"))[0] == DANGEROUS  # sys.intern
    assert classify_global(qualified_name("__builtin__", "reduce"))[0] == DANGEROUS  # functools.reduce


def test_a_python2_name_left_as_written_is_rated_no_safer_than_pickle_s_mapping() -> None:
    """A few table keys are also Python 3 names (``dbm.open``, ``_socket.fromfd``, ``itertools.izip``): they are
    reported as written (a protocol-3+ pickle imports them so), and a protocol-2 load imports the mapped name: the
    rating of what is reported must be at least that of the mapped name."""
    from ckptool.formats.nodes import py3_global

    entries = [(m, n) for (m, n) in _compat_pickle.NAME_MAPPING] + [
        (m, "Thing") for m in _compat_pickle.IMPORT_MAPPING] + [(m, "thing") for m in _compat_pickle.IMPORT_MAPPING]
    checked = 0
    for module, name in entries:
        if module.split(".")[0] not in STDLIB_MODULES:
            assert qualified_name(module, name) == ".".join(py3_global(module, name))
            continue
        checked += 1
        reported = qualified_name(module, name)
        assert reported == f"{module}.{name}"
        mapped = classify_global(".".join(py3_global(module, name)))
        assert LEVELS.index(level_of(classify_global(reported)[0])) >= LEVELS.index(level_of(mapped[0])), reported
    assert checked > 10


def _p2_types_file(tmp_path: Path) -> Path:
    """A protocol-2 torch zip whose values are the types ``int`` and ``str``, as ``torch.save`` pickles them
    (``__builtin__.long`` / ``__builtin__.unicode``), built without torch."""
    data = (b"\x80\x02}q\x00(X\x01\x00\x00\x00ac__builtin__\nlong\nq\x01X\x01\x00\x00\x00bc__builtin__\nunicode\n"
            b"q\x02X\x01\x00\x00\x00nK\x03u.")
    path = tmp_path / "types.pt"
    path.write_bytes(hc.torch_zip(data))
    return path


def test_a_protocol2_file_holding_int_and_str_is_not_dangerous(tmp_path: Path) -> None:
    """Issue 25: ``__builtin__.long`` / ``__builtin__.unicode`` were rated dangerous. They are ``builtins.int`` /
    ``builtins.str``: needs-trust, not safe, because torch.load(weights_only=True) refuses a type as a value
    (checked against torch in the next test)."""
    res = scan_file(_p2_types_file(tmp_path))
    assert {(g.name, g.status) for g in res.globals} == {("builtins.int", NEEDS_TRUST), ("builtins.str", NEEDS_TRUST)}
    assert res.verdict == NEEDS_TRUST and res.exit_code == 4
    from ckptool.ops.inspect.entry import inspect as inspect_file

    sec = inspect_file(_p2_types_file(tmp_path)).to_dict()["security"]
    assert sec["verdict"] == NEEDS_TRUST and not sec["dangerous"]


def test_torch_writes_and_refuses_the_protocol2_type_values(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "t.pt"
    torch.save({"a": int, "b": str, "n": 3}, path)
    res = scan_file(path)
    assert {g.name for g in res.unsafe} == {"builtins.int", "builtins.str"} and res.verdict == NEEDS_TRUST
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)


# ------------------------------------------------------------------------------------------------ class mutation
@pytest.mark.parametrize(("module", "name"), [("collections", "Counter"), ("pathlib", "PurePath")])
def test_build_on_a_class_is_read_and_rated_dangerous(tmp_path: Path, module: str, name: str) -> None:
    path = tmp_path / "c.pkl"
    path.write_bytes(aa.class_build(module, name))
    _root, up = load_structure(path.read_bytes())  # readable now: the BUILD is recorded, not a failure
    assert (module, f"{name} !class-build") in up.globals_seen
    res = scan_file(path)
    assert res.readable and res.verdict == DANGEROUS, res.globals
    bad = [g for g in res.globals if g.status == DANGEROUS]
    assert [g.name for g in bad] == [f"{module}.{name} !class-build"] and "class mutation" in bad[0].reason
    assert not is_allowed(bad[0].name)


def test_build_on_an_instance_is_not_class_mutation() -> None:
    """An OrderedDict with attributes (a state_dict's ``_metadata``) is BUILT as an instance, as always."""
    data = pickle.dumps(_with_metadata(), protocol=2)
    _root, up = load_structure(data)
    assert not any("!" in n for _m, n in up.globals_seen)


def _with_metadata() -> object:
    from collections import OrderedDict

    d: OrderedDict[str, int] = OrderedDict(a=1)
    d._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return d


# ------------------------------------------------------------------------------------------------ allocation limits
@pytest.mark.parametrize(("make", "nbytes"), [
    (aa.bytearray_bomb, 1),
    (aa.storage_bomb, 4),  # torch.FloatStorage(n): 4 bytes an element
])
def test_an_allowed_constructor_over_the_size_limit_is_dangerous(tmp_path: Path, make, nbytes: int) -> None:
    limit = MAX_REQUEST_BYTES // nbytes
    path = tmp_path / "b.pkl"
    path.write_bytes(make(limit))
    assert scan_file(path).verdict == "safe"
    path.write_bytes(make(limit + 1))
    res = scan_file(path)
    assert res.verdict == DANGEROUS and any("memory bomb" in g.reason for g in res.unsafe), res.globals


def test_the_issue_s_bytearray_is_dangerous(tmp_path: Path) -> None:
    path = tmp_path / "b.pkl"
    path.write_bytes(aa.bytearray_bomb(1_500_000_000))
    res = scan_file(path)
    assert [g.name for g in res.unsafe] == ["builtins.bytearray !alloc=1500000000"]


def test_a_bytearray_from_data_is_not_a_request(tmp_path: Path) -> None:
    """``bytearray(b'...')`` as pickle writes it (``bytearray``, then ``_codecs.encode`` of a str) stays safe."""
    path = tmp_path / "b.pkl"
    path.write_bytes(pickle.dumps({"b": bytearray(b"x" * 1000)}, protocol=2))
    assert scan_file(path).verdict == "safe"


@pytest.mark.parametrize(("make", "nbytes"), [(aa.bytearray_bomb, 1), (aa.storage_bomb, 4)])
def test_oversized_use_names_a_call_past_the_limit_as_the_reader_records_it(make, nbytes: int) -> None:
    """:func:`ckptool.model.allocations.oversized_use` (what ``sanitize`` asks of each call node) names a call past
    the reader's limit with the use name the reader adds to the pickle's globals, and nothing at the limit."""
    from ckptool.model.allocations import oversized_use, requested_bytes

    limit = MAX_REQUEST_BYTES // nbytes
    root, up = load_structure(make(limit))
    assert requested_bytes(root) == limit * nbytes and oversized_use(root) is None
    root, up = load_structure(make(limit + 1))
    use = oversized_use(root)
    assert use is not None and use.endswith(f"!alloc={(limit + 1) * nbytes}")
    assert use in [qualified_name(m, n) for m, n in up.globals_seen]
    assert requested_bytes({"not": "a call"}) == 0 and oversized_use("x") is None


def test_sanitize_does_not_keep_a_bomb_or_a_class_build(tmp_path: Path) -> None:
    from ckptool.ops.sanitize import sanitize

    for i, pkl in enumerate((aa.bytearray_bomb(), aa.class_build("collections", "Counter"))):
        src = tmp_path / f"s{i}.pt"
        src.write_bytes(hc.torch_zip(pkl))
        with pytest.raises(UnsafeCheckpointError, match=r"!alloc=|!class-build"):
            sanitize(src, tmp_path / f"o{i}.pt")
        assert not (tmp_path / f"o{i}.pt").exists()


def test_load_refuses_a_bomb_before_torch(tmp_path: Path) -> None:
    """``bytearray(n)`` is on torch's allowlist (torch checks no size): ckptool's gate refuses it first."""
    pytest.importorskip("torch")
    from ckptool.torch_ops.load import load_checkpoint

    src = tmp_path / "b.pt"
    src.write_bytes(hc.torch_zip(aa.bytearray_bomb()))
    assert is_allowed("builtins.bytearray !alloc=300000000")  # what torch would say
    with pytest.raises(UnsafeCheckpointError, match="alloc=300000000") as err:
        load_checkpoint(src)
    assert "exhaust your machine's memory" in str(err.value)


# ------------------------------------------------------------------------------------------------ the fixtures
def test_every_allow_case_is_flagged_dangerous(tmp_path: Path) -> None:
    for case in aa.CASES:
        folder = tmp_path / case.name
        folder.mkdir()
        res = scan_file(case.make(folder))
        assert res.verdict == case.verdict == DANGEROUS, (case.name, res.globals)


def test_the_cases_without_a_marker_are_live_under_pickle_load(tmp_path: Path) -> None:
    """Independent evidence that the non-marker gadgets act when an unrestricted ``pickle.load`` reads them: a file
    created, a database created, a folder deleted, a class mutated (in a subprocess: nothing leaks into this one)."""
    pytest.importorskip("numpy")
    made = {}
    for case in aa.CASES:
        if case.name in ("allow-pyio-fileio", "allow-sqlite3-connection", "allow-numpy-datasource",
                         "allow-class-build-counter", "allow-class-build-purepath", "allow-multiprocessing-semlock"):
            folder = tmp_path / case.name
            folder.mkdir()
            made[case.name] = case.make(folder)
    assert (tmp_path / "allow-numpy-datasource" / "victim").is_dir()
    script = textwrap.dedent("""
        import collections, gc, pathlib, pickle, sys
        for path in sys.argv[1:]:
            obj = pickle.load(open(path, 'rb'))
            del obj
            gc.collect()
        assert collections.Counter.ckptool_marker == 1 and pathlib.PurePath.ckptool_marker == 1
        print('mutated')
    """)
    out = subprocess.run([sys.executable, "-c", script, *map(str, made.values())], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ""}, check=False)
    assert out.returncode == 0 and "mutated" in out.stdout, out.stderr
    assert (tmp_path / "allow-pyio-fileio" / "fileio-created").exists()
    assert (tmp_path / "allow-sqlite3-connection" / "created.db").exists()
    assert not (tmp_path / "allow-numpy-datasource" / "victim").exists()


def test_rewriting_commands_refuse_a_class_build_instead_of_dropping_it(tmp_path: Path) -> None:
    """The node graph does not hold a BUILD on a class, so writing the pickle back would silently change the file:
    remap refuses and writes nothing; sanitize --drop-unknown lists it as dropped and writes the rest."""
    from ckptool.errors import UnsupportedError
    from ckptool.ops.rewrite.remap import remap
    from ckptool.ops.sanitize import sanitize

    src = tmp_path / "c.pt"
    # {'a': Counter} after a BUILD on Counter whose result is popped
    body = (b"\x80\x02ccollections\nCounter\nq\x00N}X\x0e\x00\x00\x00ckptool_markerK\x01s\x86b0"
            b"}X\x01\x00\x00\x00ah\x00s.")
    src.write_bytes(hc.torch_zip(body))
    with pytest.raises(UnsupportedError, match="class mutation"):
        remap(src, tmp_path / "r.pt", to="cpu")
    assert not (tmp_path / "r.pt").exists()
    res = sanitize(src, tmp_path / "s.pt", drop_unknown=True)
    assert [c.source for c in res.dropped] == ["collections.Counter !class-build"]
    z = zipfile.ZipFile(tmp_path / "s.pt")
    out = load_structure(z.read(next(n for n in z.namelist() if n.endswith("/data.pkl"))))[1]
    assert not any("!" in n for _m, n in out.globals_seen)


def test_a_use_of_a_python2_name_is_named_as_python3_names_it() -> None:
    _root, up = load_structure(b"\x80\x02c__builtin__\nlong\nN}X\x01\x00\x00\x00aK\x01s\x86b.")
    assert [qualified_name(m, n) for m, n in up.globals_seen] == ["builtins.int", "builtins.int !class-build"]


def test_a_torch_save_of_a_dtensor_needs_trust_not_more(tmp_path: Path) -> None:
    """What torch.save writes for a DTensor (one CPU process, a file store: no network): every global needs trust
    at most (torch registers them as safe globals), although the rest of torch.distributed is dangerous."""
    pytest.importorskip("torch")
    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        dist.init_process_group('gloo', rank=0, world_size=1, init_method='file://{tmp_path}/store')
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor, Shard
        t = distribute_tensor(torch.randn(4, 4), init_device_mesh('cpu', (1,)), [Shard(0)])
        torch.save({{'w': t}}, '{tmp_path}/d.pt')
        dist.destroy_process_group()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        pytest.skip(f"no DTensor here: {out.stderr.strip().splitlines()[-1:]}")
    res = scan_file(tmp_path / "d.pt")
    assert res.verdict == NEEDS_TRUST, [(g.name, g.status) for g in res.unsafe]
    assert any(g.name == "torch.distributed.tensor.DTensor" for g in res.unsafe)
