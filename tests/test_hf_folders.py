"""Hugging Face model folders kept whole (issue 37, item 1): a rewrite of a folder's sharded set copies the
folder's other files (config.json, generation_config.json, tokenizer files, README) byte for byte, in the set's
commit, lists them (``kept:`` / ``--json`` ``kept`` / the result's ``kept``), and ``from_pretrained(out)`` loads the
output of every rewriting command; the load hint of a set names ``from_pretrained(folder)`` or
``ckptool.load_into(model, folder)``, never the shard paths, and runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: the files a model folder holds beside its weights, each with its bytes
COMPANIONS = {
    "tokenizer.json": b'{"version": "1.0", "model": {"vocab": {"a": 0, "b": 1}}}\n',
    "vocab.txt": b"a\nb\n\xc3\xa9\n",
    "README.md": b"# tiny\n",
}


def _hint(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.startswith("Load it with: ")]
    assert len(lines) == 1, output
    return lines[0].removeprefix("Load it with: ")


def _kept(output: str) -> list[str]:
    lines = [ln for ln in output.splitlines() if ln.startswith("kept: ")]
    assert len(lines) == 1, output
    return lines[0].removeprefix("kept: ").split(", ")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny GPT-2 saved by save_pretrained as a sharded safetensors set, the same as torch shards (through
    ckptool convert), each folder with config files, tokenizer-like files, a hidden file and a subfolder."""
    from click.testing import CliRunner

    from ckptool.cli import cli

    base = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16,
                                     bos_token_id=0, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(config)
    st = base / "gpt2-st"
    model.save_pretrained(st, max_shard_size="2KB")
    assert (st / "model.safetensors.index.json").is_file()
    pt = base / "gpt2-bin"
    pt.mkdir()
    r = CliRunner().invoke(cli, ["convert", str(st), "-o", str(pt / "pytorch_model.bin"), "--format", "torch",
                                 "--max-shard-size", "2KB", "-q"])
    assert r.exit_code == 0, r.output
    for folder in (st, pt):
        for name, data in COMPANIONS.items():
            (folder / name).write_bytes(data)
        if folder is pt:
            for name in ("config.json", "generation_config.json"):
                shutil.copyfile(st / name, pt / name)
        (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
        (folder / "onnx").mkdir()
        (folder / "onnx" / "model.onnx").write_bytes(b"not copied")
    return {"st": st, "bin": pt, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _loads_as_the_model(out: Path, state: dict[str, Any]) -> None:
    """``from_pretrained(out)`` builds the model with the saved values, every key loaded (none missing)."""
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got = loaded.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def _companions_copied(src: Path, out: Path) -> None:
    for name in ["config.json", "generation_config.json", *COMPANIONS]:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert not (out / ".gitattributes").exists()
    assert not (out / "onnx").exists()


#: (input set, argv): each rewriting command on a model folder; ``{src}`` the input, ``{out}`` the test's folder
#: (a step may read an earlier step's output)
_STEPS = [
    ("st", ["strip-prefix", "{src}", "transformer.", "-o", "{out}/stripped"]),
    ("st", ["add-prefix", "{out}/stripped", "transformer.", "-o", "{out}/back"]),
    ("st", ["add-prefix", "{src}", "module.", "-o", "{out}/dp"]),
    ("st", ["strip-dataparallel", "{out}/dp", "-o", "{out}/undp"]),
    ("st", ["add-prefix", "{src}", "_orig_mod.", "-o", "{out}/compiled"]),
    ("st", ["unwrap", "{out}/compiled", "-o", "{out}/unwrapped"]),
    ("st", ["rename", "{out}/stripped", "--rule", r"^(wte|wpe|h|ln_f)\.=transformer.\1.", "-o", "{out}/renamed"]),
    ("st", ["filter", "{src}", "--keep", "*", "-o", "{out}/filtered"]),
    ("bin", ["remap", "{src}", "--to", "cpu", "-o", "{out}/remapped"]),
    ("bin", ["strip-prefix", "{src}", "transformer.", "-o", "{out}/bin-stripped"]),
    ("bin", ["filter", "{src}", "--keep", "*", "-o", "{out}/bin-filtered"]),
]


def test_every_rewrite_of_a_model_folder_loads_with_from_pretrained(model_dirs: dict[str, Any], run_cli: Any,
                                                                    tmp_path: Path) -> None:
    for which, argv in _STEPS:
        src = model_dirs[which]
        args = [a.format(src=src, out=tmp_path) for a in argv]
        r = run_cli(*args)
        assert r.exit_code == 0, (args, r.output)
        out = Path(args[-1])
        _companions_copied(src, out)
        assert _kept(r.output) == ["README.md", "config.json", "generation_config.json", "tokenizer.json",
                                   "vocab.txt"], args
        if "{src}" in argv:  # the input folder's subfolder is named, not copied
            assert "not copied from the input folder: onnx/" in r.output
        hint = _hint(r.output)
        assert "-0000" not in hint  # the loader people use, on the folder, never the shard paths
        if args[2] in ("module.", "_orig_mod."):  # a wrapper's prefix: from_pretrained would match no key
            assert hint == f"ckptool.load_into(model, {str(out)!r})", hint
            continue
        _loads_as_the_model(out, model_dirs["state"])
        if args[0] in ("remap", "filter"):  # names as saved: from_pretrained, and the line runs
            assert hint == f"transformers.GPT2LMHeadModel.from_pretrained({str(out)!r})", hint
            eval(hint, {"transformers": transformers})  # the printed line, run as a user runs it
        else:  # keys renamed: into the user's own model, from_pretrained named in a note
            assert hint == f"ckptool.load_into(model, {str(out)!r})", hint
            assert "keys were renamed: transformers.GPT2LMHeadModel.from_pretrained(" in r.output


def test_json_lists_the_kept_files(model_dirs: dict[str, Any], run_cli: Any, tmp_path: Path) -> None:
    r = run_cli("strip-prefix", model_dirs["st"], "transformer.", "-o", tmp_path / "o", "--json")
    assert r.exit_code == 0, r.output
    payload = json.loads(r.output)
    assert payload["kept"] == ["README.md", "config.json", "generation_config.json", "tokenizer.json", "vocab.txt"]
    assert payload["load_hint"]["imports"] == ["import ckptool"]
    assert not any("config.json" in f for f in payload["files"])  # files: the set's own (shards, then index)
    r = run_cli("filter", model_dirs["bin"], "--keep", "*", "-o", tmp_path / "f", "--json")
    assert r.exit_code == 0, r.output
    assert "vocab.txt" in json.loads(r.output)["kept"]
    assert json.loads(r.output)["load_hint"]["imports"] == ["import transformers"]


def test_the_library_results_name_the_kept_files(model_dirs: dict[str, Any], tmp_path: Path) -> None:
    import ckptool

    res = ckptool.strip_prefix(model_dirs["st"], "transformer.", tmp_path / "a")
    assert res.kept == ["README.md", "config.json", "generation_config.json", "tokenizer.json", "vocab.txt"]
    res = ckptool.remap(model_dirs["bin"], tmp_path / "b", to="cpu")
    assert "config.json" in res.kept


def _third_copy_fails(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The set writer's companion copy made to fail on its third call (disk full); the list of the files it was
    asked to copy, filled as it runs."""
    from ckptool.errors import OutputError
    from ckptool.ops.rewrite import set_writer

    calls: list[str] = []

    def failing(src: str, dst: str) -> None:
        calls.append(src)
        if len(calls) == 3:
            raise OutputError(f"copying {src} into the output failed: disk full; nothing was kept", dst)
        shutil.copyfile(src, dst)

    monkeypatch.setattr(set_writer, "copy_companion", failing)
    return calls


def test_a_failed_copy_leaves_nothing(model_dirs: dict[str, Any], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The companions are part of the set's commit: a copy that fails leaves no shard, index nor companion."""
    import ckptool
    from ckptool.errors import OutputError

    calls = _third_copy_fails(monkeypatch)
    with pytest.raises(OutputError):
        ckptool.strip_prefix(model_dirs["st"], "transformer.", tmp_path / "out")
    assert len(calls) == 3
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_set_written_into_its_own_folder_copies_nothing(model_dirs: dict[str, Any], run_cli: Any,
                                                          tmp_path: Path) -> None:
    src = tmp_path / "m"
    shutil.copytree(model_dirs["st"], src)
    before = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    r = run_cli("strip-prefix", src, "transformer.", "-o", src / "bare.safetensors.index.json")
    assert r.exit_code == 0, r.output
    assert "kept: " not in r.output
    for name, data in before.items():
        assert (src / name).read_bytes() == data, name
    # an index transformers does not read: the hint loads it into the user's model, by the index
    assert _hint(r.output) == f"ckptool.load_into(model, {str(src / 'bare.safetensors.index.json')!r})"


def test_other_weights_in_the_folder_are_not_copied(model_dirs: dict[str, Any], run_cli: Any,
                                                    tmp_path: Path) -> None:
    """Weights the rewrite did not change (the other set of a folder holding both, pytorch_model.bin beside
    model.safetensors) would not match the new set: named in a note, not copied."""
    src = tmp_path / "both"
    shutil.copytree(model_dirs["st"], src)
    for p in model_dirs["bin"].glob("pytorch_model*"):
        shutil.copyfile(p, src / p.name)
    r = run_cli("strip-prefix", src / "model.safetensors.index.json", "transformer.", "-o", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert not list((tmp_path / "o").glob("pytorch_model*"))
    assert "pytorch_model-00001-of-0000" in r.output and "not copied from the input folder" in r.output
    assert "config.json" in _kept(r.output)


def test_a_set_hint_without_config_loads_into_the_model(model_dirs: dict[str, Any], run_cli: Any,
                                                        tmp_path: Path) -> None:
    """No config.json: ``ckptool.load_into(model, folder)``; short whatever the number of shards."""
    src = tmp_path / "bare"
    src.mkdir()
    for p in model_dirs["st"].glob("model*"):
        shutil.copyfile(p, src / p.name)
    r = run_cli("strip-prefix", src, "transformer.", "-o", tmp_path / "o")
    assert r.exit_code == 0, r.output
    hint = _hint(r.output)
    assert hint == f"ckptool.load_into(model, {str(tmp_path / 'o')!r})"
    assert "kept: " not in r.output
    import ckptool

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(model_dirs["st"])).transformer
    eval(hint, {"ckptool": ckptool, "model": model})  # the printed line
    for k, v in model.state_dict().items():
        assert torch.equal(v, model_dirs["state"]["transformer." + k]), k


# ------------------------------------------------------------------------------------------------ one weights file
@pytest.fixture(scope="module")
def one_file_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny GPT-2 saved by save_pretrained in one model.safetensors, and the same as one pytorch_model.bin
    (torch.save of its state_dict, as transformers 4 wrote it), each folder with config files, tokenizer-like
    files, a hidden file and a subfolder."""
    base = tmp_path_factory.mktemp("hf1")
    torch.manual_seed(1)
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16,
                                     bos_token_id=0, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(config)
    st = base / "gpt2-st"
    model.save_pretrained(st)
    assert sorted(p.name for p in st.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    pt = base / "gpt2-bin"
    pt.mkdir()
    torch.save(model.state_dict(), pt / "pytorch_model.bin")
    for folder in (st, pt):
        for name, data in COMPANIONS.items():
            (folder / name).write_bytes(data)
        if folder is pt:
            for name in ("config.json", "generation_config.json"):
                shutil.copyfile(st / name, pt / name)
        (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
        (folder / "onnx").mkdir()
        (folder / "onnx" / "model.onnx").write_bytes(b"not copied")
    return {"st": st, "bin": pt, "state": {k: v.clone() for k, v in model.state_dict().items()}}


#: each rewriting command on a model folder holding one weights file: (input, argv, the weights file written,
#: whether from_pretrained loads the output as the model); ``{src}`` the input folder, ``{out}`` the test's folder (a
#: step may read an earlier step's output folder)
_ONE_FILE_STEPS = [
    ("st", ["strip-prefix", "{src}", "transformer.", "-o", "{out}/stripped"], "model.safetensors", False),
    ("st", ["add-prefix", "{out}/stripped", "transformer.", "-o", "{out}/back"], "model.safetensors", True),
    ("st", ["add-prefix", "{src}", "module.", "-o", "{out}/dp"], "model.safetensors", False),
    ("st", ["strip-dataparallel", "{out}/dp", "-o", "{out}/undp"], "model.safetensors", True),
    ("st", ["add-prefix", "{src}", "_orig_mod.", "-o", "{out}/compiled"], "model.safetensors", False),
    ("st", ["unwrap", "{out}/compiled", "-o", "{out}/unwrapped"], "model.safetensors", True),
    ("st", ["rename", "{out}/stripped", "--rule", r"^(wte|wpe|h|ln_f)\.=transformer.\1.", "-o", "{out}/renamed"],
     "model.safetensors", True),
    ("st", ["filter", "{src}", "--keep", "*", "-o", "{out}/filtered"], "model.safetensors", True),
    ("bin", ["remap", "{src}", "--to", "cpu", "-o", "{out}/remapped"], "pytorch_model.bin", True),
    ("bin", ["remap", "{src}", "--to", "cpu", "--strip-prefix", "transformer.", "-o", "{out}/remap-stripped"],
     "pytorch_model.bin", False),
    ("bin", ["strip-prefix", "{src}", "transformer.", "-o", "{out}/bin-stripped"], "pytorch_model.bin", False),
    ("bin", ["add-prefix", "{out}/bin-stripped", "transformer.", "-o", "{out}/bin-back"], "pytorch_model.bin", True),
    ("bin", ["rename", "{out}/bin-stripped", "--rule", r"^(wte|wpe|h|ln_f)\.=transformer.\1.", "--to", "cpu", "-o",
             "{out}/bin-renamed"], "pytorch_model.bin", True),
    ("bin", ["filter", "{src}", "--keep", "*", "-o", "{out}/bin-filtered"], "pytorch_model.bin", True),
]

_KEPT = ["README.md", "config.json", "generation_config.json", "tokenizer.json", "vocab.txt"]


def _loads_after_wrapping(out: Path, weights: str, state: dict[str, Any]) -> None:
    """The wrapper's prefix removed by ckptool.load_into, the folder's weights load into the model."""
    import ckptool

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(out))
    ckptool.load_into(model, str(out / weights))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_every_rewrite_of_a_one_file_model_folder_writes_a_folder(one_file_dirs: dict[str, Any], run_cli: Any,
                                                                  tmp_path: Path) -> None:
    """The folder given: a folder written, the weights file under its own name, every other file copied byte for
    byte and listed (``kept:``), and ``from_pretrained(out)`` loads it (names as transformers saves them)."""
    for which, argv, weights, loads in _ONE_FILE_STEPS:
        src = one_file_dirs[which]
        args = [a.format(src=src, out=tmp_path) for a in argv]
        r = run_cli(*args)
        assert r.exit_code == 0, (args, r.output)
        out = Path(args[-1])
        assert sorted(p.name for p in out.iterdir()) == sorted([weights, *_KEPT]), args
        _companions_copied(src, out)
        assert _kept(r.output) == _KEPT, args
        assert f"Wrote {out / weights} (" in r.output, r.output
        if "{src}" in argv:  # the input folder's subfolder is named, not copied
            assert "not copied from the input folder: onnx/" in r.output
        hint = _hint(r.output)
        if args[2] in ("module.", "_orig_mod."):  # a wrapper's prefix: from_pretrained would match no key
            assert hint.startswith("model.load_state_dict(") and "Note: every key starts with" in r.output, hint
            _loads_after_wrapping(out, weights, one_file_dirs["state"])
            continue
        if args[0] in ("remap", "filter") and "--strip-prefix" not in args:  # names as saved: from_pretrained
            assert hint == f"transformers.GPT2LMHeadModel.from_pretrained({str(out)!r})", hint
            eval(hint, {"transformers": transformers})  # the printed line, run as a user runs it
        else:  # keys renamed: into the user's own model, from_pretrained named in a note
            assert hint == f"ckptool.load_into(model, {str(out / weights)!r})", hint
            assert "keys were renamed: transformers.GPT2LMHeadModel.from_pretrained(" in r.output
        if loads:  # (a step that removed the base model's prefix is read back by the next step)
            _loads_as_the_model(out, one_file_dirs["state"])


def test_a_one_file_folder_gets_the_default_folder_name(one_file_dirs: dict[str, Any], run_cli: Any,
                                                        tmp_path: Path) -> None:
    """Without -o: ``<folder>.<tag>`` beside the input folder, as a sharded set's folder gets; never a file inside
    the input folder, nor a ``.pt`` file named after the folder."""
    src = tmp_path / "gpt2"
    shutil.copytree(one_file_dirs["st"], src)
    before = sorted(p.name for p in src.iterdir())
    for argv, tag in ((["strip-prefix", src, "transformer."], "stripped"), (["filter", src, "--keep", "*"],
                                                                            "filtered"),
                      (["rename", src, "--rule", "a=a"], "renamed"), (["unwrap", src, "--allow-missing"],
                                                                      "unwrapped")):
        r = run_cli(*argv)
        assert r.exit_code == 0, (argv, r.output)
        assert (tmp_path / f"gpt2.{tag}" / "model.safetensors").is_file(), r.output
        assert "config.json" in _kept(r.output)
    assert sorted(p.name for p in src.iterdir()) == before  # nothing written into the input folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "gpt2.filtered", "gpt2.renamed", "gpt2.stripped",
                                                          "gpt2.unwrapped"]
    r = run_cli("remap", one_file_dirs["bin"], "--to", "cpu")
    assert r.exit_code == 0, r.output
    out = Path(str(one_file_dirs["bin"]) + ".cpu")
    try:
        assert (out / "pytorch_model.bin").is_file() and (out / "config.json").is_file()
    finally:
        shutil.rmtree(out)
    r = run_cli("strip-prefix", src, "transformer.")  # the default folder already holds the weights file
    assert r.exit_code != 0 and "already holds model.safetensors; pass --force" in r.output, r.output
    assert run_cli("strip-prefix", src, "transformer.", "--force").exit_code == 0


def test_the_file_given_or_a_file_output_keeps_the_single_file_behaviour(one_file_dirs: dict[str, Any],
                                                                         run_cli: Any, tmp_path: Path) -> None:
    """The weights file given (or ``-o`` naming a file, or ``--in-place``): one file, nothing copied."""
    src = tmp_path / "m"
    shutil.copytree(one_file_dirs["st"], src)
    r = run_cli("strip-prefix", src / "model.safetensors", "transformer.")
    assert r.exit_code == 0, r.output
    assert (src / "model.stripped.safetensors").is_file() and "kept: " not in r.output
    r = run_cli("filter", src, "--keep", "*", "-o", tmp_path / "one.safetensors")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "one.safetensors").is_file() and "kept: " not in r.output
    r = run_cli("remap", one_file_dirs["bin"], "--to", "cpu", "-o", tmp_path / "one.bin")
    assert r.exit_code == 0 and "kept: " not in r.output, r.output
    r = run_cli("strip-prefix", src, "transformer.", "--in-place")
    assert r.exit_code == 0, r.output
    assert "kept: " not in r.output and (src / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "one.bin", "one.safetensors"]


def test_json_and_library_results_list_the_kept_files_of_a_one_file_folder(one_file_dirs: dict[str, Any],
                                                                           run_cli: Any, tmp_path: Path) -> None:
    import ckptool

    r = run_cli("strip-prefix", one_file_dirs["st"], "transformer.", "-o", tmp_path / "o", "--json")
    assert r.exit_code == 0, r.output
    payload = json.loads(r.output)
    assert payload["kept"] == _KEPT and payload["dst"] == str(tmp_path / "o" / "model.safetensors")
    assert any("onnx/" in n for n in payload["notes"])
    r = run_cli("filter", one_file_dirs["bin"], "--keep", "*", "-o", tmp_path / "f", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["kept"] == _KEPT
    assert ckptool.remap(one_file_dirs["bin"], tmp_path / "b", to="cpu").kept == _KEPT
    assert ckptool.rename(one_file_dirs["st"], tmp_path / "c", rules=["a=a"]).kept == _KEPT
    assert ckptool.filter_keys(one_file_dirs["st"], tmp_path / "d", keep="*").kept == _KEPT
    assert ckptool.remap(one_file_dirs["bin"] / "pytorch_model.bin", tmp_path / "e.bin", to="cpu").kept == []


def test_a_failed_copy_in_a_one_file_folder_leaves_nothing(one_file_dirs: dict[str, Any], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights file and the companions are one commit: a copy that fails leaves no file and no folder."""
    import ckptool
    from ckptool.errors import OutputError

    calls = _third_copy_fails(monkeypatch)
    with pytest.raises(OutputError):
        ckptool.strip_prefix(one_file_dirs["st"], "transformer.", tmp_path / "out")
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(OutputError):
        ckptool.filter_keys(one_file_dirs["bin"], tmp_path / "out2", keep="*")
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_convert_of_a_model_folder_into_a_folder_keeps_its_files(model_dirs: dict[str, Any],
                                                                 one_file_dirs: dict[str, Any], run_cli: Any,
                                                                 tmp_path: Path) -> None:
    """convert of a model folder (a set, or one weights file) into a folder of shards copies the folder's other
    files as the rewriting commands do (``kept:``, ``--json``), and ``from_pretrained(out)`` loads the result; into
    one file, nothing is copied and a note says how to keep them (issue 37)."""
    for name, src, state in (("set", model_dirs["bin"], model_dirs["state"]),
                             ("one", one_file_dirs["st"], one_file_dirs["state"])):
        out = tmp_path / f"{name}-out"
        r = run_cli("convert", src, "-o", out, "--max-shard-size", "2KB")
        assert r.exit_code == 0, r.output
        _companions_copied(src, out)
        assert _kept(r.output) == _KEPT
        assert "not copied from the input folder: onnx/" in r.output
        _loads_as_the_model(out, state)
        r = run_cli("convert", src, "-o", tmp_path / f"{name}-json", "--max-shard-size", "2KB", "--json")
        assert r.exit_code == 0 and json.loads(r.output)["kept"] == _KEPT, r.output
        r = run_cli("convert", src, "-o", tmp_path / f"{name}.safetensors")
        assert r.exit_code == 0, r.output
        assert "kept:" not in r.output and "are not copied beside a file" in r.output
