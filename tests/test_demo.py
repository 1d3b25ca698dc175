"""``ckptool demo``: the bundled data, the device choice, and one fast run of the whole story whose files are
checked with plain torch (the demo's own claims are not taken on trust).

The run (CPU, few epochs, into a tmp folder) is made once per module, step by step: when a step raises, the
tests that need it fail with that step's error, and the tests of earlier steps still run.
"""

from __future__ import annotations

import gzip
import math
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
import torch
from helpers import assert_same_tensors, location_tags
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ckptool import demo
from ckptool.demo import KINDS, DemoRun, DigitsMLP, Printer
from ckptool.errors import UsageError

EPOCHS = 3


# ------------------------------------------------------------------------------------------------ the data
def test_bundled_digits_are_the_uci_test_set():
    pixels, labels = demo.load_digits()
    assert len(pixels) == len(labels) == 1797
    assert all(len(row) == 64 for row in pixels)
    assert {v for row in pixels for v in row} <= set(range(17))
    assert sorted(set(labels)) == list(range(10))
    assert labels[:5] == [0, 1, 2, 3, 4]  # digits.csv.gz starts with one sample of each digit in order


def test_bundled_data_ships_with_its_license():
    data = Path(demo.__file__).parent / "data"
    text = (data / "LICENSE-digits.txt").read_text()
    assert "CC BY 4.0" in text and "Alpaydin" in text and "Kaynak" in text and "BSD 3-Clause" in text
    assert (data / "digits.rst").read_text().startswith(".. _digits_dataset:")
    with gzip.open(data / "digits.csv.gz", "rt") as f:
        assert sum(1 for _ in f) == 1797


def test_split_is_seeded_and_scaled():
    a, b, c = demo.digits_split(0), demo.digits_split(0), demo.digits_split(1)
    assert a.x_train.shape == (1438, 8, 8) and a.x_test.shape == (359, 8, 8)
    assert a.x_train.dtype == torch.float32 and a.y_train.dtype == torch.int64
    assert float(a.x_train.min()) == 0.0 and float(a.x_train.max()) == 1.0
    assert torch.equal(a.y_test, b.y_test) and not torch.equal(a.y_test, c.y_test)


# ------------------------------------------------------------------------------------------------ devices
def test_resolve_device_cpu_and_auto():
    assert demo.resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert demo.resolve_device("auto").type == expected


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "gpu0", ""])
def test_resolve_device_rejects_unknown(spec):
    with pytest.raises(UsageError, match="unknown --device"):
        demo.resolve_device(spec)


def test_resolve_device_rejects_a_missing_gpu():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(UsageError, match=f"--device cuda:{n}"):
        demo.resolve_device(f"cuda:{n}")


def test_missing_gpu_tag_really_fails_a_plain_load(tmp_path):
    tag = demo.missing_gpu_tag()
    assert tag.startswith("cuda:") and int(tag[5:]) >= max(1, torch.cuda.device_count())
    torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
    import ckptool

    ckptool.remap(tmp_path / "a.pt", tmp_path / "b.pt", to=tag)
    msg = demo.plain_load_error(tmp_path / "b.pt")
    assert msg is not None and msg.startswith("RuntimeError: Attempting to deserialize object on")
    assert demo.plain_load_error(tmp_path / "a.pt") is None


def test_prepare_out_default_is_a_new_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    a, b = demo.prepare_out(None), demo.prepare_out(None)
    assert a != b and a.parent == b.parent == tmp_path and a.name.startswith("ckptool-demo-")
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="not a folder"):
        demo.prepare_out(tmp_path / "f")
    assert demo.prepare_out(tmp_path / "new" / "sub").is_dir()


# ------------------------------------------------------------------------------------------------ one run
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    lines: list[str] = []
    d = DemoRun(out, torch.device("cpu"), EPOCHS, 0, Printer(echo=lambda s: lines.append(click.unstyle(s))), bar=False)
    failed: dict[str, BaseException] = {}
    for step in DemoRun.STEPS:
        try:
            getattr(d, step)()
        except Exception as e:  # recorded: the tests that need this step fail with it
            failed[step] = e
            break
    return SimpleNamespace(res=d.res, split=d.split, out=out, text="\n".join(lines), failed=failed)


def need(run, step):
    """Fail (not skip) when ``step`` or a step before it did not complete."""
    for s in DemoRun.STEPS[: DemoRun.STEPS.index(step) + 1]:
        if s in run.failed:
            e = run.failed[s]
            pytest.fail(f"demo step {s!r} failed, so {step!r} cannot be checked: {type(e).__name__}: {e}")


def logits(model, x):
    with torch.no_grad():
        return model.eval()(x)


def test_training_beats_chance(run):
    need(run, "train")
    assert run.res.accuracy > 0.5  # chance is 0.1; a 30-epoch run reaches about 0.97
    assert len(run.res.losses) == EPOCHS and run.res.losses[-1] < run.res.losses[0]
    assert "held-out accuracy" in run.text


def test_three_checkpoint_kinds_are_saved(run):
    need(run, "save")
    saved = run.res.saved
    assert set(saved) == set(KINDS) and all(p.parent == run.out for p in saved.values())
    sd = torch.load(saved["state_dict"], weights_only=True)
    assert isinstance(sd, dict) and all(isinstance(v, torch.Tensor) for v in sd.values())
    ck = torch.load(saved["checkpoint"], weights_only=True)
    assert set(ck) >= {"epoch", "model_state_dict", "optimizer_state_dict", "scheduler_state_dict"}
    assert ck["epoch"] == EPOCHS and ck["optimizer_state_dict"]["state"]
    with pytest.raises(pickle.UnpicklingError):  # a pickled nn.Module: refused by the weights_only allowlist
        torch.load(saved["full_model"], weights_only=True)
    import ckptool

    assert [ckptool.inspect(saved[k]).kind for k in KINDS] == ["state_dict", "full_model", "training_checkpoint"]


def test_saved_state_dict_carries_module_prefix(run):
    need(run, "save")
    sd = torch.load(run.res.saved["state_dict"], weights_only=True)
    assert sd and all(k.startswith("module.") for k in sd)
    assert [k[len("module."):] for k in sd] == list(DigitsMLP().state_dict())
    ck = torch.load(run.res.saved["checkpoint"], weights_only=True)
    assert list(ck["model_state_dict"]) == list(sd)


def test_inspect_step_names_the_unsafe_globals(run):
    need(run, "inspect")
    section = run.text.split("== 3/7 Inspect ==")[1].split("== 4/7")[0]
    lines = {ln.split()[0]: ln for ln in section.splitlines() if ln.strip().startswith(demo.STEM)}
    assert "module." in lines["digits_mlp.state_dict.pt"] and "none" in lines["digits_mlp.state_dict.pt"]
    assert "6: DataParallel, DigitsMLP, Flatten, Sequential, Linear, ReLU" in lines["digits_mlp.full_model.pt"]
    assert "training_checkpoint" in lines["digits_mlp.checkpoint.pt"]


def test_received_copies_are_tagged_for_a_missing_gpu(run):
    need(run, "failure")
    tag = run.res.gpu_tag
    for kind in KINDS:
        tags = location_tags(run.res.received[kind])
        assert tags and set(tags) == {tag}
    assert run.res.plain_load_error and "Attempting to deserialize object on" in run.res.plain_load_error
    assert run.res.plain_load_error in run.text
    with pytest.raises(RuntimeError, match="Attempting to deserialize object on"):
        torch.load(run.res.received["state_dict"], weights_only=True)


def test_portable_state_dict_loads_strictly_into_bare_model_on_cpu(run):
    need(run, "fix")
    path = run.res.portable["state_dict"]
    assert set(location_tags(path)) == {"cpu"}
    model = DigitsMLP()
    model.load_state_dict(torch.load(path, weights_only=True))  # plain torch.load, strict
    # the reference: the file as trained, its prefix removed by torch's own helper
    ref_sd = torch.load(run.res.saved["state_dict"], weights_only=True)
    consume_prefix_in_state_dict_if_present(ref_sd, "module.")
    ref = DigitsMLP()
    ref.load_state_dict(ref_sd)
    x = run.split.x_test
    assert torch.equal(logits(model, x), logits(ref, x))
    assert run.res.matches["state_dict"] == run.res.n_test == len(x)


def test_portable_training_checkpoint_keeps_everything(run):
    need(run, "fix")
    new = torch.load(run.res.portable["checkpoint"], weights_only=True)
    old = torch.load(run.res.saved["checkpoint"], weights_only=True)
    assert set(location_tags(run.res.portable["checkpoint"])) == {"cpu"}
    DigitsMLP().load_state_dict(new["model_state_dict"])  # strict
    consume_prefix_in_state_dict_if_present(old["model_state_dict"], "module.")
    assert_same_tensors(new, old)
    assert run.res.matches["checkpoint"] == run.res.n_test


def test_portable_full_model_lost_its_wrapper_but_still_needs_trust(run):
    need(run, "fix")
    import ckptool

    info = ckptool.inspect(run.res.portable["full_model"])
    assert info.kind == "full_model" and set(info.devices) == {"cpu"}
    assert "ckptool.demo.DigitsMLP" in info.unsafe_globals
    assert not any("DataParallel" in g for g in info.unsafe_globals)


def test_the_full_model_refusal_is_followed_by_its_fix(run):
    """verify refuses the pickled model without trust; the demo then shows the fix it recommends (extract its
    state_dict without running it, then verify that) instead of ending on the refusal."""
    need(run, "fix")
    import ckptool

    fixed = run.res.extracted
    assert fixed is not None and fixed.is_file() and ckptool.inspect(fixed).kind == "state_dict"
    assert ckptool.inspect(fixed).unsafe_globals == []
    n = run.res.n_test
    assert run.res.verified["full_model"] == f"yes after extract-state-dict ({n}/{n} same predictions)"
    assert run.res.matches["full_model"] == run.res.n_test
    text = run.text
    assert f"$ ckptool extract-state-dict {run.res.portable['full_model'].name} -o {fixed.name}" in text
    assert f"$ ckptool verify {fixed.name} --model ckptool.demo:DigitsMLP" in text
    assert f"OK: {fixed} loads into DigitsMLP" in text
    fix = text[text.index("== 5/7"):text.index("== 6/7")]
    assert "UnsafeCheckpointError" not in fix and max(len(line) for line in fix.splitlines()) < 160


def test_the_demo_measures_and_prints_its_own_time(tmp_path, capsys):
    res = demo.run_demo(out=tmp_path / "t", device="cpu", epochs=1, summary_only=True)
    last = capsys.readouterr().out.splitlines()[-1]
    assert res.seconds > 0 and last.startswith(f"Done in {res.seconds:.1f} s.")


def test_resume_continues_from_the_checkpoint(run):
    need(run, "resume")
    r = run.res.resumed
    assert r["epoch"] == EPOCHS and r["loss"] == pytest.approx(run.res.losses[-1])
    assert math.isfinite(r["loss_after"]) and r["loss_after"] < run.res.losses[0]
    assert r["state_device"] == "cpu"


def test_summary_table(run):
    need(run, "summary")
    rows = {r[0]: r for r in run.res.rows}
    assert list(rows) == [run.res.portable[k].name for k in KINDS]
    for r in rows.values():
        assert r[3] == run.res.gpu_tag and r[4] == "cpu" and r[5] == "module." and r[6] == "none"
    assert "tags received" in run.text


def test_printed_cli_commands_work(run, run_cli, tmp_path, monkeypatch):
    """Every ``$ ckptool ...`` line the demo prints runs as shown, in a copy of its folder."""
    need(run, "fix")
    import shlex
    import shutil

    shutil.copy(run.res.saved["state_dict"], tmp_path)
    shutil.copy(run.res.portable["full_model"], tmp_path)
    monkeypatch.chdir(tmp_path)
    cmds = [ln.strip()[2:] for ln in run.text.splitlines() if ln.strip().startswith("$ ckptool ")]
    assert [c.split()[1] for c in cmds] == ["inspect", "remap", "remap", "strip-dataparallel", "verify",
                                            "extract-state-dict", "verify"]
    for c in cmds:
        res = run_cli(*shlex.split(c)[1:])
        assert res.exit_code == 0, f"{c}\n{res.output}"
    assert (tmp_path / run.res.portable["state_dict"].name).is_file()


def test_everything_is_written_under_out(run):
    need(run, "summary")
    written = {p for group in (run.res.saved, run.res.received, run.res.remapped, run.res.portable)
               for p in group.values()} | {run.res.extracted}
    assert len(written) == 4 * len(KINDS) + 1
    assert {p for p in run.out.rglob("*") if p.is_file()} == written


# ------------------------------------------------------------------------------------------------ the command
def test_cli_demo_runs_and_exits_0(run_cli, tmp_path):
    res = run_cli("demo", "--out", tmp_path / "o", "--device", "cpu", "--epochs", 2, "--seed", 1)
    assert res.exit_code == 0, res.output
    for n, title in enumerate(["Train", "Save", "Inspect", "The failure users meet", "Fix it", "Resume", "Summary"]):
        assert f"== {n + 1}/7 {title} ==" in res.output
    assert "$ ckptool remap" in res.output and "$ ckptool strip-dataparallel" in res.output
    assert str(tmp_path / "o") in res.output
    assert (tmp_path / "o" / "digits_mlp.state_dict.portable.pt").is_file()


def test_run_demo_quiet_prints_nothing_at_all(tmp_path, capfd):
    """``run_demo(quiet=True)``: not a line on stdout or stderr (read at the file-descriptor level, so C-level
    output and warnings count too), no progress bar, and every file is still written and reported."""
    lines: list[str] = []
    res = demo.run_demo(out=tmp_path / "q", device="cpu", epochs=1, quiet=True)
    assert capfd.readouterr() == ("", "")
    res2 = demo.run_demo(out=tmp_path / "e", device="cpu", epochs=1, quiet=True, echo=lines.append,
                         progress_bar=True)
    assert capfd.readouterr() == ("", "") and lines == []
    for r in (res, res2):
        assert len(r.rows) == len(KINDS) and r.portable["state_dict"].is_file()
        assert r.verified["state_dict"].startswith("yes")


def test_run_demo_summary_only_prints_the_table_and_the_closing_line(tmp_path, capsys):
    res = demo.run_demo(out=tmp_path / "s", device="cpu", epochs=1, summary_only=True)
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err == "" and "== 1/7" not in out
    assert lines[0].startswith("file ") and "tags received" in lines[0]
    assert lines[-1].startswith("Done in ") and str(res.out) in lines[-1]
    assert len(lines) == 2 + len(KINDS) + 1  # header, rule, one row per kind, the closing line


@pytest.mark.parametrize(("kwargs", "shown"), [({}, ["a", "b"]), ({"quiet": True}, ["b"]), ({"silent": True}, []),
                                               ({"quiet": True, "silent": True}, [])])
def test_printer_modes(kwargs, shown):
    """quiet keeps only forced lines (the summary), silent keeps nothing."""
    got: list[str] = []
    p = Printer(echo=got.append, **kwargs)
    p.line("a")
    p.line("b", force=True)
    assert got == shown


def test_cli_demo_quiet_prints_nothing(run_cli, tmp_path):
    """--quiet means the same on every command: only errors are printed (issue 13); the files are still written."""
    res = run_cli("demo", "--out", tmp_path, "--device", "cpu", "--epochs", 1, "--quiet")
    assert res.exit_code == 0, res.output
    assert res.output == ""
    assert any(tmp_path.rglob("*.pt"))


@pytest.mark.parametrize("args,msg", [
    (["--device", "tpu"], "Error: unknown --device 'tpu'"),
    (["--device", "cuda:99"], "Error: --device cuda:99: "),
    (["--epochs", "0"], "Invalid value for '--epochs'"),
])
def test_cli_demo_bad_options(run_cli, tmp_path, args, msg):
    res = run_cli("demo", "--out", tmp_path, *args)
    assert res.exit_code == 2
    assert msg in res.output and "Traceback" not in res.output
    assert not any(tmp_path.iterdir())


def test_cli_import_does_not_import_torch():
    code = ("import ckptool.cli, sys; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'demo' in ckptool.cli.cli.commands")
    subprocess.run([sys.executable, "-c", code], check=True)
