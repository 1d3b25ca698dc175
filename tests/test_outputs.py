"""The writers layer (issue 47): one output resolver and one choice of the output format for every command that
writes, the cases the issue reported, and the output matrix (every writing command x every ``-o`` form x with and
without ``--force``: result, exit status, the ``Wrote`` line, and no file outside the output changed)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptool.errors import UsageError
from ckptool.writers import (
    WRITERS,
    choose_format,
    is_folder_form,
    known_suffixes,
    refuse_replacing,
    resolve_output,
    set_members,
)

LORA = Path(__file__).resolve().parents[1] / "fixtures" / "lora"


# ------------------------------------------------------------------------------------------------ the resolver
@pytest.mark.parametrize(("dst", "name"), [("x.safetensors", "safetensors"), ("x.SafeTensors", "safetensors"),
                                           ("X.PT", "torch"), ("a/b.Bin", "torch"), ("x.pth", "torch")])
def test_the_suffix_chooses_the_format_in_any_case(dst: str, name: str) -> None:
    assert choose_format(dst).name == name


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_each_writer_reads_as_the_format_the_readers_give_what_it_writes(tmp_path: Path, name: str) -> None:
    """``Writer.reads_as`` (the format a writing command's result reports for its output: extract-state-dict,
    average, the safetensors rewrites) is what ``open_checkpoint`` and ``inspect`` say of a file that writer
    wrote."""
    import ckptool
    from ckptool.readers import open_checkpoint

    src = tmp_path / "in.pt"
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}, src)
    w = WRITERS[name]
    dst = tmp_path / ("out" + (w.suffixes[0] if w.suffixes else ""))
    ckptool.convert(src, dst, format=name)
    assert open_checkpoint(dst).format == w.reads_as


def test_an_unknown_suffix_is_refused_with_the_list() -> None:
    with pytest.raises(UsageError) as e:
        choose_format("x.weights")
    assert all(s in str(e.value) for s in known_suffixes())
    assert choose_format("x.weights", "torch").name == "torch"  # --format names it


def test_format_names_are_the_registry_and_unknown_ones_are_refused() -> None:
    assert {choose_format("x", f).name for f in WRITERS} == set(WRITERS)
    with pytest.raises(UsageError, match="unknown format 'onnx'"):
        choose_format("x.pt", "onnx")


def test_file_or_folder(tmp_path: Path) -> None:
    (tmp_path / "there").mkdir()
    assert is_folder_form("out/") and is_folder_form("out") and is_folder_form(str(tmp_path / "there"))
    assert not is_folder_form("out.pt") and not is_folder_form("out.weights")
    assert is_folder_form("gpt2.stripped", source_is_folder=True)
    assert not is_folder_form("https://host/x") and not is_folder_form("s3://b/out.pt")


def test_a_folder_holds_the_transformers_file(tmp_path: Path) -> None:
    assert resolve_output("out/").path == os.path.join("out/", "model.safetensors")
    assert resolve_output("dir3", fmt="safetensors").path == os.path.join("dir3", "model.safetensors")
    assert resolve_output("dir3", fmt="torch").path == os.path.join("dir3", "pytorch_model.bin")
    assert resolve_output("out/", file_name="x.pt").path == os.path.join("out/", "x.pt")
    assert resolve_output("x.SafeTensors").folder is None
    with pytest.raises(UsageError, match="one file"):
        resolve_output("https://host/out/")


def test_nothing_is_replaced_without_force(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    folder.mkdir()
    for n in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
              "model.safetensors.index.json", "pytorch_model.bin", "notes.txt"):
        (folder / n).write_bytes(b"x")
    out = resolve_output(str(folder))
    assert set_members(str(folder), "model.safetensors") == ["model-00001-of-00002.safetensors",
                                                             "model-00002-of-00002.safetensors",
                                                             "model.safetensors.index.json"]
    with pytest.raises(UsageError, match=re.escape("already holds model-00001-of-00002.safetensors")):
        refuse_replacing(out, force=False)
    refuse_replacing(out, force=True)
    refuse_replacing(resolve_output(str(folder), fmt="dcp"), force=False)  # torch writes DCP; convert checks it
    with pytest.raises(UsageError, match="exists; pass --force"):
        refuse_replacing(resolve_output(str(folder / "notes.txt"), checkpoint=False), force=False)


# ------------------------------------------------------------------------------------------------ the cases
def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256); folders as ``path/`` -> ``""``."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = ""
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def _changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def test_merge_lora_keeps_a_set_it_did_not_write(tmp_path: Path, run_cli: Any) -> None:
    """The issue: merge-lora into a folder holding convert's shards exited 0 and deleted them without --force."""
    base, lora = tmp_path / "gpt2", tmp_path / "lora"
    shutil.copytree(LORA / "gpt2-tiny", base)
    shutil.copytree(LORA / "gpt2-tiny-lora", lora)
    assert run_cli("convert", base, "-o", f"{tmp_path / 'shards'}/", "--max-shard-size", "40KB").exit_code == 0
    (tmp_path / "shards" / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    res = run_cli("merge-lora", base, lora, "-o", tmp_path / "shards")
    assert res.exit_code == 2 and "already holds model-00001-of-0000" in res.output and "--force" in res.output
    assert _tree(tmp_path) == before
    res = run_cli("merge-lora", base, lora, "-o", tmp_path / "shards", "--force")
    assert res.exit_code == 0, res.output
    changed = _changed(before, _tree(tmp_path))
    assert changed and all(c.startswith("shards/") for c in changed)
    assert "shards/notes.txt" not in changed
    assert sorted(os.listdir(tmp_path / "shards")) == ["config.json", "generation_config.json", "model.safetensors",
                                                       "notes.txt"]


def _state_dict(prefix: str = "module.") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"{prefix}fc.weight": torch.randn(4, 3), f"{prefix}fc.bias": torch.randn(4)}


@pytest.mark.parametrize("command", [["strip-dataparallel"], ["remap", "--to", "cpu"], ["average", "x.pt"]])
def test_a_name_ending_in_a_separator_is_a_new_folder(tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch,
                                                      command: list[str]) -> None:
    """The issue: ``-o NAME/`` wrote a file NAME, printed "Wrote NAME/", then failed; run again it replaced it."""
    monkeypatch.chdir(tmp_path)
    torch.save(_state_dict(), "x.pt")
    res = run_cli(*command, "x.pt", "-o", "NAME/")
    assert res.exit_code == 0, res.output
    name = "model.safetensors" if command[0] == "average" else "x.pt"
    assert os.listdir("NAME") == [name]
    assert f"Wrote {os.path.join('NAME/', name)} " in res.output
    again = run_cli(*command, "x.pt", "-o", "NAME/")
    assert again.exit_code == 2 and f"{name}; pass --force" in again.output.replace(" exists;", ";")


def test_convert_to_a_folder_writes_a_transformers_folder(tmp_path: Path, run_cli: Any) -> None:
    """The issue: ``convert -o out/`` failed without --max-shard-size; ``-o dir3 --format safetensors`` wrote a
    file named dir3."""
    src = tmp_path / "gpt2"
    shutil.copytree(LORA / "gpt2-tiny", src)
    res = run_cli("convert", src, "-o", f"{tmp_path / 'out'}/")
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json", "model.safetensors"]
    res = run_cli("convert", src / "model.safetensors", "-o", tmp_path / "dir3", "--format", "safetensors")
    assert res.exit_code == 0, res.output
    assert os.listdir(tmp_path / "dir3") == ["model.safetensors"]


def test_other_case_suffix_is_the_same_format_for_every_command(tmp_path: Path, run_cli: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue: ``x.SafeTensors`` was safetensors from convert and a torch zip from extract-state-dict."""
    import fixture_models

    monkeypatch.chdir(tmp_path)
    torch.save(fixture_models.TinyNet(), "model.pth")
    torch.save(_state_dict(""), "sd.pt")
    for argv in (["extract-state-dict", "model.pth"], ["convert", "sd.pt"], ["average", "sd.pt", "sd.pt"]):
        res = run_cli(*argv, "-o", "x.SafeTensors")
        assert res.exit_code == 0, res.output
        assert Path("x.SafeTensors").read_bytes()[8:9] == b"{", argv  # a safetensors header, not a zip
        os.remove("x.SafeTensors")
        res = run_cli(*argv, "-o", "x.weights")
        assert res.exit_code == 2 and "cannot tell the output format" in res.output, argv
        assert not Path("x.weights").exists()


# ------------------------------------------------------------------------------------------------ the matrix
#: every command that writes: (argv before -o, the file a folder output holds, the suffix of its file output)
COMMANDS: dict[str, tuple[list[str], str, str]] = {
    "convert": (["convert", "sd.pt"], "model.safetensors", ".safetensors"),
    "extract-state-dict": (["extract-state-dict", "model.pth"], "model.safetensors", ".pt"),
    "remap": (["remap", "sd.pt", "--to", "cpu"], "sd.pt", ".pt"),
    "strip-dataparallel": (["strip-dataparallel", "sd.pt"], "sd.pt", ".pt"),
    "strip-prefix": (["strip-prefix", "sd.pt", "module."], "sd.pt", ".pt"),
    "add-prefix": (["add-prefix", "sd.pt", "net."], "sd.pt", ".pt"),
    "unwrap": (["unwrap", "sd.pt"], "sd.pt", ".pt"),
    "rename": (["rename", "sd.pt", "--rule", "fc=head"], "sd.pt", ".pt"),
    "filter": (["filter", "sd.pt", "--keep", "*weight"], "sd.pt", ".pt"),
    "sanitize": (["sanitize", "sd.pt"], "sd.pt", ".pt"),
    "average": (["average", "sd.pt", "sd.pt"], "model.safetensors", ".safetensors"),
    "merge-lora": (["merge-lora", "gpt2", "lora"], "model.safetensors", ".safetensors"),
    "report": (["report", "sd.pt"], "sd.report.html", ".html"),
}

#: the -o forms: name -> (how to make it in the folder, the -o argument)
FORMS = ["new file", "other-case suffix", "NAME/ new", "existing empty folder", "existing folder with another set",
         "existing file", "URL"]


def _form(form: str, suffix: str) -> str:
    """Prepare ``form`` in the current folder; the -o argument."""
    if form == "new file":
        return f"out{suffix}"
    if form == "other-case suffix":
        return f"out{suffix.upper()}"
    if form == "NAME/ new":
        return "NAME/"
    if form == "existing empty folder":
        os.mkdir("empty")
        return "empty"
    if form == "existing folder with another set":
        os.mkdir("busy")
        for n in ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "notes.txt"):
            Path("busy", n).write_bytes(n.encode())
        Path("busy", "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
            "a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}}))
        return "busy"
    if form == "existing file":
        Path(f"old{suffix}").write_bytes(b"an earlier output")
        return f"old{suffix}"
    return f"http://127.0.0.1:9/out{suffix}"  # nothing listens: the upload fails


def _setup(tmp: Path) -> None:
    import fixture_models

    torch.save(_state_dict(), tmp / "sd.pt")
    torch.save(fixture_models.TinyNet(), tmp / "model.pth")
    shutil.copytree(LORA / "gpt2-tiny", tmp / "gpt2")
    shutil.copytree(LORA / "gpt2-tiny-lora", tmp / "lora")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("inputs")
    _setup(tmp)
    return tmp


@pytest.mark.parametrize("force", [False, True], ids=["no-force", "force"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_output_matrix(command: str, form: str, force: bool, inputs: Path, tmp_path: Path, run_cli: Any,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    argv, folder_file, suffix = COMMANDS[command]
    for name in os.listdir(inputs):
        (shutil.copytree if (inputs / name).is_dir() else shutil.copy)(inputs / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    dst = _form(form, suffix)
    before = _tree(tmp_path)
    res = run_cli(*argv, "-o", dst, *(["--force"] if force else []), catch_exceptions=True)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    changed = _changed(before, _tree(tmp_path))
    if form == "URL":
        assert res.exit_code != 0 and res.output.count("Error: ") == 1, res.output
        assert not changed
        return
    if form == "existing file" and not force:
        assert res.exit_code == 2, res.output
        assert f"output {dst} exists; pass --force" in res.output
        assert not changed
        return
    assert res.exit_code == 0, res.output
    target = dst if suffix.lower() in dst.lower() and not dst.endswith("/") else os.path.join(dst, folder_file)
    assert Path(target).is_file(), (target, sorted(changed))
    wrote = re.findall(r"^Wrote (\S+?)/? ", res.output, re.M)
    if command in ("merge-lora", "convert") and target != dst:
        assert wrote == [dst.rstrip("/")], res.output  # it reports the folder, with the files it holds
        assert f"{folder_file} and no index" in res.output or "kept: " in res.output
    else:
        assert wrote == [target], res.output
    in_output: Callable[[str], bool] = (
        (lambda c: c == target) if target == dst else (lambda c: c.startswith(dst.rstrip("/") + "/")))
    assert all(in_output(c.rstrip("/")) or c == dst.rstrip("/") + "/" for c in changed), sorted(changed)
    assert not any(c.startswith("busy/") and c != f"busy/{folder_file}" and command != "merge-lora"
                   for c in changed)
    assert not {"busy/notes.txt", "busy/pytorch_model.bin.index.json"} & changed


# ------------------------------------------------------------------------------------------------ what a format holds
MG = Path(__file__).resolve().parents[1] / "fixtures" / "megatron-ckpts"


def test_megatron_dist_to_torch_holds_common_entries(tmp_path: Path, run_cli: Any) -> None:
    """A torch output holds non-tensor entries (the writers registry): ``convert`` of a torch_dist folder to ``.pt``
    equals ``dcp_to_torch_save`` of it plus ``common.pt``'s plain entries (``args``, not plain, is named)."""
    out = tmp_path / "mg.pt"
    res = run_cli("convert", MG / "dist-gpt", "-o", out)
    assert res.exit_code == 0, res.output
    assert "common.pt: args: argparse.Namespace" in res.output
    got = torch.load(out, weights_only=True)
    want = {**torch.load(MG / "dist-gpt.reference.pt", weights_only=True),
            **json.loads((MG / "dist-gpt.common.json").read_text(encoding="utf-8"))}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert (torch.equal(got[k], v) and got[k].dtype == v.dtype) if torch.is_tensor(v) else got[k] == v, k
    assert WRITERS["torch"].non_tensor_entries and not WRITERS["safetensors"].non_tensor_entries


def test_the_torch_check_fails_on_other_entries(tmp_path: Path) -> None:
    """The verification of a torch output compares the plain entries too: an injected difference is caught."""
    from ckptool.readers import open_checkpoint
    from ckptool.torch_ops.convert_verify import torch_load_difference

    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2), "iteration": 10}, path)
    tensors = open_checkpoint(str(path)).state_dict("").tensors  # the top level, tensors and plain values
    assert torch_load_difference(str(path), tensors, entries={"iteration": 10}) is None
    assert torch_load_difference(str(path), tensors, entries={"iteration": 11}) == \
        "the plain entries differ from the source's"
    assert torch_load_difference(str(path), tensors, entries={}) == "the state_dict keys differ"


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_files_the_writers_create_follow_the_umask(tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch,
                                                   mask: int) -> None:
    """Every file a writing command creates gets ``0o666 & ~umask``, as ``open()`` gives a new file (shards, index,
    a folder's single file, a rewrite into a new folder, the report page); the folder it makes ``0o777 & ~umask``.
    (Companion copies keep their source's mode, as ``shutil.copy`` does: the copier's own tests.)"""
    monkeypatch.chdir(tmp_path)
    torch.save(_state_dict(), "sd.pt")
    old = os.umask(mask)
    try:
        for argv in (["convert", "sd.pt", "-o", "shards/", "--max-shard-size", "40B"],
                     ["convert", "sd.pt", "-o", "one/"], ["strip-dataparallel", "sd.pt", "-o", "new/"],
                     ["report", "sd.pt", "-o", "page/"],
                     ["average", "sd.pt", "sd.pt", "-o", "avg.SafeTensors"]):
            res = run_cli(*argv)
            assert res.exit_code == 0, (argv, res.output)
    finally:
        os.umask(old)
    made = [p for p in tmp_path.rglob("*") if p.name != "sd.pt"]
    assert len([p for p in made if p.is_file()]) >= 6
    for p in made:
        want = (0o777 if p.is_dir() else 0o666) & ~mask
        assert p.stat().st_mode & 0o777 == want, (p, oct(p.stat().st_mode & 0o777))


def test_one_file_never_half_replaces_a_set(tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A command writing one file into a folder holding shards of that name refuses, also with --force: the shards
    and index would stay beside the new file (a folder holding two answers)."""
    monkeypatch.chdir(tmp_path)
    torch.save(_state_dict(""), "sd.pt")
    assert run_cli("convert", "sd.pt", "-o", "out/", "--max-shard-size", "40B").exit_code == 0
    before = _tree(tmp_path)
    for force in ([], ["--force"]):
        res = run_cli("average", "sd.pt", "sd.pt", "-o", "out/", *force)
        assert res.exit_code == 2 and "holds a sharded set named model.safetensors" in res.output, res.output
        assert _tree(tmp_path) == before
