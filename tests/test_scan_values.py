"""``ckptool scan`` calls nothing dangerous that loading cannot call (issue 49, item 1).

A global the pickle only holds as a value (``typing.Any`` in OmegaConf metadata, which Lightning saves in a
checkpoint's ``hyper_parameters``) needs trust at most; a "global" that is no Python name (a YAML file whose first
byte is the GLOBAL opcode) is never dangerous, and such a file is not a pickle. Each rule also has the injected
fault next to it: the same global called, or passed to a call that calls it, stays dangerous.
"""

from __future__ import annotations

import copyreg
import pickle
import typing
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from ckptool import scan_file
from ckptool.formats.unpickler import load_pickle_at
from ckptool.model.allowlist import DANGEROUS, NEEDS_TRUST, UNKNOWN, is_importable_name, rate_global


def _hparams() -> Any:
    """Lightning's ``hyper_parameters`` as ``save_hyperparameters`` keeps a config: an OmegaConf DictConfig (its
    node metadata holds ``typing.Any`` as the key and element type)."""
    return OmegaConf.create({"lr": 1e-3, "model": {"hidden": 8, "layers": [1, 2]}, "name": None})


def _global(res: Any, name: str) -> Any:
    found = [g for g in res.globals if g.name == name]
    assert len(found) == 1, [(g.name, g.status) for g in res.globals]
    return found[0]


@pytest.mark.torchfree
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_omegaconf_hparams_typing_any_needs_trust(tmp_path: Path, protocol: int) -> None:
    """A Lightning-style checkpoint whose hyper-parameters are an OmegaConf config: typing.Any is held as a BUILD
    state value, never called: needs trust, with the reason; the file needs trust (exit 4), not dangerous."""
    p = tmp_path / "hp.ckpt"
    p.write_bytes(pickle.dumps({"epoch": 3, "hyper_parameters": _hparams(), "state_dict": {}}, protocol=protocol))
    res = scan_file(p)
    g = _global(res, "typing.Any")
    assert g.status == NEEDS_TRUST and "held only as a value" in g.reason
    assert res.verdict == "needs-trust" and res.exit_code == 4
    # its key path, inside the DictConfig whose class is itself not allowed
    assert "hyper_parameters._metadata.ref_type" in res.pickles[0].key_paths["typing.Any"]
    assert not any(x.status == DANGEROUS for x in res.globals)


def test_omegaconf_hparams_in_a_torch_zip(tmp_path: Path) -> None:
    """The same inside a torch.save zip (Lightning's .ckpt), with a real tensor beside it."""
    import torch  # not a torchfree test: the torch-free CI job has no torch
    p = tmp_path / "lightning.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": _hparams()}, p)
    res = scan_file(p)
    assert _global(res, "typing.Any").status == NEEDS_TRUST
    assert res.verdict == "needs-trust", [(g.name, g.status, g.reason) for g in res.globals]


class _CallsAny:
    def __reduce__(self) -> Any:
        return (typing.Any, ())  # type: ignore[return-value]  # a REDUCE of typing.Any itself


class _ReconstructsAny:
    def __reduce__(self) -> Any:
        # copyreg._reconstructor(cls, base, state) calls base.__new__ and base.__init__: a class passed to it is
        # called, even though no opcode calls it
        return (copyreg._reconstructor, (typing.Any, typing.Any, None))  # type: ignore[attr-defined]


@pytest.mark.torchfree
@pytest.mark.parametrize("obj", [_CallsAny(), _ReconstructsAny()], ids=["reduce", "passed-to-a-call"])
def test_the_same_global_called_stays_dangerous(tmp_path: Path, obj: Any) -> None:
    """Injected fault: typing.Any called (REDUCE) or passed to a call that may call it is dangerous as before."""
    p = tmp_path / "calls.pkl"
    p.write_bytes(pickle.dumps({"hyper_parameters": _hparams(), "x": obj}, protocol=2))
    res = scan_file(p)
    assert _global(res, "typing.Any").status == DANGEROUS
    assert res.verdict == "dangerous" and res.exit_code == 1


@pytest.mark.torchfree
def test_a_known_gadget_held_as_a_value_stays_dangerous(tmp_path: Path) -> None:
    """os.system as a dict value (a hook a model would call later) is not called when loading, but it is a known
    gadget: dangerous."""
    p = tmp_path / "hook.pkl"
    p.write_bytes(b"\x80\x02}q\x00X\x04\x00\x00\x00hookq\x01cos\nsystem\nq\x02s.")
    res = scan_file(p)
    assert _global(res, "os.system").status == DANGEROUS and res.verdict == "dangerous"


@pytest.mark.torchfree
def test_a_function_on_no_list_held_as_a_value_needs_trust(tmp_path: Path) -> None:
    """A function of another package as a value: loading imports the package, calls nothing: needs trust; called
    (REDUCE), the same function is dangerous."""
    value = b"\x80\x02}q\x00X\x02\x00\x00\x00fnq\x01cmypkg.utils\nrun\nq\x02s."
    called = b"\x80\x02}q\x00X\x02\x00\x00\x00fnq\x01cmypkg.utils\nrun\nq\x02)Rq\x03s."
    (tmp_path / "v.pkl").write_bytes(value)
    (tmp_path / "c.pkl").write_bytes(called)
    assert _global(scan_file(tmp_path / "v.pkl"), "mypkg.utils.run").status == UNKNOWN
    assert _global(scan_file(tmp_path / "c.pkl"), "mypkg.utils.run").status == DANGEROUS


@pytest.mark.torchfree
@pytest.mark.parametrize("pid", [b"(X\x0e\x00\x00\x00reduce_packageq\x00cmypkg.utils\nrun\nq\x01)tq\x02Q",
                                 b"(X\x03\x00\x00\x00anyq\x00]q\x01cmypkg.utils\nrun\nq\x02atq\x03Q"])
def test_a_function_in_a_persistent_id_is_called(tmp_path: Path, pid: bytes) -> None:
    """A global inside a persistent id is handed to the loader's ``persistent_load``, which may call it: torch.package's
    calls ``('reduce_package', func, args)`` as ``func(importer, *args)``. It is never "held only as a value"."""
    (tmp_path / "p.pkl").write_bytes(b"\x80\x02}q\x10X\x01\x00\x00\x00h" + pid + b"s.")
    assert _global(scan_file(tmp_path / "p.pkl"), "mypkg.utils.run").status == DANGEROUS


@pytest.mark.torchfree
def test_a_pickle_cut_short_keeps_its_globals_called(tmp_path: Path) -> None:
    """A pickle that fails before its STOP may call a global after the cut: nothing counts as a value there."""
    data = pickle.dumps({"hyper_parameters": _hparams()}, protocol=2)
    _root, up, _end = load_pickle_at(data, 0, exact=True)
    assert "typing.Any" in up.uncalled_globals()
    p = tmp_path / "cut.pkl"
    p.write_bytes(data[:-1])  # no STOP
    assert _global(scan_file(p), "typing.Any").status == DANGEROUS


@pytest.mark.torchfree
@pytest.mark.parametrize("text", [
    'chat_template: "{% for message in messages %}{{ message.content }}{% endfor %}"\nbos_token: <s>\n',
    "checkpoint_dir: /models/run1\nsave_every: 100\n",
])
def test_a_yaml_file_is_not_a_pickle(tmp_path: Path, run_cli: Any, text: str) -> None:
    """A YAML file starting with ``c`` reads as a GLOBAL opcode whose "module" is no Python name, in a stream with
    no STOP: not a pickle (unreadable, exit 2), no global listed, never dangerous."""
    p = tmp_path / "config.yaml"
    p.write_text(text)
    res = scan_file(p)
    assert res.verdict == "error" and res.exit_code == 2 and res.globals == [], res.report()
    r = run_cli("scan", p)
    assert r.exit_code == 2 and "DANGEROUS" not in r.output


@pytest.mark.torchfree
def test_a_cut_text_pickle_with_a_real_global_stays_dangerous(tmp_path: Path) -> None:
    """Injected fault for the rule above: a protocol-0 pickle (text too) cut before its STOP calls os.system
    before the end: dangerous."""
    p = tmp_path / "p0.pkl"
    p.write_bytes(b"cos\nsystem\n(S'id'\ntR")
    res = scan_file(p)
    assert res.verdict == "dangerous" and _global(res, "os.system").status == DANGEROUS


@pytest.mark.torchfree
def test_a_global_that_is_no_python_name_is_an_error_not_a_danger(tmp_path: Path) -> None:
    """A complete pickle naming ``"os ".system`` (no module has that name): needs trust at most, the pickle
    unreadable (a loader fails there), the file's verdict error."""
    p = tmp_path / "bad.pkl"
    p.write_bytes(b"\x80\x02cos \nsystem\nq\x00)Rq\x01.")
    res = scan_file(p)
    g = _global(res, "os .system")
    assert g.status == NEEDS_TRUST and "not a Python name" in g.reason
    assert res.verdict == "error" and res.exit_code == 2


@pytest.mark.torchfree
@pytest.mark.parametrize(("name", "ok"), [
    ("typing.Any", True), ("torch._utils._rebuild_tensor_v2", True), ("__builtin__.set", True),
    ("collections.Counter !class-build", True), ("hat_template: x.bos: 1", False), ("os .system", False),
    ("os.sys tem", False), (".x", False), ("a..b", False), ("", False),
])
def test_is_importable_name(name: str, ok: bool) -> None:
    assert is_importable_name(name) is ok


@pytest.mark.torchfree
def test_rate_global_value_rules() -> None:
    """rate_global: only the general rules are lifted for a value; listed gadgets and uses stay dangerous."""
    assert rate_global("typing.Any", called=False)[0] == NEEDS_TRUST
    assert rate_global("typing.Any", called=True)[0] == DANGEROUS
    assert rate_global("builtins.exec", called=False)[0] == DANGEROUS
    assert rate_global("subprocess.Popen", called=False)[0] == DANGEROUS
    assert rate_global("torch.utils.cpp_extension.subprocess.Popen", called=False)[0] == DANGEROUS
    assert rate_global("collections.Counter !class-build", called=False)[0] == DANGEROUS
    assert rate_global("hat_template: x.bos", called=True)[0] == NEEDS_TRUST


@pytest.mark.torchfree
def test_real_checkpoints_are_never_dangerous(real_dir: Path) -> None:
    """Every real checkpoint of fixtures/real: none is called dangerous (none can make a loader run code)."""
    files = sorted(p for p in real_dir.iterdir() if p.suffix != ".md")
    assert files
    for p in files:
        res = scan_file(p)
        assert res.verdict != "dangerous", (p.name, [(g.name, g.status) for g in res.globals])


def test_generated_checkpoints_are_never_dangerous(generated: dict[str, Path]) -> None:
    """Every generated fixture (make_fixtures: state_dicts, full models, optimizers, odd layouts; none hostile):
    none is called dangerous."""
    dangerous = {}
    for name, p in generated.items():
        res = scan_file(p)
        if res.verdict == "dangerous":
            dangerous[name] = [(g.name, g.reason) for g in res.globals if g.status == DANGEROUS]
    assert not dangerous, dangerous


@pytest.mark.torchfree
def test_inspect_agrees_with_scan_on_a_value(tmp_path: Path, run_cli: Any) -> None:
    """inspect rates typing.Any held as a value as scan does (needs trust), in its table and its JSON."""
    import json

    p = tmp_path / "hp.ckpt"
    p.write_bytes(pickle.dumps({"hyper_parameters": _hparams()}, protocol=2))
    r = run_cli("inspect", p, "--json")
    data = json.loads(r.output)
    security = data["security"]
    assert "typing.Any" in security["needs_trust"] and not security["dangerous"], security
    assert security["verdict"] == "needs-trust"
    assert "DANGEROUS" not in run_cli("inspect", p).output
