"""What loading a checkpoint into a model found, as dataclasses: :class:`LoadReport`, :class:`TrainingState`,
:class:`VerifyReport` and their parts, with the one-line summaries, the tables (tabulate) and the suggested fixes.

Nothing here imports torch; :func:`dtype_name` takes a ``torch.dtype`` but only formats it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ckptool.errors import StateDictMismatchError as StateDictMismatchError  # re-export: its home is ckptool.errors
from ckptool.model.keys import shared_prefixes, suggest_command

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "DtypeCast", "ForwardCheck", "LoadReport", "ShapeGroup", "ShapeMismatch", "StateDictMismatchError",
    "TrainingState", "VerifyReport", "dtype_name", "group_shape_mismatches", "load_suggestions",
]

_HEAD_NAMES = {"fc", "head", "heads", "classifier", "cls", "logits", "out", "output", "lm_head", "fc_out", "final",
               "last_linear", "pred", "predictor", "decoder_head"}
_TABLE_ROWS = 20


# ------------------------------------------------------------------------------------------------ report types
@dataclass
class ShapeMismatch:
    """One entry whose shape differs: ``key`` (the model's FQN), ``checkpoint_key`` (as in the file), shapes as
    lists of sizes."""

    key: str
    checkpoint_key: str
    checkpoint_shape: list[int]
    model_shape: list[int]


@dataclass
class ShapeGroup:
    """Shape mismatches of one module grouped into one finding (a classifier head built for another class count
    is one group: its ``weight`` and ``bias``). ``module`` is the module's FQN (``""`` for the root)."""

    module: str
    entries: list[ShapeMismatch]
    note: str

    @property
    def names(self) -> list[str]:
        return [e.key.rsplit(".", 1)[-1] for e in self.entries]


@dataclass
class DtypeCast:
    """Checkpoint tensors copied into model tensors of another dtype (``load_state_dict`` casts with
    ``Tensor.copy_``): the dtype pair, how many tensors, an example key, and ``lossy`` (True when a round trip
    back to the checkpoint's dtype does not give the same bits for at least one of them)."""

    checkpoint_dtype: str
    model_dtype: str
    count: int
    example: str
    lossy: bool


@dataclass
class LoadReport:
    """What :func:`load_into` did.

    ``path`` the checkpoint; ``model`` the model's class name; ``device`` where the model and the loaded tensors
    are (``"cuda:0"``); ``key`` the dotted path of the state_dict used inside the checkpoint (``""`` = the top
    level) and ``found`` every state_dict path found; ``prefixes_removed`` / ``prefixes_added`` the wrapper
    prefixes taken off or put on the checkpoint's keys (``["module."]``) and ``renamed`` how many keys changed;
    ``loaded`` the number of checkpoint entries copied into the model and ``model_entries`` the size of the
    model's state_dict; ``missing`` model keys with no value in the checkpoint; ``tied`` model keys absent from the
    checkpoint because they share storage with a loaded entry (tied weights: ``{"lm_head.weight":
    "embed.weight"}``, the loaded model key they share it with; not missing); ``unexpected`` checkpoint keys
    (as in the file) the model has no place for; ``mismatched`` entries skipped because their shapes differ;
    ``casts`` dtype conversions; ``saved_devices`` location tag -> tensor count as saved in the file (when
    known); ``suggestions`` one-line fixes.
    """

    path: str
    model: str
    device: str
    key: str
    strict: bool
    found: list[str] = field(default_factory=list)
    prefixes_removed: list[str] = field(default_factory=list)
    prefixes_added: list[str] = field(default_factory=list)
    renamed: int = 0
    loaded: int = 0
    model_entries: int = 0
    checkpoint_entries: int = 0
    missing: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[ShapeMismatch] = field(default_factory=list)
    casts: list[DtypeCast] = field(default_factory=list)
    saved_devices: dict[str, int] = field(default_factory=dict)
    suggestions: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every model entry got a value (its own, or a tied entry's) and every checkpoint entry was
        used (casts are allowed)."""
        return not (self.missing or self.unexpected or self.mismatched)

    @property
    def shape_groups(self) -> list[ShapeGroup]:
        """:attr:`mismatched` grouped by module (see :func:`group_shape_mismatches`)."""
        return group_shape_mismatches(self.mismatched)

    @property
    def where(self) -> str:
        return "top level" if self.key == "" else f"`{self.key}`"

    def summary(self) -> str:
        """One line: what was loaded where, and what did not fit."""
        head = "OK" if self.ok else "MISMATCH"
        s = (f"{head}: {self.path} ({self.where}) into {self.model} on {self.device}: "
             f"{self.loaded}/{self.model_entries} model entries loaded")
        if self.tied:
            s += f" (+{len(self.tied)} tied to a loaded entry)"
        if self.prefixes_removed or self.prefixes_added:
            s += "; " + _describe_prefixes(self.prefixes_removed, self.prefixes_added, self.renamed)
        problems = []
        if self.missing:
            problems.append(f"{len(self.missing)} missing")
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} unexpected")
        if self.mismatched:
            n = len(self.shape_groups)
            problems.append(f"{len(self.mismatched)} shape mismatches in {n} module{'s' if n != 1 else ''}")
        if self.casts:
            problems.append(f"{sum(c.count for c in self.casts)} dtype casts")
        if problems:
            s += "; " + ", ".join(problems)
        return s

    def tables(self, limit: int | None = _TABLE_ROWS) -> str:
        """The findings as tables (tabulate): missing keys, tied keys, unexpected keys, shape mismatches grouped
        by module, dtype casts, and the suggested fixes. Empty when there is nothing to report."""
        return "\n".join(_report_tables(self, limit))

    def format(self, limit: int | None = _TABLE_ROWS) -> str:
        """:meth:`summary` followed by :meth:`tables`."""
        t = self.tables(limit)
        return self.summary() + ("\n\n" + t if t else "")

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (what ``ckptool verify --json`` prints under ``load``)."""
        d = asdict(self)
        d["ok"] = self.ok
        d["shape_groups"] = [asdict(g) for g in self.shape_groups]
        return d

    def raise_for_errors(self) -> None:
        """Raise when the checkpoint did not fit the model exactly (missing, unexpected or shape-mismatched
        entries; dtype casts are not errors).

        Raises:
            StateDictMismatchError: the message is :meth:`summary` plus the tables of :meth:`tables`.
        """
        if not self.ok:
            raise StateDictMismatchError(self.format(limit=None), self)


@dataclass
class TrainingState:
    """What :func:`load_training_state` restored: the model's :class:`LoadReport`, ``epoch`` and ``global_step``
    when the checkpoint has them (``epoch``; ``global_step`` / ``step`` / ``iteration``), the keys the optimizer
    and scheduler states came from, and ``extra``: every other top-level entry of the checkpoint (``epoch``,
    ``loss``, ``args``... as loaded, tensors on ``device``)."""

    report: LoadReport
    epoch: int | None = None
    global_step: int | None = None
    optimizer_key: str | None = None
    scheduler_key: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ForwardCheck:
    """One forward pass on a fixed-seed input (``torch.randn`` with seed 0, ``input_shape``, the model's floating
    dtype) on the target device and on the CPU. ``max_abs_diff`` is the largest absolute difference of the output
    tensor closest to (or furthest past) its bound and ``tolerance`` that bound (scaled by the output's magnitude,
    see :func:`_tolerance`); ``within`` is True when every output is within its own bound; ``error`` is set when
    the pass could not run."""

    input_shape: list[int]
    input_dtype: str
    device: str
    outputs: int = 0
    max_abs_diff: float | None = None
    tolerance: float | None = None
    within: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the pass ran on both devices and every output is within its tolerance."""
        return self.error is None and self.within


@dataclass
class VerifyReport:
    """The result of :func:`verify` (and ``ckptool verify``).

    ``load`` is the :class:`LoadReport`; ``off_device`` lists ``[name, device]`` for parameters and buffers not on
    ``device``; ``checked`` counts the loaded entries (and the tied entries of the same shape as the one they are
    tied to, :attr:`tied`) compared with the checkpoint and ``value_mismatches`` names those whose bits differ
    (after the dtype cast ``load_state_dict`` applies); ``forward`` is the optional
    :class:`ForwardCheck`; ``problems`` says what failed (empty when everything holds).
    """

    load: LoadReport
    device: str
    parameters: int = 0
    buffers: int = 0
    off_device: list[list[str]] = field(default_factory=list)
    checked: int = 0
    value_mismatches: list[str] = field(default_factory=list)
    forward: ForwardCheck | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def tied(self) -> dict[str, str]:
        """Model entries absent from the checkpoint because they share storage with a loaded one
        (:attr:`LoadReport.tied`)."""
        return self.load.tied

    def summary(self) -> str:
        if self.ok:
            extra = ""
            if self.forward is not None:
                extra = f"; forward max |{self.device} - cpu| = {self.forward.max_abs_diff:.3g}"
            tied = f" ({len(self.load.tied)} tied)" if self.load.tied else ""
            return (f"OK: {self.load.path} loads into {self.load.model} on {self.device}: "
                    f"{self.load.loaded + len(self.load.tied)}/{self.load.model_entries} entries bit-identical"
                    f"{tied}{extra}")
        return f"FAILED: {self.load.path} into {self.load.model} on {self.device}: " + "; ".join(self.problems)

    def __str__(self) -> str:
        return self.summary()

    def format(self, limit: int | None = _TABLE_ROWS) -> str:
        """Summary line, the checks one per line, then the load report's tables."""
        ld = self.load
        lines = [self.summary(), ""]
        others = [p for p in ld.found if p != ld.key]
        sd = (ld.where + (f" (also found: {', '.join(p or 'top level' for p in others)})" if others else ""))
        lines.append(f"  state_dict:  {sd}")
        lines.append("  keys:        " + (_describe_prefixes(ld.prefixes_removed, ld.prefixes_added, ld.renamed)
                                          if ld.renamed else "used as saved"))
        lines.append(f"  loaded:      {ld.loaded}/{ld.model_entries} model entries from "
                     f"{ld.checkpoint_entries} checkpoint entries"
                     + (" (strict)" if ld.strict else " (non-strict)"))
        if ld.tied:
            lines.append(f"  tied:        {len(ld.tied)} model entries share storage with a loaded one: "
                         + ", ".join(f"{a} = {b}" for a, b in list(ld.tied.items())[:5]))
        n = self.parameters + self.buffers
        lines.append("  device:      " + (f"all {n} parameters and buffers on {self.device}" if not self.off_device
                                          else f"{len(self.off_device)}/{n} NOT on {self.device}: "
                                          + ", ".join(f"{a} ({b})" for a, b in self.off_device[:5])))
        lines.append("  values:      " + (f"{self.checked} tensors bit-identical to the checkpoint"
                                          if not self.value_mismatches else
                                          f"{len(self.value_mismatches)}/{self.checked} differ: "
                                          + ", ".join(self.value_mismatches[:5])))
        lines.append("  dtypes:      " + ("match" if not ld.casts else ", ".join(
            f"{c.count} cast {c.checkpoint_dtype} -> {c.model_dtype}{' (lossy)' if c.lossy else ''}"
            for c in ld.casts)))
        if self.forward is not None:
            f = self.forward
            shape = "x".join(map(str, f.input_shape))
            if f.error:
                lines.append(f"  forward:     input {shape} {f.input_dtype}: FAILED: {f.error}")
            else:
                lines.append(f"  forward:     input {shape} {f.input_dtype}, {f.outputs} output tensor(s): "
                             f"max |{f.device} - cpu| = {f.max_abs_diff:.3g} (tolerance {f.tolerance:.3g}) "
                             + ("OK" if f.ok else "TOO LARGE"))
        t = ld.tables(limit)
        if t:
            lines += ["", t]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``ckptool verify --json``)."""
        return {
            "ok": self.ok, "problems": list(self.problems), "device": self.device, "parameters": self.parameters,
            "buffers": self.buffers, "off_device": self.off_device, "checked": self.checked,
            "value_mismatches": self.value_mismatches, "tied": dict(self.tied),
            "forward": None if self.forward is None else {**asdict(self.forward), "ok": self.forward.ok},
            "load": self.load.to_dict(),
        }



def group_shape_mismatches(mismatches: Sequence[ShapeMismatch]) -> list[ShapeGroup]:
    """Group shape mismatches by module so that one cause reads as one finding.

    A module whose entries all differ in dim 0 only, by the same sizes (a ``Linear`` head's ``weight`` and
    ``bias``), is described as an output size change; when its name is a usual head name (``fc``, ``head``,
    ``classifier``...) the note says it is a head built for another number of classes.
    """
    groups: dict[str, list[ShapeMismatch]] = {}
    for m in mismatches:
        mod = m.key.rsplit(".", 1)[0] if "." in m.key else ""
        groups.setdefault(mod, []).append(m)
    out = []
    for mod, entries in groups.items():
        out.append(ShapeGroup(mod, entries, _shape_note(mod, entries)))
    return out


def _shape_note(mod: str, entries: list[ShapeMismatch]) -> str:
    diffs = set()
    for e in entries:
        c, m = e.checkpoint_shape, e.model_shape
        if len(c) != len(m):
            return f"{len(entries)} entries with different shapes (different number of dimensions)"
        d = tuple((i, a, b) for i, (a, b) in enumerate(zip(c, m)) if a != b)
        diffs.add(d)
    if len(diffs) == 1:
        (d,) = diffs
        if len(d) == 1:
            i, a, b = d[0]
            last = mod.rsplit(".", 1)[-1]
            if i == 0:
                note = f"{a} outputs in the checkpoint, {b} in the model"
                if last in _HEAD_NAMES:
                    note += ": a head built for a different number of classes"
                return note
            return f"dim {i} is {a} in the checkpoint, {b} in the model"
    return f"{len(entries)} entries with different shapes"


def _shape(s: Sequence[int]) -> str:
    return "x".join(map(str, s)) or "scalar"



def dtype_name(dt: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: the dtype's name as the reports show it."""
    return str(dt).replace("torch.", "")



def _describe_prefixes(removed: list[str], added: list[str], renamed: int) -> str:
    parts = []
    if removed:
        parts.append("removed " + ", ".join(f"`{p}`" for p in removed))
    if added:
        parts.append("added " + ", ".join(f"`{p}`" for p in added))
    return " and ".join(parts) + f" ({renamed} key{'s' if renamed != 1 else ''} renamed)"


def _prefix_suggestions(r: LoadReport, ckeys: list[str], model_keys: list[str]) -> list[str]:
    """What :func:`load_suggestions` says of wrapper prefixes: the ckptool command that removes the checkpoint's,
    or the inner model to load into when the model's keys carry one."""
    out: list[str] = []
    if r.prefixes_removed:
        prefs = shared_prefixes(ckeys)
        cmd = suggest_command(prefs, src=r.path, key=r.key or None)
        if cmd:
            out.append(f"checkpoint keys start with `{''.join(prefs)}`: run `{cmd}` to write a file a plain "
                       "load_state_dict accepts (ckptool.load_into and verify already handle it)")
        else:
            out.append(f"checkpoint keys carry wrapper components ({', '.join(r.prefixes_removed)}): run "
                       f"`ckptool unwrap {r.path}` (ckptool.load_into and verify already handle it)")
    if r.prefixes_added:
        mp = shared_prefixes(model_keys)
        inner = "".join(mp) or "".join(r.prefixes_added)
        attr = ".".join(p.rstrip(".") for p in mp) or "module"
        out.append(f"the model's keys start with `{inner}` (a wrapper) and the checkpoint's do not: load into the "
                   f"inner model (`model.{attr}`) or keep using ckptool.load_into, which adds the prefix")
    return out


def _key_suggestions(r: LoadReport) -> list[str]:
    """What :func:`load_suggestions` says of keys that do not match: another state_dict to pick, new layers to
    leave out, or a model that is not the checkpoint's architecture."""
    out: list[str] = []
    others = [p for p in r.found if p != r.key]
    if (r.missing or r.unexpected) and others:
        out.append(f"the checkpoint holds other state_dicts ({', '.join(p or 'top level' for p in others)}): pick one "
                   "with key= (--key)")
    if r.missing and not r.unexpected and not r.mismatched and len(r.missing) < r.model_entries:
        out.append(f"{len(r.missing)} model entries have no value in the checkpoint: if that is intended (new "
                   "layers), load with strict=False (--no-strict)")
    if r.unexpected and r.loaded == 0:
        out.append("no checkpoint key matches the model: check that --model builds the architecture the "
                   "checkpoint was trained with, or pick another state_dict with --key")
    return out


def load_suggestions(r: LoadReport, ckeys: list[str], model_keys: list[str]) -> list[str]:
    """One-line fixes for what ``r`` found (``ckeys``: the checkpoint's keys as saved, ``model_keys``: the
    model's): the ckptool command that removes wrapper prefixes, the inner model to load into, the modules whose
    shapes do not fit, other state_dicts to pick with ``key=``, and ``ckptool remap`` for GPU location tags."""
    out = _prefix_suggestions(r, ckeys, model_keys)
    for g in r.shape_groups:
        mod = g.module or "(root)"
        out.append(f"`{mod}` ({', '.join(g.names)}) does not fit: build the model with the checkpoint's sizes, or "
                   f"load the rest with strict=False (--no-strict) and train `{mod}` anew")
    out += _key_suggestions(r)
    gpu = sorted(t for t in r.saved_devices if t not in ("cpu", "meta"))
    if gpu:
        out.append(f"storages are tagged {', '.join(gpu)}: a plain torch.load needs that device; run "
                   f"`ckptool remap {r.path} --to cpu` so that it opens on any machine")
    return out


def _report_tables(r: LoadReport, limit: int | None) -> list[str]:
    from tabulate import tabulate

    out: list[str] = []

    def block(title: str, rows: list[Any], headers: list[str]) -> None:
        if not rows:
            return
        shown = rows if limit is None else rows[:limit]
        out.append(title)
        out.append(tabulate(shown, headers=headers))
        if len(shown) < len(rows):
            out.append(f"... {len(rows) - len(shown)} more (--json lists them all)")
        out.append("")

    block(f"Missing keys ({len(r.missing)}: in the model, not in the checkpoint):",
          [(k,) for k in r.missing], ["model key"])
    block(f"Tied keys ({len(r.tied)}: not in the checkpoint, share storage with a loaded entry, so not missing):",
          list(r.tied.items()), ["model key", "tied to"])
    block(f"Unexpected keys ({len(r.unexpected)}: in the checkpoint, not in the model):",
          [(k,) for k in r.unexpected], ["checkpoint key"])
    groups = r.shape_groups
    block(f"Shape mismatches ({len(groups)} finding{'s' if len(groups) != 1 else ''}, "
          f"{len(r.mismatched)} entries):",
          [(g.module or "(root)", ", ".join(g.names), ", ".join(_shape(e.checkpoint_shape) for e in g.entries),
            ", ".join(_shape(e.model_shape) for e in g.entries), g.note) for g in groups],
          ["module", "entries", "checkpoint", "model", "note"])
    block("Dtype casts (load_state_dict converts with Tensor.copy_):",
          [(c.checkpoint_dtype, c.model_dtype, c.count, c.example, "yes" if c.lossy else "no") for c in r.casts],
          ["checkpoint dtype", "model dtype", "tensors", "example", "lossy"])
    if r.suggestions:
        out.append("Suggested fixes:" if not r.ok else "Suggestions:")
        out += [f"  - {s}" for s in r.suggestions]
        out.append("")
    while out and out[-1] == "":
        out.pop()
    return out
