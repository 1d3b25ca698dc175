"""Bounded by the input (issue 36 item 2): a tensor whose dense size is far more than the bytes its storage holds
(a stride-0 view saved by ``torch.save``, a DCP ``.metadata`` declaring more than its records hold) is refused by
every command that would make it dense, with its factor and ``--max-expand``; DCP records are checked against
their files before torch reads them; no message carries a torch traceback.

The hostile files are a few KiB (:mod:`hostile_inputs`); each command runs in a subprocess with a generous hang
guard (no timing is asserted: an unbounded command would hang or run out of memory instead of answering).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hostile_inputs import CASES, dcp_expanded, make_case

import ckptool
from ckptool.errors import CorruptCheckpointError, UnsupportedError, UsageError
from ckptool.formats.tensors import EXPAND_FLOOR, MAX_EXPAND, Storage, Tensor
from ckptool.readers import open_checkpoint
from ckptool.readers.budget import ExpandBudget, check_expansion, max_expand_value
from ckptool.torch_ops.dcp import dcp_to_torch_file

REPO = Path(__file__).resolve().parent.parent
#: an unbounded command would run for hours (4 TiB): this guard only turns a hang into a failure
HANG_GUARD_S = 300

MODELS = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))
def build():
    return M()
"""

LOAD_INTO = """
import sys, ckptool
sys.path.insert(0, sys.argv[2])
from models import M
try:
    ckptool.load_into(M(), sys.argv[1], device="cpu")
except ckptool.CkptError as e:
    print(f"Error: {e}")
    sys.exit(1)
print("loaded")
"""

COMMANDS = ("inspect", "scan", "remap", "convert", "verify", "diff", "average", "report", "load_into")


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "models.py").write_text(MODELS, encoding="utf-8")
    return {name: make_case(name, folder) for name in CASES}


def _argv(command: str, path: Path, other: Path, out: Path) -> list[str]:
    cli = [sys.executable, "-m", "ckptool"]
    models = path.parent / "models.py"
    return {
        "inspect": [*cli, "inspect", str(path)],
        "scan": [*cli, "scan", str(path)],
        "remap": [*cli, "remap", str(path), "--to", "cpu", "-o", str(out / "remapped.pt")],
        "convert": [*cli, "convert", str(path), "-o", str(out / "converted.safetensors")],
        "verify": [*cli, "verify", str(path), "--model", f"{models}:build", "--device", "cpu"],
        "diff": [*cli, "diff", str(path), str(other)],
        "average": [*cli, "average", str(path), str(other), "-o", str(out / "averaged.pt")],
        "report": [*cli, "report", str(path), str(other), "-o", str(out / "report.html")],
        "load_into": [sys.executable, "-c", LOAD_INTO, str(path), str(path.parent)],
    }[command]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(argv, capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=cwd, env=env, check=False)


#: what each command answers on each case beyond the common rules: (exit status, words in the output)
EXPECTED: dict[tuple[str, str], tuple[int, str]] = {
    **{("stride0.pt", c): (1, "--max-expand") for c in ("convert", "diff", "average", "report")},
    **{("dcp_stride0", c): (1, "--max-expand") for c in ("convert", "verify", "diff", "average", "report",
                                                         "load_into")},
    **{("dcp_declared", c): (1, "where .metadata says float32 [1048576, 1048576]")
       for c in ("convert", "verify", "diff", "average", "report", "load_into")},
    **{("dcp_offset", c): (1, "past the end") for c in ("convert", "verify", "diff", "average", "report",
                                                        "load_into")},
    **{(case, c): (1, "truncated") for case in ("truncated.pth", "truncated.pt")
       for c in ("inspect", "remap", "convert", "verify", "diff", "average", "report", "load_into")},
    **{(case, "scan"): (5, "INCOMPLETE") for case in ("dcp_offset", "truncated.pth", "truncated.pt")},
    ("stride0.pt", "inspect"): (0, "1048576x1048576"),
    ("stride0.pt", "remap"): (0, "Wrote"),  # the storage is copied, the view kept: 4 bytes
    ("stride0.pt", "scan"): (0, "dense over a storage of 4 B"),  # a note, not a danger
    ("dcp_stride0", "scan"): (0, "safe"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", CASES)
def test_every_command_answers_each_hostile_input_boundedly(cases: dict[str, Path], tmp_path: Path, case: str,
                                                            command: str) -> None:
    path = cases[case]
    other = tmp_path / f"copy_{path.name}"  # B of diff, average and report: the same hostile input
    (shutil.copytree if path.is_dir() else shutil.copyfile)(path, other)
    proc = _run(_argv(command, path, other, tmp_path), tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 3, out  # never a bug
    assert "Traceback" not in out, out
    errors = [ln for ln in out.splitlines() if ln.startswith("Error:")]
    assert len(errors) <= 1, out
    if proc.returncode == 1 and command not in ("verify", "load_into"):
        assert errors, out  # a refusal is one Error: line
    want = EXPECTED.get((case, command))
    if want is not None:
        assert proc.returncode == want[0] and want[1] in out, out
    for name in ("converted.safetensors", "averaged.pt"):  # nothing half-written is left behind
        if proc.returncode:
            assert not (tmp_path / name).exists()


# ------------------------------------------------------------------------------------------------ the budget
def test_the_flag_allows_what_the_default_refuses(tmp_path: Path, run_cli) -> None:
    src = tmp_path / "broadcast.pt"
    torch.save({"w": torch.ones(1).expand(2**23)}, src)  # 32 MiB dense over 4 bytes: past the 16 MiB floor
    r = run_cli("convert", src, "-o", tmp_path / "a.safetensors")
    assert r.exit_code == 1 and "pass --max-expand" in r.output and "--max-expand limit of 64x" in r.output
    assert not (tmp_path / "a.safetensors").exists()
    r = run_cli("convert", src, "-o", tmp_path / "a.safetensors", "--max-expand", "0")
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "a.safetensors")["w"], torch.ones(2**23))
    need = re.search(r"pass --max-expand (\d+)", run_cli("convert", src, "-o", tmp_path / "b.safetensors").output)
    assert need is not None  # the factor the refusal asks for lets it through
    assert run_cli("convert", src, "-o", tmp_path / "b.safetensors", "--max-expand", need[1]).exit_code == 0
    with pytest.raises(UnsupportedError, match="max_expand="):
        ckptool.diff(src, src)
    assert ckptool.diff(src, src, max_expand=0).identical


def test_load_into_keyword_bounds_a_dcp_folder(tmp_path: Path) -> None:
    """A DCP record saved as a stride-0 view under a .metadata declaring 2^23 elements (32 MiB from 4 bytes) is
    refused before torch allocates it; ``max_expand=0`` loads it, as torch's DCP reader would."""
    folder = dcp_expanded(tmp_path / "dcp", 2**23)

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2**23))

    model = M()
    with pytest.raises(UnsupportedError, match=r"32\.0 MiB dense over a storage of 4 B.*max_expand="):
        ckptool.load_into(model, folder)
    assert not model.w.detach().any()  # nothing was loaded
    ckptool.load_into(model, folder, max_expand=0)
    assert bool((model.w.detach() == 1).all())
    assert ckptool.verify(M(), folder, device="cpu", max_expand=0).ok
    with pytest.raises(UnsupportedError, match="--max-expand"):
        ckptool.verify(M(), folder, device="cpu")


def _tensor(shape: tuple[int, ...], stride: tuple[int, ...], storage: Storage, name: str = "t") -> Tensor:
    return Tensor(name, name, "float32", shape, stride, 0, storage)


def test_real_layouts_are_within_the_default() -> None:
    big = Storage("f", 0, 4 * 1000 * 1000, "float32")
    tensors = [
        _tensor((1000, 1000), (1000, 1), big, "w"),
        _tensor((1000, 1000), (1, 1000), big, "w.T"),  # a transpose: the same elements
        _tensor((10, 1000), (1000, 1), big, "slice"),  # a slice: fewer
        _tensor((1000, 1000), (1000, 1), big, "tied"),  # a tied copy counts in full: 2x
    ]
    assert [t.expansion for t in tensors] == [1.0, 1.0, 0.01, 1.0]
    budget = ExpandBudget(None, "x", "convert").add(tensors)
    assert budget.held == big.nbytes and budget.dense == 3 * big.nbytes + 40_000
    budget.check()
    small = Storage("f", 0, 4, "float32")  # a broadcast buffer under the floor is allowed whatever its factor
    check_expansion([_tensor((EXPAND_FLOOR // 4,), (0,), small)], None, "x", "convert")


def test_the_sum_is_held_to_the_factor_not_each_tensor(tmp_path: Path) -> None:
    """Many small expansions of one shared 4-byte storage, each under the floor, add up and are refused."""
    one = Storage("f", 0, 4, "float32")
    many = [_tensor((1 << 20,), (0,), one, f"t{i}") for i in range(8)]  # 4 MiB each, 32 MiB together
    with pytest.raises(UnsupportedError, match=r"32\.0 MiB from the 4 B the input holds"):
        check_expansion(many, None, "x", "compare")
    check_expansion(many[:3], None, "x", "compare")  # 12 MiB: under the floor
    check_expansion(many, 0, "x", "compare")  # 0: no limit


def test_max_expand_values() -> None:
    assert max_expand_value(None) == MAX_EXPAND
    assert max_expand_value(0) == float("inf") and max_expand_value(3) == 3.0
    with pytest.raises(UsageError):
        max_expand_value(-1)
    with pytest.raises(UsageError):
        max_expand_value(float("nan"))


def test_the_fixtures_and_real_checkpoints_are_within_the_default(real_dir: Path, generated: dict[str, Path]) -> None:
    """Every checkpoint of the repository whose tensors ckptool reads is far under the default factor."""
    checked = 0
    for path in [*sorted(real_dir.iterdir()), *generated.values()]:
        try:
            opened = open_checkpoint(path)
            src = opened.all_tensors()[0] if opened.spec.pickled else opened.state_dict()
        except Exception:  # not a checkpoint whose tensors are read without running code (README, bad files)
            continue
        check_expansion(src.tensors, None, str(path), "convert")
        checked += 1
    assert checked >= 10


def test_an_error_line_never_carries_a_traceback() -> None:
    """The last guard: a library's text carried into a CkptError is cut where a traceback starts."""
    from ckptool.cli._errors import describe_error

    err = CorruptCheckpointError("x: torch failed (boom)\nTraceback (most recent call last):\n  File 'a.py'")
    assert describe_error(err) == ("x: torch failed (boom)", 1)
    assert describe_error(CorruptCheckpointError("two lines\nof tables")) == ("two lines\nof tables", 1)


def test_no_torch_traceback_when_torch_reads_a_dcp_folder(tmp_path: Path) -> None:
    """torch's CheckpointException carries each rank's traceback in its text: only the first rank's exception
    type and first line reach the message (torch's own reader, given the folder ckptool's check refuses)."""
    folder = make_case("dcp_declared", tmp_path)
    with pytest.raises(CorruptCheckpointError) as got:
        dcp_to_torch_file(str(folder), str(tmp_path / "out.pt"))
    msg = str(got.value)
    assert "\n" not in msg and "Traceback" not in msg and "could not read it (" in msg, msg


# ------------------------------------------------------------------------------------------------ inspect's count
def test_inspect_counts_the_bytes_its_scan_would_walk_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """inspect lists every tensor already; its scan takes the dense and storage bytes from that list (issue 41:
    a second walk of 50,000 tensors was a quarter of inspect's time), and walks only past the budget."""
    import ckptool.scanning.entry as scan_entry
    from ckptool.ops.inspect.pickles import counted_bytes, describe

    base = torch.arange(12, dtype=torch.float32)
    sd = {"w": base.view(3, 4), "tied": base.view(3, 4), "row": base[4:8], "h": torch.ones(2, dtype=torch.float16)}
    src = tmp_path / "views.pt"
    torch.save(sd, src)
    ck = open_checkpoint(src).graph()
    described = describe(ck)
    assert counted_bytes(ck, described.tensors, described.totals) == (48 + 48 + 16 + 4, 48 + 4)  # storages once

    def no_walk(root: object) -> None:
        raise AssertionError("the tensors were walked a second time")

    monkeypatch.setattr(scan_entry, "iter_tensors", no_walk)
    info = ckptool.inspect(src)
    assert info.scan is not None and info.scan.verdict == "safe" and not info.scan.notes


def test_inspect_and_scan_give_the_same_expansion_note(tmp_path: Path) -> None:
    src = tmp_path / "broadcast.pt"
    torch.save({"w": torch.ones(1).expand(2**23), "b": torch.zeros(3)}, src)
    info = ckptool.inspect(src)
    (scanned,) = ckptool.scan([src])
    assert info.scan is not None and info.scan.notes == scanned.notes
    assert any("dense over a storage of 4 B" in n for n in scanned.notes)
