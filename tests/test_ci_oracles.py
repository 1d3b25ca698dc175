"""The CI's oracles and skip policy (issue 51): .ci/oracles.txt pins every oracle, tools/oracles.sh points the tests
at them, and tools/check_skips.py fails a run whose tests skipped for a reason .ci/allowed-skips.txt does not allow."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import check_skips


def _pins() -> dict[str, list[Requirement]]:
    out: dict[str, list[Requirement]] = {}
    for line in (REPO / ".ci" / "oracles.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, *reqs = line.split()
            out[name] = [Requirement(r) for r in reqs]
    return out


def test_every_oracle_is_pinned_once() -> None:
    pins = _pins()
    assert {"main", "mergekit", "megatron"} <= set(pins)
    names = {r.name for reqs in pins.values() for r in reqs}
    assert {"peft", "deepspeed", "mergekit", "megatron-core"} <= names
    every = [r for reqs in pins.values() for r in reqs]
    assert len(every) == len({r.name for r in every}), "an oracle pinned twice"
    for r in every:
        assert len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==", f"{r} is not pinned with =="


def test_the_pinned_peft_is_what_the_corpus_extra_allows() -> None:
    """The README's test command installs peft through the `corpus` extra: the version CI pins must satisfy it."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    corpus = re.search(r"^corpus = \[(.*?)\]", text, re.M | re.S)
    assert corpus
    extra = {r.name: r for r in (Requirement(s) for s in re.findall(r'"([^"]+)"', corpus.group(1)))}
    for pin in _pins()["main"]:
        if pin.name in extra:
            version = next(iter(pin.specifier)).version
            assert extra[pin.name].specifier.contains(version), (pin, extra[pin.name])


def test_the_oracle_variables_are_the_ones_the_tests_read() -> None:
    script = (REPO / "tools" / "oracles.sh").read_text(encoding="utf-8")
    files = re.search(r"ORACLE_TESTS=\((.*?)\)", script, re.S)
    assert files
    listed = set(files.group(1).split())
    for var in ("CKPTOOL_MERGEKIT", "CKPTOOL_MEGATRON_PYTHON"):
        assert f"export {var}=" in script
        readers = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")
                   if p.name != Path(__file__).name and var in p.read_text(encoding="utf-8")}
        assert readers and readers <= listed, (var, readers - listed)
    assert all((REPO / f).is_file() for f in listed)


def test_every_allowed_reason_says_why() -> None:
    allowed = check_skips.read_allowed(check_skips.DEFAULT_ALLOWED)
    assert allowed and all(a.why for a in allowed)
    # a missing oracle is never allowed
    for message in ("could not import 'peft': No module named 'peft'",
                    "mergekit-yaml not found (set CKPTOOL_MERGEKIT to its path)",
                    "deepspeed is not importable here (ModuleNotFoundError); the committed fixtures are used",
                    "could not import 'megatron.core': No module named 'megatron'"):
        assert not any(a.pattern.search(message) for a in allowed), message


def test_a_pattern_without_a_reason_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "allowed.txt"
    f.write_text("# why\nneeds a CUDA device\n\nno chromium\n")
    with pytest.raises(ValueError, match="no comment"):
        check_skips.read_allowed(f)
    f.write_text("# why\n[someday] x\n")
    with pytest.raises(ValueError, match="unknown condition"):
        check_skips.read_allowed(f)


def test_the_apt_condition(tmp_path: Path) -> None:
    f = tmp_path / "allowed.txt"
    f.write_text("# apt installs it\n[no-apt] no headless chromium\n")
    allowed = check_skips.read_allowed(f)
    skips = [("t::page", "no headless chromium installed")]
    assert check_skips.check(skips, allowed, apt=False)[1] == []
    assert check_skips.check(skips, allowed, apt=True)[1] == ["t::page: no headless chromium installed"]


SAMPLE = '''
import pytest
peft = pytest.importorskip("peft_that_is_not_installed")
'''
SAMPLE_OK = '''
import pytest

def test_gpu():
    pytest.skip("needs a CUDA device")

def test_runs():
    pass
'''


def _junit(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                    "--rootdir", str(tmp_path), *files], cwd=tmp_path, capture_output=True, check=False)
    return xml


def test_a_skip_for_an_allowed_reason_passes(tmp_path: Path) -> None:
    xml = _junit(tmp_path, {"test_ok.py": SAMPLE_OK})
    r = subprocess.run([sys.executable, str(REPO / "tools" / "check_skips.py"), str(xml)], capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SKIP test_ok::test_gpu: needs a CUDA device  -- allowed" in r.stdout
    assert "1 skipped: 1 for allowed reasons, 0 not allowed" in r.stdout


def test_a_missing_oracle_fails_the_check(tmp_path: Path) -> None:
    """A module skipped at collection (an importorskip at its top) is one skip, and its reason is not allowed."""
    xml = _junit(tmp_path, {"test_ok.py": SAMPLE_OK, "test_oracle.py": SAMPLE})
    r = subprocess.run([sys.executable, str(REPO / "tools" / "check_skips.py"), str(xml)], capture_output=True,
                       text=True, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "peft_that_is_not_installed" in r.stderr and "NOT ALLOWED" in r.stdout
    assert "2 skipped: 1 for allowed reasons, 1 not allowed" in r.stdout


def test_an_unreadable_report_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text("<testsuites")
    r = subprocess.run([sys.executable, str(REPO / "tools" / "check_skips.py"), str(tmp_path / "junit.xml")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "check_skips:" in r.stderr
