"""Issue 37, items 6 to 9: the right install named for numpy, messages that name what they mean (sanitize's
dangerous global, a read-only folder, plurals, one "re-tagged"), readable results in Python, the demo's fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NUMPY_HINT = ("Error: this needs the numpy package, which is not installed (`pip install ckptool` leaves it out); "
              "install it with: pip install 'ckptool[numpy]'")


# ------------------------------------------------------------------------------------------ 6. numpy
@pytest.mark.torchfree
def test_a_missing_numpy_names_the_numpy_extra() -> None:
    from ckptool.cli._errors import describe_error

    numpy = ModuleNotFoundError("No module named 'numpy'", name="numpy")
    assert describe_error(numpy) == (NUMPY_HINT.removeprefix("Error: "), 1)
    torch = ModuleNotFoundError("No module named 'torch'", name="torch")
    assert describe_error(torch)[0].endswith("pip install 'ckptool[torch]'")


def test_the_numpy_extra_exists() -> None:
    import tomllib

    with open(Path(__file__).parents[1] / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["numpy"] == ["numpy"] and "numpy" in extras["torch"]


@pytest.mark.torchfree
@pytest.mark.parametrize("args", [
    ["average", "{g}/sd_cpu.pt", "{g}/sd_cpu.pt", "-o", "{o}/avg.pt"],
    ["report", "{g}/sd_cpu.pt", "{g}/sd_cpu.pt", "-o", "{o}/r.html"],
    ["diff", "{g}/sd_cpu.pt", "{g}/sd_cpu.pt", "--atol", "0.1"],
])
def test_commands_that_need_numpy_name_the_numpy_extra(generated: dict[str, Path], tmp_path: Path,
                                                       args: list[str]) -> None:
    """Run where neither torch nor numpy imports (``sys.modules[name] = None`` in the child, before ckptool
    starts): the one line names ``ckptool[numpy]``, not the 245 MB torch extra."""
    g = next(iter(generated.values())).parent
    code = ("import sys; sys.modules['torch'] = sys.modules['numpy'] = None; from ckptool.cli import main; "
            "sys.argv = ['ckptool', *sys.argv[1:]]; main()")
    env = {k: v for k, v in os.environ.items() if k != "CKPTOOL_DEBUG"}
    p = subprocess.run([sys.executable, "-c", code, *[a.format(g=g, o=tmp_path) for a in args]], check=False,
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert (p.returncode, p.stderr.splitlines()) == (1, [NUMPY_HINT])


# ------------------------------------------------------------------------------------------ 7. messages
def _evil(path: Path) -> Path:
    """A plain pickle whose loading calls ``os.system`` (never loaded here)."""
    import pickle

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, ("echo pwned",)

    path.write_bytes(pickle.dumps({"a": Evil()}, protocol=2))
    return path


@pytest.mark.torchfree
def test_sanitize_of_a_plain_pickle_names_its_dangerous_global(run_cli, tmp_path: Path) -> None:
    evil = _evil(tmp_path / "evil.pth")
    r = run_cli("sanitize", evil, "-o", tmp_path / "out.pth", catch_exceptions=True)
    assert r.exit_code == 1 and not (tmp_path / "out.pth").exists()
    assert f"it names {os.system.__module__}.system (DANGEROUS): see `ckptool scan {evil}`" in r.output
    from ckptool.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=r"posix\.system|nt\.system"):
        import ckptool

        ckptool.sanitize(evil, tmp_path / "out.pth")


@pytest.mark.torchfree
def test_a_set_into_a_folder_that_cannot_be_made_says_so_as_a_single_file_does(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import errno

    import ckptool._fileio as fileio
    from ckptool.errors import OutputError

    def read_only(path: str, *a: object, **k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(fileio.os, "makedirs", read_only)
    with pytest.raises(OutputError) as e:
        fileio.make_output_folder(str(tmp_path / "ro" / "out"))
    assert str(e.value) == (f"cannot write in {tmp_path / 'ro'}: Read-only file system; the filesystem is "
                            "read-only: choose another output folder")
    assert e.value.errno == errno.EROFS


def test_a_set_written_into_a_folder_that_cannot_be_made(run_cli, monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    import errno

    import ckptool._fileio as fileio

    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    src = tmp_path / "set"
    src.mkdir()
    names = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    for name, key in zip(names, ("module.a", "module.b")):
        st.save_file({key: torch.ones(2)}, str(src / name))
    index = {"metadata": {}, "weight_map": {"module.a": names[0], "module.b": names[1]}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")

    def read_only(path: str, *a: object, **k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(fileio.os, "makedirs", read_only)
    r = run_cli("strip-dataparallel", src, "-o", tmp_path / "out", catch_exceptions=True)
    assert r.exit_code == 1
    assert (f"Error: cannot write in {tmp_path}: Read-only file system; the filesystem is read-only: choose "
            "another output folder") in r.output


@pytest.mark.torchfree
def test_plurals_and_one_spelling_of_retagged() -> None:
    from ckptool.model.units import plural, retagged_words

    assert (plural(1, "storage"), plural(2, "storage"), plural(1, "entry", "entries"),
            plural(3, "entry", "entries")) == ("1 storage", "2 storages", "1 entry", "3 entries")
    assert (retagged_words({("cuda:0", "cpu"): 5, ("cuda:1", "cpu"): 1})
            == "re-tagged cuda:0 -> cpu (5), cuda:1 -> cpu (1)")
    assert retagged_words({}) == ""
    root = Path(__file__).parents[1]
    for folder in ("ckptool", "docs"):
        for f in (root / folder).rglob("*.*"):
            if f.suffix in (".py", ".md"):
                text = f.read_text(encoding="utf-8")
                assert "re-tagged: " not in text.replace("re-tagged: ``to``", ""), f


@pytest.mark.torchfree
def test_a_note_continues_its_colon_in_lower_case() -> None:
    from ckptool.cli._hints import after_colon

    assert after_colon("Storages are tagged cuda:0 as asked") == "storages are tagged cuda:0 as asked"
    assert after_colon("The output keeps") == "the output keeps"
    assert after_colon("URL: the server") == "URL: the server"
    assert after_colon("DCP folders") == "DCP folders"
    assert after_colon("torch.load refuses") == "torch.load refuses"


def test_one_storage_is_one_storage(run_cli, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.save({"module.w": torch.ones(2)}, tmp_path / "one.pt")
    r = run_cli("strip-dataparallel", tmp_path / "one.pt", "-o", tmp_path / "out.pt", "--to", "cpu")
    assert ", 1 storage)" in r.output and "1 storages" not in r.output, r.output
    r = run_cli("inspect", tmp_path / "out.pt", "--tree")
    assert "1 tensor," in r.output and "2 params" in r.output, r.output


# ------------------------------------------------------------------------------------------ 8. Python API
def test_results_print_what_the_command_prints(run_cli, tmp_path: Path) -> None:
    """``print(result)`` is the command's text (or a short summary), not a dataclass dump; the CLI prints the same
    text from the same method."""
    import ckptool

    torch = pytest.importorskip("torch")
    src = tmp_path / "dp.pt"
    torch.save({"module.w": torch.ones(2), "module.b": torch.zeros(3)}, src)

    info = ckptool.inspect(src)
    text = str(info)
    assert text.splitlines()[0] == str(src) and "tensors:          2 in 2 storages, 20 B" in text
    assert len(text) < 600 and "TensorInfo(" not in text

    [scan] = ckptool.scan([str(src)])
    assert str(scan).startswith(f"{src}: safe (torch-zip, 1 pickle, ") and "ScanResult(" not in str(scan)
    evil = _evil(tmp_path / "evil.pth")
    [bad] = ckptool.scan([str(evil)])
    assert "DANGEROUS" in str(bad) and "system" in str(bad)
    assert run_cli("scan", evil).output.strip() == str(bad)

    res = ckptool.strip_dataparallel(src, tmp_path / "a.pt", to="cuda:0")
    size = ckptool.inspect(tmp_path / "a.pt").size / 1024
    assert str(res) == f"Wrote {tmp_path / 'a.pt'} ({size:.1f} KiB, 2 storages; re-tagged cpu -> cuda:0 (2))"
    out = run_cli("strip-dataparallel", src, "-o", tmp_path / "b.pt", "--to", "cuda:0").output
    assert str(res).replace("a.pt", "b.pt") in out

    san = ckptool.sanitize(tmp_path / "a.pt", tmp_path / "c.pt")
    assert str(san).startswith("Converted 0 objects; nothing from the file was imported or run")
    assert str(san).splitlines()[-1].startswith(f"Wrote {tmp_path / 'c.pt'} (") and ", 2 storages, 0 new)" in str(san)

    model = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 3), model)
    ext = ckptool.extract_state_dict(model, tmp_path / "d.pt")
    assert str(ext).startswith(f"Wrote {tmp_path / 'd.pt'} (torch-zip, ") and "2 tensors from " in str(ext)


def test_average_prints_its_result(run_cli, tmp_path: Path) -> None:
    import ckptool

    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    torch.save({"w": torch.zeros(2)}, tmp_path / "b.pt")
    res = ckptool.average([tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "c.pt")
    text = str(res)
    assert text.startswith("Averaged 2 checkpoints (weights 0.5, 0.5): 1 floating tensor in float64")
    assert text.splitlines()[-1].startswith(f"Wrote {tmp_path / 'c.pt'} (") and text.endswith(", 1 tensor)")
    out = run_cli("average", tmp_path / "a.pt", tmp_path / "b.pt", "-o", tmp_path / "d.pt").output
    assert text.replace("c.pt", "d.pt") in out


def test_the_note_after_a_write_continues_in_lower_case(run_cli, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    out = run_cli("remap", tmp_path / "a.pt", "--to", "cuda:0", "-o", tmp_path / "b.pt").output
    assert "Note: storages are tagged cuda:0 as asked" in out and "Note: Storages" not in out, out


def test_diff_and_convert_results_print_what_the_command_prints(run_cli, tmp_path: Path) -> None:
    """``print(ckptool.diff(a, b))`` and ``print(ckptool.convert(...))`` give the text the commands print (a
    dataclass dump before; the text lived in the CLI)."""
    import ckptool

    torch = pytest.importorskip("torch")
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"module.w": torch.ones(2), "module.b": torch.zeros(3)}, a)
    torch.save({"w": torch.ones(2), "b": torch.ones(3)}, b)
    res = ckptool.diff(a, b)
    text = str(res)
    assert "DiffResult(" not in text and text.splitlines()[-1] == res.summary()
    r = run_cli("diff", a, b)
    assert r.exit_code == 1 and r.output.strip() == text
    conv = ckptool.convert(b, tmp_path / "b.safetensors")
    assert "ConvertResult(" not in str(conv) and "Wrote" in str(conv)
    out = run_cli("convert", b, "-o", tmp_path / "c.safetensors").output
    assert str(conv).replace("b.safetensors", "c.safetensors").splitlines()[0] in out
