"""Key renaming rules: ``REGEX=REPLACEMENT`` pairs as steps of a :class:`~ckptool.model.rename_plan.RenamePlan`, and
the rules files of ``ckptool rename --rules`` (JSON, YAML, TOML). Used by :mod:`ckptool.ops.surgery.edit`.

A rule is ``re.sub(REGEX, REPLACEMENT, key)`` on the whole fully qualified name (Python ``re`` syntax, ``\\1`` /
``\\g<name>`` groups), as mmengine's ``load_checkpoint(revise_keys=[(r'^module\\.', '')])`` applies them.
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

from ckptool.errors import CkptError, UsageError
from ckptool.model.rename_plan import RenamePlan, Step

__all__ = ["RuleLike", "RuleStep", "load_rules", "parse_rule", "rules_plan"]

#: a rule as given: ``"REGEX=REPLACEMENT"`` or a pair ``(REGEX, REPLACEMENT)``
RuleLike = str | Sequence[str]


@dataclass(frozen=True)
class RuleStep(Step):
    """One rule as a :class:`~ckptool.model.rename_plan.Step` (``kind="rule"``): ``pattern.sub(replacement, key)``.

    ``prefixes`` holds the rule's label (``"rule 1"``); :meth:`apply` reports it as removed when the pattern
    matched, which is how :func:`ckptool.model.rename_plan.plan_keys` counts the keys each rule matched."""

    pattern: re.Pattern[str] | None = None
    replacement: str = ""

    def apply(self, key: str) -> tuple[str, list[str], list[str]]:
        assert self.pattern is not None
        new, n = self.pattern.subn(self.replacement, key)
        return new, ([self.prefixes[0]] if n else []), []

    @property
    def text(self) -> str:
        """The rule as ``REGEX=REPLACEMENT``."""
        assert self.pattern is not None
        return f"{self.pattern.pattern}={self.replacement}"


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


def _read_rules_document(path: str) -> Any:
    ext = os.path.splitext(path)[1].lower()
    with open(path, "rb") as f:
        data = f.read()
    if ext == ".json":
        return json.loads(data)
    if ext in (".yaml", ".yml"):  # optional: only a YAML rules file needs PyYAML
        return importlib.import_module("yaml").safe_load(data)
    if ext == ".toml":  # the standard library's from Python 3.11; tomli (its origin) before
        toml = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
        return toml.loads(data.decode("utf-8"))
    raise UsageError(f"rules file {path}: name it .json, .yaml / .yml or .toml")


def load_rules(path: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """The rules of a JSON, YAML or TOML file: a list of ``[REGEX, REPLACEMENT]`` pairs, or a table whose ``rules``
    entry is one (TOML has no top-level list: ``rules = [['^module\\.', ''], ...]``).

    Raises:
        UsageError: the file is missing, does not parse, or holds something else than such pairs.
    """
    p = os.fspath(path)
    try:
        doc = _read_rules_document(p)
    except CkptError:  # the UsageError of an unknown extension is a ValueError too: not a parse failure
        raise
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


def rules_plan(rules: Iterable[RuleLike]) -> RenamePlan:
    """A :class:`~ckptool.model.rename_plan.RenamePlan` of one :class:`RuleStep` per rule, in order.

    Raises:
        UsageError: no rule, a regex that does not compile, a replacement naming a group the regex lacks.
    """
    steps: list[Step] = []
    for i, rule in enumerate(rules, 1):
        regex, repl = parse_rule(rule) if isinstance(rule, str) else tuple(rule)
        try:
            pattern = re.compile(regex)
            pattern.sub(repl, "")  # parses the replacement: a bad group reference fails here
        except re.error as e:
            raise UsageError(f"rule {i} ({regex}={repl}): {e}") from None
        steps.append(RuleStep("rule", (f"rule {i}",), pattern, repl))
    if not steps:
        raise UsageError("no rule given: pass --rule REGEX=REPLACEMENT or --rules FILE (rules=[...])")
    return RenamePlan(tuple(steps))
