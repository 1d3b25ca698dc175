"""Rename rules run in time linear in the key, whatever the rule and the key (issue 36 item 4).

Rules are matched by RE2 (``google-re2``); the replacement is read by Python's ``re`` itself. Held here: the rule
that took Python's backtracking engine past 30 s on a key of 40 components finishes (a subprocess with a hang
guard, no timing assertion); a rule RE2 does not take is one ``Error:`` line naming the rule; ``re.sub``'s results
(groups, names, empty matches, escapes in the replacement) are unchanged, checked against ``re.sub`` itself; a key
over the cap is refused by rename and filter alike.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptool.errors import UsageError
from ckptool.model.keys import MAX_KEY_LENGTH
from ckptool.ops.surgery.rules import compile_rule, rules_plan

pytestmark = pytest.mark.torchfree

#: past the guard the rule has hung: Python's re took 30 s and more on this key (RE2: milliseconds)
HANG_GUARD_S = 20
PATHOLOGICAL = r"^(.*\.)*bias$"
LONG_KEY = ".".join(f"c{i}" for i in range(40)) + ".weight"


def _safetensors(path: Path, names: list[str]) -> Path:
    """A safetensors file of one uint8 element per name."""
    entries = {n: {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i, n in enumerate(names)}
    raw = json.dumps(entries).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(len(names)))
    return path


def test_backtracking_rule_on_a_long_key_finishes(tmp_path: Path) -> None:
    """The issue's rule on a key of 40 dotted components, through the CLI in a subprocess: it answers (the rule
    matches no key: exit 1, one line naming the rule) instead of hanging."""
    src = _safetensors(tmp_path / "long.safetensors", [LONG_KEY, "fc.weight"])
    r = subprocess.run([sys.executable, "-m", "ckptool", "rename", str(src), "--rule", f"{PATHOLOGICAL}=x",
                        "--dry-run"], check=False, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith("Error: ") and "rule 1 (^(.*\\.)*bias$=x) matches no key" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_backtracking_rule_still_renames_what_it_matches(tmp_path: Path) -> None:
    src = _safetensors(tmp_path / "long.safetensors", [LONG_KEY, LONG_KEY[:-len("weight")] + "bias"])
    r = subprocess.run([sys.executable, "-m", "ckptool", "rename", str(src), "--rule", f"{PATHOLOGICAL}=x",
                        "-o", str(tmp_path / "out.safetensors")], check=False, capture_output=True, text=True,
                       timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "matched 1 key" in r.stdout
    raw = (tmp_path / "out.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert sorted(header) == sorted([LONG_KEY, "x"])


@pytest.mark.parametrize("regex, what", [
    (r"^(\w+)\.\1$", "backreference"),
    (r"^(?=enc)\w+", "lookahead"),
    (r"(?<!ema\.)weight$", "lookbehind"),
    (r"a++", "possessive"),
    (r"(?>a)", "atomic group"),
    (r"bias\Z", r"\Z"),
])
def test_a_pattern_re2_does_not_take_is_an_error_naming_the_rule(tmp_path: Path, run_cli, regex: str,
                                                                  what: str) -> None:
    if sys.version_info < (3, 11) and what in ("possessive", "atomic group"):
        pytest.skip("Python's re takes possessive quantifiers and atomic groups from 3.11 on")
    re.compile(regex)  # Python's re takes it
    with pytest.raises(UsageError, match=re.escape(f"rule 1 ({regex}=x)")):
        rules_plan([(regex, "x")])
    src = _safetensors(tmp_path / "m.safetensors", ["enc.weight"])
    r = run_cli("rename", src, "--rule", "^enc=dec", "--rule", f"{regex}=x", "--dry-run")
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2, r.output
    assert lines[0].startswith("Error: rule 2 (") and regex in lines[0] and "RE2" in lines[0], r.output


@pytest.mark.parametrize("regex, repl, key", [
    (r"^lin(\d)\.model\.1\.", r"lin\1.", "lin0.model.1.weight"),
    (r"^(?P<a>\w+)\.(\d+)", r"\g<a>_\2|\g<0>|\g<2>", "layer.3.w"),
    (r"^features\.(\d+)\.", r"backbone.layer\1.", "features.12.weight"),
    ("x*", "-", "abxd"),
    ("", "-", "ab"),
    (r"(a)|(b)", r"[\1\2]", "abc"),
    ("a", r"\n\t\\\101é", "bab"),
    ("^", "module.", "x.y"),
    (r"(a)", r"\g<1>0", "a"),
    (r"(a)(b)(c)(d)(e)(f)(g)(h)(i)(j)", r"\10\1", "abcdefghij"),
    (r"^module\.", "", "module.fc.weight"),
    (r"\.", "/", "a.b.c"),
    (r"(?i)^ENC", "dec", "enc.x"),
    ("\u00e9+", "e", "caf\u00e9\u00e9.w"),
])
def test_results_are_re_sub_results(regex: str, repl: str, key: str) -> None:
    assert compile_rule(regex, repl, "rule 1").apply(key)[0] == re.sub(regex, repl, key)


@settings(max_examples=300, deadline=None)
@given(regex=st.sampled_from([r"\.", r"(\w+)\.", r"^(\w+)\.(\w+)", "a*", r"(?P<n>[a-c])", "", r"(x)?b", "$"]),
       repl=st.sampled_from(["", "-", r"\1", r"<\g<0>>", r"\g<n>", r"\2\1", r"\\", "="]),
       key=st.text(alphabet="abcx._1", max_size=12))
def test_generated_rules_match_re_sub(regex: str, repl: str, key: str) -> None:
    try:
        want: str | None = re.sub(regex, repl, key)
    except (re.error, IndexError):
        want = None
    try:
        got: str | None = compile_rule(regex, repl, "rule 1").apply(key)[0]
    except UsageError:
        got = None
    assert got == want


@pytest.mark.parametrize("repl, why", [(r"\2", "invalid group reference 2"), (r"\g<zz>", "unknown group name"),
                                       (r"\q", r"bad escape \\q")])
def test_a_bad_replacement_is_an_error_naming_the_rule(repl: str, why: str) -> None:
    with pytest.raises(UsageError, match=rf"rule 1 \(\(a\)={re.escape(repl)}\): {why}"):
        rules_plan([("(a)", repl)])


@pytest.mark.parametrize("command", [
    ["rename", "--rule", "^a=b", "-o", "{out}.safetensors"], ["filter", "--drop", "a*", "-o", "{out}.safetensors"],
    ["inspect"], ["convert", "-o", "{out}.pt"], ["diff", "{src}"], ["average", "{src}", "-o", "{out}.pt"],
    ["report", "-o", "{out}.html"],
], ids=lambda c: c[0])
def test_a_key_over_the_cap_is_refused(tmp_path: Path, run_cli, command: list[str]) -> None:
    long_key = "a" * (MAX_KEY_LENGTH + 1)
    src = _safetensors(tmp_path / "k.safetensors", [long_key, "fc.weight"])
    args = [a.format(out=tmp_path / "out", src=src) for a in command]
    r = run_cli(args[0], src, *args[1:])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert lines[0].startswith("Error: ") and f"cap of {MAX_KEY_LENGTH:,} characters" in lines[0]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["k.safetensors"]


def test_a_key_at_the_cap_is_renamed(tmp_path: Path) -> None:
    import ckptool

    key = "a" * MAX_KEY_LENGTH
    src = _safetensors(tmp_path / "k.safetensors", [key, "fc.weight"])
    ckptool.rename(src, tmp_path / "out.safetensors", rules=[("^a+$", "b")])
    raw = (tmp_path / "out.safetensors").read_bytes()
    assert sorted(json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])) == ["b", "fc.weight"]

