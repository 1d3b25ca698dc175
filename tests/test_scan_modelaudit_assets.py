"""ModelAudit's own test assets that are PyTorch or pickle files, made here the way its generators make them
(promptfoo/modelaudit, ``tests/assets/generators/generate_security_assets.py``,
``generate_advanced_pickle_tests.py``, ``generate_nested_pickle_assets.py``, ``generate_safe_nested_assets.py``,
``generate_7z_test_assets.py``; MIT license; our code, written to the same recipe, not copied): every malicious
one is dangerous, every benign one is not (issue 49, item 5). Payloads are inert: nothing here is loaded.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptool import scan_file


def _reducer(fn: Any, *args: Any) -> Any:
    class Payload:
        def __reduce__(self) -> Any:
            return (fn, args)

    return Payload()


def _pytorch_zip(obj: Any) -> bytes:
    """generate_security_assets.py's ``write_pytorch_zip``: a zip with ``version`` and ``data.pkl``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("version", "3")
        z.writestr("data.pkl", pickle.dumps(obj))
    return buf.getvalue()


def _multiple_streams() -> bytes:
    buf = io.BytesIO()
    pickle.dump({"model": "safe_weights"}, buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickle.dump(_reducer(eval, "'HIDDEN_ATTACK_PAYLOAD'"), buf, protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def _path_traversal_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("../../../etc/evil.txt", "malicious content")
        z.writestr("model/malicious.pkl", pickle.dumps(_reducer(os.system, "echo archive payload")))
    return buf.getvalue()


def _safe_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("model/weights.txt", "safe model weights")
        z.writestr("README.txt", "This is a safe model archive")
    return buf.getvalue()


def _seven_zip(name: str, data: bytes) -> bytes:
    import py7zr  # the test extra

    buf = io.BytesIO()
    with py7zr.SevenZipFile(buf, "w") as z:
        z.writestr(data, name)
    return buf.getvalue()


MALICIOUS: dict[str, Callable[[], bytes]] = {
    "malicious_system_call.pkl": lambda: pickle.dumps(_reducer(os.system, "echo security test")),
    "stack_global_attack.pkl": lambda: pickle.dumps(_reducer(os.system, "# STACK_GLOBAL_PAYLOAD"),
                                                     protocol=pickle.HIGHEST_PROTOCOL),
    "memo_attack.pkl": lambda: pickle.dumps(_reducer(subprocess.call, ["#", "MEMO_ATTACK_PAYLOAD"]),
                                             protocol=pickle.HIGHEST_PROTOCOL),
    "multiple_stream_attack.pkl": _multiple_streams,
    "malicious_eval.pt": lambda: _pytorch_zip(_reducer(eval, "print('security test - eval')")),
    "mixed_malicious_model.pkl": lambda: pickle.dumps(_reducer(eval, "__import__('os').system('true')")),
    "path_traversal.zip": _path_traversal_zip,
    "nested_print_payload.pkl": lambda: pickle.dumps({"outer": _reducer(print, "MALICIOUS: nested")}),
    "malicious_in_7z.7z": lambda: _seven_zip("model.pkl", pickle.dumps(_reducer(os.system, "echo 7z"))),
    "protocol0_system.pkl": lambda: pickle.dumps(_reducer(os.system, "echo p0"), protocol=0),
}

BENIGN: dict[str, Callable[[], bytes]] = {
    "safe_data.pkl": lambda: pickle.dumps({"safe": True, "data": [1, 2, 3]}),
    "safe_model.pt": lambda: _pytorch_zip({"weights": {"layer1": [1.0, 2.0, 3.0]}}),
    "safe_model.zip": _safe_zip,
    "safe_nested.pkl": lambda: pickle.dumps({"inner": pickle.dumps({"weights": [0.1, 0.2]}), "n": 2}),
    "safe_in_7z.7z": lambda: _seven_zip("model.pkl", pickle.dumps({"weights": [1, 2]})),
}


@pytest.mark.torchfree
@pytest.mark.parametrize("name", sorted(MALICIOUS))
def test_modelaudit_malicious_assets_are_dangerous(tmp_path: Path, name: str) -> None:
    p = tmp_path / name
    p.write_bytes(MALICIOUS[name]())
    res = scan_file(p)
    assert res.verdict == "dangerous" and res.exit_code == 1, res.report()


@pytest.mark.torchfree
@pytest.mark.parametrize("name", sorted(BENIGN))
def test_modelaudit_benign_assets_are_not_dangerous(tmp_path: Path, name: str) -> None:
    p = tmp_path / name
    p.write_bytes(BENIGN[name]())
    res = scan_file(p)
    assert res.verdict != "dangerous", res.report()
    assert not any(g.level == "dangerous" for g in res.globals)


@pytest.mark.torchfree
def test_path_traversal_zip_is_noted(tmp_path: Path) -> None:
    p = tmp_path / "path_traversal.zip"
    p.write_bytes(_path_traversal_zip())
    assert any("'../../../etc/evil.txt'" in n for n in scan_file(p).notes)
