"""``ckptool scan`` reports the code a model folder's configs make a loader run (issue 49, item 2): a Hugging Face
``config.json`` whose ``auto_map`` (written by transformers' own ``register_for_auto_class`` + ``save_pretrained``)
names modules ``transformers`` imports under ``trust_remote_code=True``, and a NeMo 2 folder's ``context/model.yaml``
whose Hydra ``_target_`` entries NeMo instantiates. Modules are parsed with ``ast``, never imported by the scan.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptool import scan_file
from ckptool.model.allowlist import DANGEROUS, NEEDS_TRUST
from ckptool.scanning.entry import iter_paths
from ckptool.scanning.remote_code import dangerous_calls, parse_module

CONFIG_MODULE = '''\
from transformers import PretrainedConfig

from .helpers_{tag} import helper


class {tag}Config(PretrainedConfig):
    model_type = "ckptool-{tag}"
'''


def _hf_folder(tmp_path: Path, tag: str, helper: str) -> Path:
    """A model folder as transformers writes it for custom code: a config class registered for AutoConfig, saved
    with ``save_pretrained`` (which writes ``auto_map`` and copies the module and its relative imports)."""
    src = tmp_path / f"src_{tag}"
    pkg = src / f"pkg_{tag}"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / f"configuration_{tag}.py").write_text(CONFIG_MODULE.format(tag=tag))
    (pkg / f"helpers_{tag}.py").write_text(helper)
    sys.path.insert(0, str(src))
    try:
        mod = importlib.import_module(f"pkg_{tag}.configuration_{tag}")
        cls = getattr(mod, f"{tag}Config")
        cls.register_for_auto_class()
        out = tmp_path / f"model_{tag}"
        cls().save_pretrained(out)
    finally:
        sys.path.remove(str(src))
    return out


BENIGN_HELPER = "import math\n\n\ndef helper():\n    return math.pi\n"
EVIL_HELPER = "import subprocess as sp\n\n\ndef helper():\n    return sp.check_output(['id'])\n"


def _code(res: Any, name: str) -> Any:
    found = [c for c in res.code if c.member.endswith(name)]
    assert len(found) == 1, [(c.member, c.level) for c in res.code]
    return found[0]


@pytest.mark.parametrize(("helper", "level"), [(BENIGN_HELPER, NEEDS_TRUST), (EVIL_HELPER, DANGEROUS)],
                         ids=["benign", "subprocess"])
def test_auto_map_modules_listed_with_sha256(tmp_path: Path, run_cli: Any, helper: str, level: str) -> None:
    """transformers' own auto_map: the module it names and the module that one imports relatively are listed with
    their sha256; the folder needs trust, or is dangerous when a module calls subprocess."""
    tag = "Benign" if level == NEEDS_TRUST else "Evil"
    folder = _hf_folder(tmp_path, tag, helper)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": f"configuration_{tag}.{tag}Config"}
    assert str(folder / "config.json") in list(iter_paths([folder]))
    res = scan_file(folder / "config.json")
    main = _code(res, f"configuration_{tag}.py")
    assert main.level == NEEDS_TRUST and "trust_remote_code" in main.reason
    assert main.detail == "sha256 " + hashlib.sha256((folder / f"configuration_{tag}.py").read_bytes()).hexdigest()
    helper_code = _code(res, f"helpers_{tag}.py")
    assert helper_code.level == level
    assert res.verdict == level
    r = run_cli("scan", folder)
    assert r.exit_code == (1 if level == DANGEROUS else 4), r.output


@pytest.mark.torchfree
def test_auto_map_in_another_repository_and_missing_module(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {
        "AutoModel": "modeling_gone.M", "AutoTokenizer": ["org/repo--tokenization_x.Tok", None]}}))
    res = scan_file(tmp_path / "config.json")
    remote = _code(res, "auto_map.AutoTokenizer")
    assert remote.level == NEEDS_TRUST and "org/repo" in remote.reason
    assert any("modeling_gone.py" in n for n in res.notes)
    assert res.verdict == "needs-trust"


@pytest.mark.torchfree
def test_a_config_without_auto_map_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "modeling_x.py").write_text("import os\nos.system('id')\n")  # no loader runs it
    with pytest.raises(Exception, match="holds no checkpoint file"):
        list(iter_paths([tmp_path]))


@pytest.mark.torchfree
@pytest.mark.parametrize(("source", "expected"), [
    ("import os\nos.system('id')\n", ["os.system (line 2): runs a shell command"]),
    ("from os import system as s\ns('id')\n", ["os.system (line 2): runs a shell command"]),
    ("import subprocess\nsubprocess.run(['id'])\n", ["subprocess.run (line 2): runs processes"]),
    ("eval('1')\n", ["builtins.eval (line 1): evaluates Python code"]),
    ("import socket\nsocket.create_connection(('h', 1))\n", [("socket.create_connection (line 2): opens network "
                                                              "connections")]),
    ("import requests\nrequests.get('http://x')\n", ["requests.get (line 2): opens network connections"]),
    ("import torch\nx = torch.zeros(2)\nprint(x.sum())\n", []),
    ("import os\np = os.path.join('a', 'b')\n", []),
])
def test_dangerous_calls(source: str, expected: list[str]) -> None:
    assert dangerous_calls(parse_module(source.encode(), "m.py")) == expected


@pytest.mark.torchfree
@pytest.mark.parametrize(("target", "verdict"), [("builtins.exec", "dangerous"),
                                                 ("nemo.collections.llm.gpt.model.llama.LlamaModel", "needs-trust")])
def test_nemo2_context_model_yaml(tmp_path: Path, run_cli: Any, target: str, verdict: str) -> None:
    """A NeMo 2 checkpoint folder: ``context/model.yaml`` is read for its Hydra targets, found by the folder walk."""
    ctx = tmp_path / "ckpt" / "context"
    ctx.mkdir(parents=True)
    (ctx / "model.yaml").write_text(f"_target_: {target}\nconfig:\n  _target_: nemo.collections.llm.Llama2Config7B\n")
    (ctx / "notes.yaml").write_text("_target_: os.system\n")  # no loader instantiates this one
    paths = list(iter_paths([tmp_path / "ckpt"]))
    assert paths == [str(ctx / "model.yaml")]
    res = scan_file(ctx / "model.yaml")
    assert res.verdict == verdict and res.format == "config"
    assert any(g.name == target and g.where == ["model.yaml at _target_"] for g in res.globals)
