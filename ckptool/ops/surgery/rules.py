"""Key renaming rules: ``REGEX=REPLACEMENT`` pairs as steps of a :class:`~ckptool.model.rename_plan.RenamePlan`, and
the rules files of ``ckptool rename --rules`` (JSON, YAML, TOML). Used by :mod:`ckptool.ops.surgery.edit`.

A rule is ``re.sub(REGEX, REPLACEMENT, key)`` on the whole fully qualified name (``\\1`` / ``\\g<name>`` groups), as
mmengine's ``load_checkpoint(revise_keys=[(r'^module\\.', '')])`` applies them, with one difference: the REGEX is
matched by RE2 (``google-re2``), in time linear in the key whatever the rule and the key, because key names come
from the file and Python's backtracking ``re`` can take exponential time (``^(.*\\.)*bias$`` on a key of 40
components). RE2 takes Python's syntax less backreferences, lookarounds, possessive and atomic groups and ``\\Z``
(write ``\\z`` or ``$``); its ``\\w``, ``\\d``, ``\\s``, ``\\b`` are ASCII (as Python's ``re.ASCII``) and ``$`` is the
end of the key only. The REPLACEMENT is read by Python's ``re`` itself (:func:`replacement_template`).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import re2  # google-re2: linear-time matching (see the module docstring)

from ckptool import _source as source
from ckptool.errors import CkptError, NotACheckpointError, UsageError
from ckptool.model.rename_plan import RenamePlan, Step

__all__ = ["RuleLike", "RuleStep", "compile_rule", "load_rules", "parse_rule", "replacement_template",
           "rules_plan"]

#: a replacement as pieces: literal text, and the numbers of the groups whose text goes in between
Template = tuple[str | int, ...]

#: a rule as given: ``"REGEX=REPLACEMENT"`` or a pair ``(REGEX, REPLACEMENT)``
RuleLike = str | Sequence[str]


@dataclass(frozen=True)
class RuleStep(Step):
    """One rule as a :class:`~ckptool.model.rename_plan.Step` (``kind="rule"``): ``re.sub(regex, replacement, key)``
    with ``pattern`` the regex compiled by RE2 and ``template`` the replacement read by Python's ``re``
    (:func:`compile_rule`).

    ``prefixes`` holds the rule's label (``"rule 1"``); :meth:`apply` reports it as removed when the pattern
    matched, which is how :func:`ckptool.model.rename_plan.plan_keys` counts the keys each rule matched."""

    regex: str = ""
    replacement: str = ""
    pattern: Any = None
    template: Template = ()

    def apply(self, key: str) -> tuple[str, list[str], list[str]]:
        """``re.sub``'s result on ``key`` (every non-overlapping match replaced, empty matches too, as
        ``re.sub`` does since Python 3.7), in time linear in ``len(key)`` (RE2). One difference: after an empty
        match ``re.sub`` also tries a longer match at the same place (``a??`` on ``aa``), RE2 moves on."""
        pieces: list[str] = []
        end = 0
        last = (-1, -1)
        for m in self.pattern.finditer(key):
            if m.span() == last and m.start() == m.end():
                continue  # google-re2's finditer gives an empty match at the end of the key twice
            last = m.span()
            pieces.append(key[end:m.start()])
            pieces.extend(p if isinstance(p, str) else (m.group(p) or "") for p in self.template)
            end = m.end()
        if not pieces:
            return key, [], []
        pieces.append(key[end:])
        return "".join(pieces), [self.prefixes[0]], []

    @property
    def text(self) -> str:
        """The rule as ``REGEX=REPLACEMENT``."""
        return f"{self.regex}={self.replacement}"


def parse_rule(text: str) -> tuple[str, str]:
    """``"REGEX=REPLACEMENT"`` as a pair, split at the last ``=`` (a regex may hold ``=`` in ``(?=...)``; a
    replacement holding ``=`` goes in a rules file instead).

    Raises:
        UsageError: no ``=``.
    """
    regex, sep, repl = text.rpartition("=")
    if not sep:
        raise UsageError(f"rule {text!r}: give REGEX=REPLACEMENT, e.g. '^module\\.=' or '^backbone\\.=encoder.'")
    return regex, repl


#: the largest rules file read, in bytes (4 MiB: a rules file is a few lines; a larger one is a mistake, and a
#: device such as /dev/zero never ends)
MAX_RULES_BYTES = 4 << 20
_RULES_EXTENSIONS = (".json", ".yaml", ".yml", ".toml")


def _read_rules_document(path: str) -> Any:
    """The parsed document of the rules file ``path``: its extension checked first, then the file opened only if
    it is a regular file (:func:`ckptool._source.open_regular`: a FIFO or device is refused without blocking) and
    read up to :data:`MAX_RULES_BYTES`.

    Raises:
        UsageError: another extension, a file over the size cap.
        NotACheckpointError: a FIFO, device or socket.
        OSError / ValueError / RecursionError / yaml.YAMLError: as reading and parsing raise them.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext not in _RULES_EXTENSIONS:
        raise UsageError(f"rules file {path}: name it .json, .yaml / .yml or .toml")
    with source.open_regular(path, "the rules file") as f:
        data = f.read(MAX_RULES_BYTES + 1)
    if len(data) > MAX_RULES_BYTES:
        raise UsageError(f"rules file {path} is larger than {MAX_RULES_BYTES >> 20} MiB, the most ckptool reads; "
                         "a rules file lists [REGEX, REPLACEMENT] pairs")
    if ext == ".json":
        return json.loads(data)
    if ext in (".yaml", ".yml"):  # optional: only a YAML rules file needs PyYAML
        return importlib.import_module("yaml").safe_load(data)
    # TOML: the standard library's from Python 3.11; tomli (its origin) before
    toml = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
    return toml.loads(data.decode("utf-8"))


def load_rules(path: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """The rules of a JSON, YAML or TOML file: a list of ``[REGEX, REPLACEMENT]`` pairs, or a table whose ``rules``
    entry is one (TOML has no top-level list: ``rules = [['^module\\.', ''], ...]``).

    Raises:
        UsageError: the file is missing, is a FIFO, a device or a socket (refused without opening it for
            reading), does not parse, is nested deeper than the parser can go, is larger than
            :data:`MAX_RULES_BYTES` or has another extension (checked before it is read), or holds something else
            than such pairs.
    """
    p = os.fspath(path)
    try:
        doc = _read_rules_document(p)
    except NotACheckpointError as e:  # a FIFO or device: a bad argument, as a missing rules file is
        raise UsageError(str(e)) from None
    except CkptError:  # the UsageError of an unknown extension is a ValueError too: not a parse failure
        raise
    except RecursionError:
        raise UsageError(f"rules file {p} is nested deeper than its parser can read; a rules file is a list of "
                         "[REGEX, REPLACEMENT] pairs") from None
    except OSError as e:
        raise UsageError(f"rules file {p}: {e.strerror or e}") from None
    except ValueError as e:  # json, tomllib and tomli errors are ValueErrors
        raise UsageError(f"rules file {p} does not parse: {e}") from None
    except Exception as e:  # yaml.YAMLError
        if type(e).__module__.startswith("yaml"):
            raise UsageError(f"rules file {p} does not parse: {e}") from None
        raise
    if isinstance(doc, dict) and set(doc) == {"rules"}:
        doc = doc["rules"]
    ok = isinstance(doc, list) and all(isinstance(r, list) and len(r) == 2 and all(isinstance(s, str) for s in r)
                                       for r in doc)
    if not ok:
        raise UsageError(f"rules file {p}: expected a list of [REGEX, REPLACEMENT] pairs of strings (or, in TOML, "
                         "rules = [[REGEX, REPLACEMENT], ...])")
    return [(r[0], r[1]) for r in doc]


#: RE2's options: a pattern it refuses raises, and is not also logged on stderr
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False
#: what RE2 does not take of Python's syntax, said with its refusals
_RE2_HINT = ("rules are matched by RE2 in time linear in the key, which has no backreferences (\\1 in the REGEX), "
             "lookarounds ((?=...), (?!...), (?<=...), (?<!...)), possessive or atomic groups, or \\Z (write \\z or $)")


def replacement_template(repl: str, groups: int, names: dict[str, int]) -> Template:
    """``repl`` read as Python's ``re.sub`` reads a replacement (``\\1``, ``\\g<name>``, ``\\g<0>``, ``\\n``...): its
    literal text and group numbers in order, for a pattern of ``groups`` groups named ``names`` (name -> number).

    Python's ``re`` does the reading: a stand-in pattern with the same groups, each capturing one marker
    character (U+0100 and up, none of them in ``repl``; a replacement's escapes make only characters below
    U+0100), expands ``repl`` once, and the markers in the result are the group references.

    Raises:
        re.error: a bad escape, a reference to a group the pattern lacks.
        IndexError: an unknown group name.
    """
    marks = [c for c in map(chr, range(0x100, 0x100 + groups + len(repl) + 2)) if c not in repl][:groups + 2]
    by_number = {i: n for n, i in names.items()}
    stand_in = marks[0] + "".join(f"(?P<{by_number[i]}>{marks[i]})" if i in by_number else f"({marks[i]})"
                                  for i in range(1, groups + 1)) + marks[-1]
    expanded = re.compile(stand_in).sub(repl, "".join(marks))
    pieces: list[str | int] = []
    index = {c: i for i, c in enumerate(marks[:-1])}
    i = 0
    while i < len(expanded):
        c = expanded[i]
        if c in index:
            pieces.append(index[c])
            i += groups + 2 if index[c] == 0 else 1  # \g<0>: every marker, the first to the last
        else:
            j = i
            while j < len(expanded) and expanded[j] not in index:
                j += 1
            pieces.append(expanded[i:j])
            i = j
    return tuple(pieces)


def compile_rule(regex: str, repl: str, label: str) -> RuleStep:
    """The :class:`RuleStep` of ``regex`` and ``repl``; ``label`` names it in its errors and results.

    Raises:
        UsageError: a regex RE2 does not take (the message names the rule and what RE2 lacks) or a replacement
            Python's ``re`` does not take (a bad escape, a group the regex lacks).
    """
    try:
        pattern = re2.compile(regex, _RE2_OPTIONS)
    except re2.error as e:
        why = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        hint = f"; {_RE2_HINT}" if any(w in why for w in ("operator", "escape", "capture")) else ""
        raise UsageError(f"{label} ({regex}={repl}): {why}{hint}") from None
    try:
        template = replacement_template(repl, pattern.groups, dict(pattern.groupindex))
    except (re.error, IndexError) as e:
        raise UsageError(f"{label} ({regex}={repl}): {e}") from None
    return RuleStep("rule", (label,), regex, repl, pattern, template)


def rules_plan(rules: Iterable[RuleLike]) -> RenamePlan:
    """A :class:`~ckptool.model.rename_plan.RenamePlan` of one :class:`RuleStep` per rule, in order.

    Raises:
        UsageError: no rule, a regex that does not compile (or that RE2 does not take), a replacement naming a
            group the regex lacks.
    """
    steps: list[Step] = []
    for i, rule in enumerate(rules, 1):
        regex, repl = parse_rule(rule) if isinstance(rule, str) else tuple(rule)
        steps.append(compile_rule(regex, repl, f"rule {i}"))
    if not steps:
        raise UsageError("no rule given: pass --rule REGEX=REPLACEMENT or --rules FILE (rules=[...])")
    return RenamePlan(tuple(steps))
