"""The public API: ``ckptool.__all__`` lists real objects with real types, and no submodule shadows them."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

import ckptool

pytestmark = pytest.mark.torchfree  # needs no torch: .ci/run also runs it where torch is not installed

ROOT = Path(__file__).resolve().parents[1]


def _all_submodules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(ckptool.__path__, "ckptool.") if ".demo" not in m.name]


def test_every_public_name_resolves_to_a_function_or_class() -> None:
    for name in ckptool.__all__:
        value = getattr(ckptool, name)
        assert not isinstance(value, types.ModuleType), name
        assert callable(value), name


def test_lazy_names_come_from_the_module_named_in_the_table() -> None:
    for name, mod in ckptool._LAZY.items():
        assert name in ckptool.__all__
        assert getattr(ckptool, name) is getattr(importlib.import_module(mod), name)


def test_no_submodule_shares_a_name_with_a_public_function() -> None:
    top = {m.name for m in pkgutil.iter_modules(ckptool.__path__)}
    assert not top & set(ckptool.__all__)


def test_importing_every_submodule_leaves_the_public_functions_in_place() -> None:
    """Before the layered package, ``import ckptool.convert`` replaced the function ``ckptool.convert``."""
    code = (
        "import importlib, types, ckptool\n"
        f"for m in {_all_submodules()!r}: importlib.import_module(m)\n"
        "bad = [n for n in ckptool.__all__ if isinstance(getattr(ckptool, n), types.ModuleType)]\n"
        "assert not bad, bad\n"
        "assert callable(ckptool.convert) and callable(ckptool.inspect) and callable(ckptool.scan)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_importing_ckptool_imports_neither_torch_nor_the_torch_layer() -> None:
    code = (
        "import sys, ckptool\n"
        "assert 'torch' not in sys.modules\n"
        "heavy = ('ckptool.torch_ops', 'ckptool.ops.convert', 'ckptool.demo')\n"
        "loaded = [m for m in sys.modules if m.startswith(heavy)]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ckptool.nope  # noqa: B018


def test_type_checkers_see_real_types(tmp_path: Path) -> None:
    """mypy sees the lazily loaded names with their real signatures (not ``Any``): misuse is an error."""
    api = pytest.importorskip("mypy.api")
    snippet = tmp_path / "use_api.py"
    snippet.write_text(
        "import ckptool\n"
        "a: int = ckptool.convert\n"
        "b: int = ckptool.load_into\n"
        "c: int = ckptool.inspect('x').tensors\n"
        "d: int = ckptool.scan_file('x')\n"
    )
    out, _err, status = api.run(["--strict", "--no-incremental", "--follow-imports=silent", str(snippet)])
    assert status == 1, out
    assert out.count("Incompatible types in assignment") == 4, out


# ------------------------------------------------------------------------------------------------ the readers' model
def test_the_checkpoint_model_is_public(real_dir: Path) -> None:
    """``open_checkpoint``, ``Opened``, ``Tensor`` and ``Storage`` are exported (lazily) and are the readers' own."""
    import ckptool.formats.tensors
    import ckptool.readers

    assert ckptool.open_checkpoint is ckptool.readers.open_checkpoint
    assert ckptool.Opened is ckptool.readers.Opened
    assert ckptool.Tensor is ckptool.formats.tensors.Tensor and ckptool.Storage is ckptool.formats.tensors.Storage
    opened = ckptool.open_checkpoint(real_dir / "facenet-pnet.pt")
    assert isinstance(opened, ckptool.Opened)
    tensors = opened.state_dict().tensors
    assert tensors and all(isinstance(t, ckptool.Tensor) and isinstance(t.storage, ckptool.Storage)
                           for t in tensors)


def test_importing_ckptool_does_not_load_the_readers() -> None:
    code = (
        "import sys, ckptool\n"
        "loaded = [m for m in sys.modules if m.startswith(('ckptool.readers', 'ckptool.formats', 'ckptool.ops'))]\n"
        "assert not loaded, loaded\n"
        "assert callable(ckptool.open_checkpoint) and 'ckptool.readers' in sys.modules\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------------------------------------ deprecated spellings
# ckptool 0.2 takes the model first (verify and load_into, as model.load_state_dict) and names every output ``dst``;
# the 0.1 spellings still work for one release, with a DeprecationWarning.

def test_the_output_argument_has_one_name() -> None:
    """Every public function that writes a file (or, ``sanitize_dry_run``, says what file a run would write) names
    its output ``dst``; none says ``out``, ``output`` or ``path`` for it any more (``path`` is an input
    everywhere)."""
    outputs = {"add_prefix", "average", "convert", "extract_state_dict", "filter_keys", "merge_lora", "remap", "rename",
               "report", "sanitize", "sanitize_dry_run", "save_portable", "strip_dataparallel", "strip_prefix",
               "unwrap"}
    for name in ckptool.__all__:
        value = getattr(ckptool, name)
        if isinstance(value, type) or not callable(value):
            continue
        params = set(inspect.signature(value).parameters)
        assert not params & {"out", "output", "output_path", "out_path"}, name
        assert ("dst" in params) == (name in outputs), name


def test_the_model_comes_first() -> None:
    for name in ("verify", "load_into", "load_training_state"):
        assert next(iter(inspect.signature(getattr(ckptool, name)).parameters)) == "model", name


def test_renamed_argument_warns_and_passes_the_new_name() -> None:
    from ckptool._deprecate import renamed_argument

    @renamed_argument("out", "dst")
    def write(a: str, *, dst: str) -> tuple[str, str]:
        return a, dst

    assert write("a", dst="x") == ("a", "x")
    with pytest.warns(DeprecationWarning, match=r"write\(out=\.\.\.\) is deprecated, use dst="):
        assert write("a", out="x") == ("a", "x")
    with pytest.raises(TypeError, match="both out= and dst="):
        write("a", out="x", dst="y")


def test_model_first_accepts_the_old_order_with_a_warning(tmp_path: Path) -> None:
    from ckptool._deprecate import model_first

    @model_first
    def check(model: object, path: object, *, device: str = "cpu") -> tuple[object, object, str]:
        return model, path, device

    model = object()
    p = tmp_path / "m.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check(model, p) == (model, p, "cpu")
        assert check(model, str(p), device="x") == (model, str(p), "x")
        assert check(model=model, path=p) == (model, p, "cpu")
    for args, kwargs in (((p, model), {}), ((str(p), model), {"device": "x"}), ((p,), {"model": model})):
        with pytest.warns(DeprecationWarning, match=r"check\(path, model\) is deprecated: pass the model first"):
            got = check(*args, **kwargs)
        assert got[:2] == (model, args[0]), (args, kwargs)


def test_report_takes_dst_and_still_accepts_out(real_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("jinja2")
    src = real_dir / "facenet-pnet.pt"
    res = ckptool.report(src, dst=tmp_path / "a.html")
    assert res.dst == str(tmp_path / "a.html") and (tmp_path / "a.html").stat().st_size == res.bytes_written
    with pytest.warns(DeprecationWarning, match=r"report\(out=\.\.\.\) is deprecated"):
        old = ckptool.report(src, out=tmp_path / "b.html")
    assert (tmp_path / "b.html").is_file()
    with pytest.warns(DeprecationWarning, match="ReportResult.out is deprecated"):
        assert old.out == old.dst == str(tmp_path / "b.html")


def test_verify_in_the_old_order_warns_and_verifies(real_dir: Path) -> None:
    pytest.importorskip("torch")
    from models import PNet  # tests/ is on sys.path (conftest.py)
    src = real_dir / "facenet-pnet.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckptool.verify(PNet, src, device="cpu").ok
    with pytest.warns(DeprecationWarning, match=r"verify\(path, model\) is deprecated"):
        assert ckptool.verify(src, PNet, device="cpu").ok
    with pytest.warns(DeprecationWarning, match=r"verify\(path, model\) is deprecated"):
        assert ckptool.verify(str(src), model=PNet(), device="cpu").ok


def test_save_portable_takes_dst_and_still_accepts_path(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    sd = {"w": torch.ones(2)}
    assert ckptool.save_portable(sd, dst=tmp_path / "a.pt") == str(tmp_path / "a.pt")
    with pytest.warns(DeprecationWarning, match=r"save_portable\(path=\.\.\.\) is deprecated, use dst="):
        assert ckptool.save_portable(sd, path=tmp_path / "b.pt") == str(tmp_path / "b.pt")
    assert torch.equal(torch.load(tmp_path / "b.pt", weights_only=True)["w"], sd["w"])
