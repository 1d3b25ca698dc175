"""Load checkpoints into the user's model on the user's device, and save checkpoints that load anywhere.

The functions here replace the usual loading boilerplate (``torch.load(..., map_location=...)``, picking
``ckpt["state_dict"]``, ``k.replace("module.", "")``, deleting a head's keys before ``strict=False``)::

    model = Net()
    ckptool.load_into(model, "ckpt.pth", device="cuda:0")   # moves, maps, renames, loads; raises on mismatch

* :func:`load_into` moves the model to ``device``, loads the file with ``torch.load(map_location=device,
  weights_only=True)``, picks the state_dict inside it, reconciles wrapper prefixes (:func:`ckptool.keys.reconcile`)
  and calls the model's own ``load_state_dict``; it returns a :class:`LoadReport`.
* :func:`load_training_state` does the same for a training checkpoint and restores the optimizer (its state ends
  on each parameter's device, by torch's rules) and the LR scheduler.
* :func:`save_portable` is what training code should call instead of ``torch.save``: wrapper prefixes removed,
  every storage tagged ``cpu``, written atomically.
* :func:`verify` (``ckptool verify``) loads a checkpoint into a freshly built model and proves it landed: every
  parameter and buffer on the device, every value bit-identical to the checkpoint's tensor, dtype casts
  reported, and optionally one forward pass compared with the CPU.

Safety (project rule 1): a file is loaded with ``weights_only=True`` unless ``trust=True``. Before calling torch,
the pickle is read with :func:`ckptool.inspect` (nothing imported or run) and any global outside torch's
allowlist is named in an :class:`~ckptool.errors.UnsafeCheckpointError`; a weights-only failure from torch itself
becomes the same error. There is no silent fallback to ``weights_only=False``.

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ckptool.formats import detect as formats
from ckptool.errors import CkptError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError, UsageError
from ckptool.model.keys import (
    WRAPPER_COMPONENTS,
    WRAPPER_ONLY_COMPONENTS,
    Reconciliation,
    normalize_prefix,
    raise_on_collisions,
    reconcile,
    shared_prefixes,
    strip_prefix_key,
    suggest_command,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

__all__ = [
    "DtypeCast", "ForwardCheck", "LoadReport", "ShapeGroup", "ShapeMismatch", "StateDictMismatchError",
    "TrainingState", "VerifyReport", "default_device", "load_checkpoint", "load_into", "load_training_state",
    "resolve_device", "save_portable", "select_state_dict", "verify",
]

#: Names under which training checkpoints commonly keep the model's state_dict, most preferred first
#: (PyTorch tutorials, Lightning, timm, many repositories). EMA copies come last.
STATE_DICT_NAMES: tuple[str, ...] = (
    "state_dict", "model_state_dict", "model", "model_state", "net", "network", "module", "weights", "params",
    "ema", "state_dict_ema", "model_ema", "ema_state_dict", "ema_model",
)
OPTIMIZER_NAMES: tuple[str, ...] = (
    "optimizer_state_dict", "optimizer", "optimizer_state", "optim", "opt", "optimizer_states",
)
SCHEDULER_NAMES: tuple[str, ...] = (
    "scheduler_state_dict", "scheduler", "lr_scheduler", "lr_scheduler_state_dict", "scheduler_state", "sched",
    "lr_schedulers",
)
_HEAD_NAMES = {"fc", "head", "heads", "classifier", "cls", "logits", "out", "output", "lm_head", "fc_out", "final",
               "last_linear", "pred", "predictor", "decoder_head"}
_MAX_WALK_DEPTH = 6
_TABLE_ROWS = 20


class StateDictMismatchError(CkptError):
    """The checkpoint's state_dict does not fit the model: missing or unexpected keys, or shape mismatches.

    ``str(err)`` is the one-line summary followed by the report's tables; ``report`` is the :class:`LoadReport`.
    """

    def __init__(self, message: str, report: LoadReport) -> None:
        super().__init__(message)
        self.report = report


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
    model's state_dict; ``missing`` model keys with no value in the checkpoint; ``unexpected`` checkpoint keys
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
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[ShapeMismatch] = field(default_factory=list)
    casts: list[DtypeCast] = field(default_factory=list)
    saved_devices: dict[str, int] = field(default_factory=dict)
    suggestions: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every model entry got a value and every checkpoint entry was used (casts are allowed)."""
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
        """The findings as tables (tabulate): missing keys, unexpected keys, shape mismatches grouped by module,
        dtype casts, and the suggested fixes. Empty when there is nothing to report."""
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
    ``device``; ``checked`` counts the loaded entries compared with the checkpoint and ``value_mismatches`` names
    those whose bits differ (after the dtype cast ``load_state_dict`` applies); ``forward`` is the optional
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

    def summary(self) -> str:
        if self.ok:
            extra = ""
            if self.forward is not None:
                extra = f"; forward max |{self.device} - cpu| = {self.forward.max_abs_diff:.3g}"
            return (f"OK: {self.load.path} loads into {self.load.model} on {self.device}: "
                    f"{self.load.loaded}/{self.load.model_entries} entries bit-identical{extra}")
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
            "value_mismatches": self.value_mismatches,
            "forward": None if self.forward is None else {**asdict(self.forward), "ok": self.forward.ok},
            "load": self.load.to_dict(),
        }


# ------------------------------------------------------------------------------------------------ devices
def default_device() -> torch.device:
    """``cuda:0`` when ``torch.cuda.is_available()``, else ``cpu``."""
    import torch

    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(device: Any) -> torch.device:
    """Turn ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``torch.device(...)`` or an int (a CUDA index) into a
    ``torch.device`` with an explicit index for CUDA (``"cuda"`` -> the current CUDA device), checking that it
    exists here.

    Raises:
        UsageError: not a device string, or a CUDA / MPS device this machine does not have.
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise UsageError(f"unknown device {device!r}: expected cpu, cuda, cuda:N, mps or another torch device") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {device!s} requested but torch.cuda.is_available() is False on this machine; "
                             "use device='cpu' (--device cpu)")
        idx = torch.cuda.current_device() if dev.index is None else dev.index
        if idx >= torch.cuda.device_count():
            raise UsageError(f"device {device!s} requested but this machine has {torch.cuda.device_count()} CUDA "
                             "device(s); use cuda:0")
        dev = torch.device("cuda", idx)
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UsageError(f"device {device!s} requested but MPS is not available here; use device='cpu'")
    return dev


def _model_device(model: nn.Module) -> torch.device:
    import torch

    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` (index None and 0) count as one device; otherwise ``torch.device`` equality."""
    if a.type != b.type:
        return False
    return (a.index or 0) == (b.index or 0)


# ------------------------------------------------------------------------------------------------ loading files
_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def _unsafe_error(path: str, names: list[str], reason: str | None = None) -> UnsafeCheckpointError:
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    what = f"globals outside torch.load(weights_only=True)'s allowlist: {shown}" if names else (
        f"objects torch.load(weights_only=True) refuses ({reason})")
    return UnsafeCheckpointError(
        f"{path} holds {what}; loading it would run code named by the file. Pass trust=True (--trust) only if "
        "you trust its source, or ask for a plain state_dict file", names)


def _registered_safe_globals() -> set[str]:
    """``module.qualname`` of what the user added with ``torch.serialization.add_safe_globals``."""
    import torch

    out = set()
    for g in torch.serialization.get_safe_globals():
        obj = g[0] if isinstance(g, tuple) else g
        if isinstance(g, tuple) and len(g) == 2 and isinstance(g[1], str):
            out.add(g[1])
        mod, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if mod and name:
            out.add(f"{mod}.{name}")
    return out


def load_checkpoint(path: str | os.PathLike[str], device: Any = "cpu", *, trust: bool = False
                    ) -> tuple[Any, dict[str, int]]:
    """Load the object saved in ``path`` with every tensor on ``device``; safe unless ``trust``.

    torch zip / legacy files: ``torch.load(path, map_location=device, weights_only=not trust)``; the pickle is
    first read with :func:`ckptool.inspect` (nothing imported), and a global outside torch's allowlist (and not
    registered with ``torch.serialization.add_safe_globals``) stops the load with its name. safetensors:
    ``safetensors.torch.load_file(path, device=...)``. TorchScript archives (only with ``trust``):
    ``torch.jit.load(path, map_location=device).state_dict()``. Plain pickles (only with ``trust``):
    ``pickle.load``, then tensors moved to ``device``.

    Returns ``(obj, saved_devices)``: the loaded object and location tag -> tensor count as saved in the file
    (empty when unknown).

    Raises:
        UsageError: bad device, missing path or a directory.
        NotACheckpointError / CorruptCheckpointError: unreadable input, or torch failed to read it.
        UnsafeCheckpointError: the file needs globals outside the weights-only allowlist (or is TorchScript / a
            plain pickle) and ``trust`` is False.
    """
    import torch

    path = os.fspath(path)
    dev = resolve_device(device)
    fmt = formats.detect_format(path)
    if fmt == formats.SAFETENSORS:
        from safetensors.torch import load_file

        try:
            return load_file(path, device=str(dev)), {}
        except Exception as e:  # safetensors raises its own SafetensorError for damaged files
            raise CorruptCheckpointError(f"{path}: safetensors could not read it ({e}); re-download it") from e
    if fmt == formats.TORCHSCRIPT:
        if not trust:
            raise UnsafeCheckpointError(
                f"{path} is a TorchScript archive: loading it compiles the code stored in it. Pass trust=True "
                "(--trust) only if you trust its source; its state_dict is then taken from torch.jit.load")
        try:
            return dict(torch.jit.load(path, map_location=dev).state_dict()), {}
        except Exception as e:
            raise CorruptCheckpointError(f"{path}: torch.jit.load failed: {_first_line(e)}") from e
    if fmt == formats.PICKLE:
        if not trust:
            raise UnsafeCheckpointError(
                f"{path} is a plain pickle, not a torch.save file: only an unrestricted unpickler reads it. Pass "
                "trust=True (--trust) only if you trust its source")
        with open(path, "rb") as f:
            try:
                obj = pickle.load(f)  # noqa: S301 - trusted by the caller
            except Exception as e:
                raise CorruptCheckpointError(f"{path}: unpickling failed: {_first_line(e)}") from e
        return _map_tensors(obj, lambda t: t.to(dev)), {}

    from ckptool.ops.inspect import inspect

    info = inspect(path)
    saved = dict(info.devices)
    if not trust:
        registered = _registered_safe_globals()
        unsafe = [g for g in info.unsafe_globals if g not in registered]
        if unsafe:
            raise _unsafe_error(path, unsafe)
    try:
        obj = torch.load(path, map_location=dev, weights_only=not trust)
    except pickle.UnpicklingError as e:
        if trust:
            raise CorruptCheckpointError(f"{path}: unpickling failed: {_first_line(e)}") from e
        msg = str(e)
        names = list(dict.fromkeys(_GLOBAL_RE.findall(msg)))
        reason = next((ln.strip() for ln in msg.splitlines() if "WeightsUnpickler error" in ln), _first_line(e))
        raise _unsafe_error(path, names, reason) from e
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError) as e:
        raise CorruptCheckpointError(f"{path}: torch.load failed: {_first_line(e)}; the file may be truncated "
                                     "or damaged") from e
    except (ImportError, AttributeError) as e:  # trusted full-model pickle whose classes are not importable here
        raise CkptError(f"{path}: the pickle names code that is not importable here ({_first_line(e)}); make the "
                        "model's module importable (PYTHONPATH) or load a state_dict instead") from e
    return obj, saved


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:300]


def _map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _map_tensors(v, fn)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if type(obj) is tuple:
        return tuple(_map_tensors(v, fn) for v in obj)
    return obj


# ------------------------------------------------------------------------------------------------ state_dicts
def _is_state_dict(obj: Any) -> bool:
    import torch

    from ckptool.model.graph import looks_like_state_dict

    return isinstance(obj, Mapping) and looks_like_state_dict(obj.items(), lambda v: isinstance(v, torch.Tensor))


def _is_optimizer_state(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "state" in obj and "param_groups" in obj


def find_state_dicts(obj: Any) -> list[tuple[str, Mapping[str, Any]]]:
    """Every state_dict in a loaded checkpoint, outermost first: ``[(dotted_path, state_dict)]``.

    A state_dict is a mapping with string keys and tensor values (``*_extra_state`` entries allowed); an
    ``nn.Module`` (a full-model pickle) counts as its ``state_dict()``. Optimizer state_dicts (``state`` +
    ``param_groups``) are skipped. The walk does not enter a state_dict it found, and stops at depth 6.
    """
    from torch import nn

    out: list[tuple[str, Mapping[str, Any]]] = []
    queue: list[tuple[str, Any, int]] = [("", obj, 0)]
    seen: set[int] = set()
    while queue:
        path, o, depth = queue.pop(0)
        if id(o) in seen or depth > _MAX_WALK_DEPTH:
            continue
        seen.add(id(o))
        if isinstance(o, nn.Module):
            out.append((path, o.state_dict()))
        elif _is_state_dict(o):
            out.append((path, o))
        elif _is_optimizer_state(o):
            continue
        elif isinstance(o, Mapping):
            queue += [(_join(path, k), v, depth + 1) for k, v in o.items() if isinstance(k, (str, int))]
        elif isinstance(o, (list, tuple)):
            queue += [(_join(path, i), v, depth + 1) for i, v in enumerate(o)]
    return out


def _join(prefix: str, name: Any) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def get_path(obj: Any, path: str) -> Any:
    """The object at dotted ``path`` inside a loaded checkpoint (``""`` = ``obj``): mapping keys (a key that itself
    holds dots is matched whole), list indices, module attributes.

    Raises:
        KeyError: nothing at ``path``.
    """
    if path == "":
        return obj
    parts = path.split(".")
    i = 0
    while i < len(parts):
        for j in range(len(parts), i, -1):  # longest dotted run first: keys such as "model.ema" stay whole
            comp = ".".join(parts[i:j])
            if isinstance(obj, Mapping) and comp in obj:
                obj, i = obj[comp], j
                break
            if isinstance(obj, Mapping) and comp.lstrip("-").isdigit() and int(comp) in obj:
                obj, i = obj[int(comp)], j
                break
            if j == i + 1 and isinstance(obj, (list, tuple)) and comp.isdigit() and int(comp) < len(obj):
                obj, i = obj[int(comp)], j
                break
            if j == i + 1 and not isinstance(obj, (Mapping, list, tuple)) and hasattr(obj, comp):
                obj, i = getattr(obj, comp), j
                break
        else:
            raise KeyError(path)
    return obj


def _as_state_dict(obj: Any) -> Mapping[str, Any] | None:
    from torch import nn

    if isinstance(obj, nn.Module):
        return obj.state_dict()
    return obj if _is_state_dict(obj) else None


def _match_count(keys: list[str], model_keys: list[str], prefixes: Any) -> int:
    mset = set(model_keys)
    if prefixes == "auto":
        return reconcile(keys, model_keys).matched
    return sum(k in mset for k in keys)


def select_state_dict(obj: Any, key: str | None, model_keys: list[str] | None = None, *, prefixes: Any = "auto",
                      path: str = "checkpoint") -> tuple[str, Mapping[str, Any], list[str]]:
    """Choose the state_dict to load from a loaded checkpoint.

    With ``key`` (a dotted path such as ``"state_dict"``, ``"model"``, ``"ema"``) that entry is used. Without it,
    a top-level state_dict (or ``nn.Module``) wins; otherwise the nested candidates (:func:`find_state_dicts`) are
    ranked by how many of their keys match ``model_keys`` after prefix reconciliation, then by name
    (:data:`STATE_DICT_NAMES` order: ``state_dict``, ``model_state_dict``, ``model``, ... EMA copies last), then by
    depth. Returns ``(dotted_path, state_dict, every_candidate_path)``.

    Raises:
        UsageError: ``key`` names nothing, or something that is not a state_dict.
        UnsupportedError: the checkpoint holds no state_dict at all.
    """
    found = find_state_dicts(obj)
    paths = [p for p, _ in found]
    listing = ", ".join(p or "(top level)" for p in paths) or "none"
    if key is not None:
        try:
            sub = get_path(obj, key)
        except KeyError:
            raise UsageError(f"{path} has no entry {key!r}; state_dicts found: {listing}") from None
        sd = _as_state_dict(sub)
        if sd is None:
            raise UsageError(f"{path}: {key!r} is a {type(sub).__name__}, not a state_dict (a mapping of names to "
                             f"tensors); state_dicts found: {listing}")
        return key, sd, paths
    if not found:
        top = ", ".join(map(str, list(obj)[:10])) if isinstance(obj, Mapping) else type(obj).__name__
        raise UnsupportedError(f"{path} holds no state_dict (a mapping of names to tensors); found: {top}")
    if found[0][0] == "":
        return "", found[0][1], paths

    def rank(item: tuple[int, tuple[str, Mapping[str, Any]]]) -> tuple[int, int, int, int]:
        i, (p, sd) = item
        last = p.rsplit(".", 1)[-1]
        name_rank = STATE_DICT_NAMES.index(last) if last in STATE_DICT_NAMES else len(STATE_DICT_NAMES)
        matched = _match_count(list(sd), model_keys, prefixes) if model_keys is not None else 0
        return (-matched, name_rank, p.count("."), i)

    _, (best_path, best) = min(enumerate(found), key=rank)
    return best_path, best, paths


# ------------------------------------------------------------------------------------------------ key renaming
def _reconciliation(ckeys: list[str], model_keys: list[str], prefixes: Any) -> Reconciliation:
    if prefixes == "auto":
        return reconcile(ckeys, model_keys)
    if prefixes is None or prefixes is False or prefixes == "none":
        return Reconciliation({k: k for k in ckeys}, matched=sum(k in set(model_keys) for k in ckeys))
    plist = [prefixes] if isinstance(prefixes, str) else list(prefixes)
    try:
        plist = [normalize_prefix(p) for p in plist]
    except UsageError as e:
        raise UsageError(f"prefixes must be 'auto', None or the prefixes to strip: {e}") from None
    mapping = {k: strip_prefix_key(k, plist) for k in ckeys}
    raise_on_collisions(mapping)
    used = [p for p in plist if any(k.startswith(p) for k in ckeys)]
    return Reconciliation(mapping, removed=used, matched=sum(v in set(model_keys) for v in mapping.values()))


def _rename_metadata(meta: Mapping[str, Any], mapping: Mapping[str, str]) -> OrderedDict:
    """Rename the module paths of a state_dict's ``_metadata`` the way ``mapping`` renamed its tensor keys.

    Each renamed key gives a (checkpoint module path -> model module path) pair once the shared trailing
    components are dropped (``module.fc.weight -> fc.weight`` gives ``module -> ""``); a metadata path under the
    first matching pair is rebased. When two paths end on one name the later entry (the inner module's) wins, as
    in torch's ``consume_prefix_in_state_dict_if_present``.
    """
    pairs: dict[str, str] = {}
    for old, new in mapping.items():
        if old == new:
            continue
        a, b = old.split("."), new.split(".")
        while a and b and a[-1] == b[-1]:
            a.pop()
            b.pop()
        pairs.setdefault(".".join(a), ".".join(b))
    out: OrderedDict = OrderedDict()
    for m, v in meta.items():
        new_m = m
        for a, b in sorted(pairs.items(), key=lambda kv: -len(kv[0])):
            if a == "" or m == a or m.startswith(a + "."):
                rest = m if a == "" else m[len(a):].lstrip(".")
                new_m = ".".join(x for x in (b, rest) if x)
                break
        out[new_m] = v
    return out


# ------------------------------------------------------------------------------------------------ shape groups
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


# ------------------------------------------------------------------------------------------------ core load
@dataclass
class _Loaded:
    report: LoadReport
    loaded: dict[str, Any]  # model key -> the checkpoint tensor copied into it


def _load_state_dict(model: nn.Module, sd: Mapping[str, Any], *, path: str, key: str, found: list[str],
                     device: torch.device, strict: bool, prefixes: Any, saved: dict[str, int]) -> _Loaded:
    import torch

    model_sd = model.state_dict()
    model_keys = list(model_sd)
    ckeys = list(sd)
    rec = _reconciliation(ckeys, model_keys, prefixes)
    inverse = {v: k for k, v in rec.mapping.items()}

    to_load: OrderedDict = OrderedDict()
    mismatched: list[ShapeMismatch] = []
    cast_groups: dict[tuple[str, str], list[Any]] = {}
    for ck in ckeys:
        mk = rec.mapping[ck]
        v, target = sd[ck], model_sd.get(mk)
        if isinstance(v, torch.Tensor) and isinstance(target, torch.Tensor) and not _is_lazy(target):
            if tuple(v.shape) != tuple(target.shape):
                mismatched.append(ShapeMismatch(mk, ck, list(v.shape), list(target.shape)))
                continue
            if v.dtype != target.dtype:
                cast_groups.setdefault((_dtype_name(v.dtype), _dtype_name(target.dtype)), []).append((mk, v, target))
        to_load[mk] = v
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        to_load._metadata = _rename_metadata(meta, rec.mapping) if rec.changed else meta  # type: ignore[attr-defined]

    try:
        result = model.load_state_dict(to_load, strict=False)
    except RuntimeError as e:  # a module's own _load_from_state_dict refused a value
        raise CkptError(f"{type(model).__name__}.load_state_dict refused {path}: {_first_line(e)}") from e
    skipped = {m.key for m in mismatched}
    missing = [k for k in result.missing_keys if k not in skipped]
    unexpected = [inverse.get(k, k) for k in result.unexpected_keys]
    unused = set(result.unexpected_keys)
    loaded = {k: v for k, v in to_load.items() if k not in unused}

    casts = []
    for (cd, md), items in cast_groups.items():
        lossy = any(not _same_bits(v.to(t.dtype).to(v.dtype), v) for _, v, t in items)
        casts.append(DtypeCast(cd, md, len(items), items[0][0], lossy))

    report = LoadReport(
        path=path, model=type(model).__name__, device=str(device), key=key, strict=strict, found=found,
        prefixes_removed=list(rec.removed), prefixes_added=list(rec.added),
        renamed=sum(1 for a, b in rec.mapping.items() if a != b), loaded=len(loaded), model_entries=len(model_keys),
        checkpoint_entries=len(ckeys), missing=missing, unexpected=unexpected, mismatched=mismatched, casts=casts,
        saved_devices=dict(saved),
    )
    report.suggestions = _suggestions(report, ckeys, model_keys)
    return _Loaded(report, loaded)


def _is_lazy(t: Any) -> bool:
    from torch.nn.parameter import is_lazy

    return bool(is_lazy(t))


def _dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


def _same_bits(a: Any, b: Any) -> bool:
    """Bitwise equality of two tensors (NaN-safe): same dtype, same shape, same bytes (False for meta tensors,
    which hold no data)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.device.type == "meta" or b.device.type == "meta":  # no data to compare
        return False
    if a.device != b.device:
        b = b.to(a.device)
    import torch

    ra, rb = a.detach().reshape(-1), b.detach().reshape(-1)
    if ra.numel() == 0:
        return True
    try:
        return bool(torch.equal(ra.contiguous().view(torch.uint8), rb.contiguous().view(torch.uint8)))
    except RuntimeError:  # layouts that cannot be viewed as bytes (quantized, sparse): compare values
        return bool(torch.equal(ra, rb))


def _describe_prefixes(removed: list[str], added: list[str], renamed: int) -> str:
    parts = []
    if removed:
        parts.append("removed " + ", ".join(f"`{p}`" for p in removed))
    if added:
        parts.append("added " + ", ".join(f"`{p}`" for p in added))
    return " and ".join(parts) + f" ({renamed} key{'s' if renamed != 1 else ''} renamed)"


def _suggestions(r: LoadReport, ckeys: list[str], model_keys: list[str]) -> list[str]:
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
    for g in r.shape_groups:
        mod = g.module or "(root)"
        out.append(f"`{mod}` ({', '.join(g.names)}) does not fit: build the model with the checkpoint's sizes, or "
                   f"load the rest with strict=False (--no-strict) and train `{mod}` anew")
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


# ------------------------------------------------------------------------------------------------ public API
def _check_model(model: Any) -> None:
    from torch import nn

    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def load_into(model: nn.Module, path: str | os.PathLike[str], *, device: Any = None, key: str | None = None,
              strict: bool = True, prefixes: Any = "auto", trust: bool = False) -> LoadReport:
    """Load the checkpoint at ``path`` into ``model`` on ``device``, fixing what usually needs boilerplate.

    1. ``model.to(device)`` when ``device`` is given (else the model stays where it is, and its device is used).
    2. The file is loaded straight onto that device: ``torch.load(map_location=device, weights_only=True)``
       (see :func:`load_checkpoint`; safetensors and, with ``trust``, full-model pickles and TorchScript too).
    3. The state_dict is chosen: ``key`` (dotted path, e.g. ``"state_dict"``, ``"ema"``) or automatically
       (:func:`select_state_dict`).
    4. Keys are reconciled with the model's (``prefixes="auto"``: :func:`ckptool.keys.reconcile`, e.g.
       ``module.`` removed for a bare model or added for a DataParallel one, ``_orig_mod.`` for compiled models,
       Lightning's ``model.``); ``prefixes=None`` keeps the keys as saved; a prefix or list of prefixes strips
       exactly those. ``_metadata`` (module versions) is renamed alongside.
    5. Entries whose shape differs from the model's are set aside (torch would raise even with ``strict=False``);
       the rest go through the model's own ``load_state_dict(strict=False)``, which copies (and casts) each into
       the existing parameters and buffers. Missing and unexpected keys are those torch reports.

    With ``strict=True`` any missing, unexpected or shape-mismatched entry raises after the load, like torch's
    ``load_state_dict(strict=True)`` (the matching entries have been copied by then); with ``strict=False`` they
    are only reported. Returns the :class:`LoadReport`.

    Raises:
        StateDictMismatchError: ``strict`` and the state_dict does not fit (message: the report's tables).
        UnsafeCheckpointError: the file needs globals outside the weights-only allowlist and ``trust`` is False.
        UsageError: bad device, ``model`` not an ``nn.Module``, ``key`` names no state_dict, bad ``prefixes``.
        NotACheckpointError / CorruptCheckpointError: unreadable file.
        UnsupportedError: the file holds no state_dict.
        KeyCollisionError: stripping ``prefixes`` would merge two keys.
        CkptError: the model's own ``load_state_dict`` refused a value (its RuntimeError is chained).
    """
    _check_model(model)
    dev = resolve_device(device) if device is not None else _model_device(model)
    if device is not None:
        model.to(dev)
    p = os.fspath(path)
    obj, saved = load_checkpoint(p, dev, trust=trust)
    done = _load_selected(model, obj, path=p, key=key, device=dev, strict=strict, prefixes=prefixes, saved=saved)
    if strict:
        done.report.raise_for_errors()
    return done.report


def _load_selected(model: nn.Module, obj: Any, *, path: str, key: str | None, device: torch.device, strict: bool,
                   prefixes: Any, saved: dict[str, int]) -> _Loaded:
    model_keys = list(model.state_dict())
    where, sd, found = select_state_dict(obj, key, model_keys, prefixes=prefixes, path=path)
    return _load_state_dict(model, sd, path=path, key=where, found=found, device=device, strict=strict,
                            prefixes=prefixes, saved=saved)


def _find_entry(ck: Mapping[str, Any], key: str | None, names: Sequence[str], what: str, path: str,
                accept: Callable[[Any], bool]) -> tuple[str | None, Any]:
    if key is not None:
        try:
            return key, get_path(ck, key)
        except KeyError:
            raise UsageError(f"{path} has no entry {key!r} for the {what}; top-level keys: "
                             f"{', '.join(map(str, list(ck)[:20]))}") from None
    for n in names:
        v = ck.get(n)
        if isinstance(v, (list, tuple)) and v and accept(v[0]):
            return f"{n}.0", v[0]
        if v is not None and accept(v):
            return n, v
    return None, None


def load_training_state(model: nn.Module, optimizer: Any, path: str | os.PathLike[str], *, device: Any = None,
                        scheduler: Any = None, model_key: str | None = None, optimizer_key: str | None = None,
                        scheduler_key: str | None = None, strict: bool = True, trust: bool = False) -> TrainingState:
    """Resume a training checkpoint (model, optimizer, optional LR scheduler) on ``device``, whatever device it
    was saved on.

    The model is moved to ``device`` *before* the optimizer state is loaded (moving it afterwards is what leaves
    optimizer state behind and gives "Expected all tensors to be on the same device"). The file is loaded once
    onto ``device`` (:func:`load_checkpoint`), the model's state_dict is loaded as in :func:`load_into`
    (``model_key`` or automatic), then ``optimizer.load_state_dict`` (entry ``optimizer_key`` or the first of
    :data:`OPTIMIZER_NAMES`; Lightning's ``optimizer_states`` list gives its first element), which casts every
    state tensor to its parameter's device and floating dtype, ``step`` excepted
    (``Optimizer._process_value_according_to_param_policy``). Every state entry (custom ones and nested
    containers included) is then placed by torch's own rule: ``step`` on the CPU unless the group is ``fused`` or
    ``capturable`` (then on the parameter's device, as torch creates it), everything else on its parameter's
    device. Finally ``scheduler.load_state_dict`` (``scheduler_key`` or :data:`SCHEDULER_NAMES`).

    Returns a :class:`TrainingState` (the model's :class:`LoadReport`, ``epoch``, ``global_step``, the keys used
    and every other top-level entry in ``extra``).

    Raises:
        StateDictMismatchError: ``strict`` and the model's state_dict does not fit.
        UsageError: bad device; no optimizer (or scheduler) state found, or it does not match the optimizer
            (different number of parameter groups or parameters).
        UnsupportedError: the file is not a dict (not a training checkpoint: use :func:`load_into`), or it holds
            no state_dict.
        UnsafeCheckpointError / NotACheckpointError / CorruptCheckpointError: as :func:`load_checkpoint`.
        CkptError: the model's own ``load_state_dict`` refused a value.
    """
    _check_model(model)
    dev = resolve_device(device) if device is not None else _model_device(model)
    if device is not None:
        model.to(dev)
    p = os.fspath(path)
    ck, saved = load_checkpoint(p, dev, trust=trust)
    if not isinstance(ck, Mapping):
        raise UnsupportedError(f"{p} holds a {type(ck).__name__}, not a training checkpoint dict; load it with "
                               "ckptool.load_into(model, path)")
    done = _load_selected(model, ck, path=p, key=model_key, device=dev, strict=strict, prefixes="auto", saved=saved)
    if strict:
        done.report.raise_for_errors()
    used = {done.report.key.split(".")[0]} if done.report.key else set()

    opt_key = None
    if optimizer is not None:
        opt_key, opt_sd = _find_entry(ck, optimizer_key, OPTIMIZER_NAMES, "optimizer state", p, _is_optimizer_state)
        if opt_sd is None or not _is_optimizer_state(opt_sd):
            raise UsageError(f"{p}: no optimizer state_dict (a dict with 'state' and 'param_groups') found"
                             + (f" at {optimizer_key!r}" if optimizer_key else "")
                             + f"; top-level keys: {', '.join(map(str, list(ck)[:20]))}; pass optimizer_key=")
        try:
            optimizer.load_state_dict(opt_sd)
        except (ValueError, KeyError) as e:
            raise UsageError(f"{p}: the optimizer state at {opt_key!r} does not fit this optimizer: {_first_line(e)}; "
                             "build the optimizer over the same parameters, in the same groups, as when it was "
                             "saved") from e
        place_optimizer_state(optimizer)
        used.add(opt_key.split(".")[0])

    sched_key = None
    if scheduler is not None:
        sched_key, sched_sd = _find_entry(ck, scheduler_key, SCHEDULER_NAMES, "scheduler state", p,
                                          lambda v: isinstance(v, Mapping))
        if sched_sd is None:
            raise UsageError(f"{p}: no scheduler state found (looked for {', '.join(SCHEDULER_NAMES)}); "
                             "pass scheduler_key=")
        scheduler.load_state_dict(sched_sd)
        used.add(sched_key.split(".")[0])

    extra = {k: v for k, v in ck.items() if k not in used}
    epoch = _as_int(ck.get("epoch"))
    step = next((_as_int(ck.get(n)) for n in ("global_step", "step", "iteration", "iter") if n in ck), None)
    return TrainingState(done.report, epoch, step, opt_key, sched_key, extra)


def _as_int(v: Any) -> int | None:
    try:
        import torch

        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None
    except (TypeError, ValueError):
        return None


def place_optimizer_state(optimizer: Any) -> int:
    """Move every tensor of ``optimizer.state`` where torch would have created it; return how many moved.

    ``step`` (a 0-dim tensor) goes to the CPU unless its group is ``fused`` or ``capturable``, in which case it
    goes to the parameter's device (torch's ``Adam``/``AdamW``/``Adagrad``... create it there, and
    ``Optimizer.load_state_dict`` casts it so); every other tensor, in nested dicts, lists and tuples too, goes to
    its parameter's device. Values and dtypes are kept.
    """
    import torch

    moved = 0

    def place(v: Any, p: Any, k: Any, on_device_step: bool) -> Any:
        nonlocal moved
        if isinstance(v, torch.Tensor):
            if k == "step" and v.dim() == 0:
                target = p.device if on_device_step else torch.device("cpu")
            else:
                target = p.device
            if v.device != target:
                moved += 1
                return v.to(target)
            return v
        if isinstance(v, dict):
            for kk in list(v):
                v[kk] = place(v[kk], p, kk, on_device_step)
            return v
        if isinstance(v, list):
            return [place(x, p, None, on_device_step) for x in v]
        if type(v) is tuple:
            return tuple(place(x, p, None, on_device_step) for x in v)
        return v

    for group in optimizer.param_groups:
        on_dev = bool(group.get("capturable", False)) or bool(group.get("fused", False))
        for prm in group["params"]:
            st = optimizer.state.get(prm)
            if isinstance(st, dict):
                place(st, prm, None, on_dev)
    return moved


# ------------------------------------------------------------------------------------------------ save_portable
def _unwrap_module(m: nn.Module) -> nn.Module:
    """Peel ``DataParallel`` / ``DistributedDataParallel`` (``.module``) and ``torch.compile``'s
    ``OptimizedModule`` (``._orig_mod``) off the outside of a module."""
    from torch import nn

    while True:
        if isinstance(m, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            m = m.module
        elif type(m).__name__ == "OptimizedModule" and isinstance(getattr(m, "_orig_mod", None), nn.Module):
            m = m._orig_mod
        else:
            return m


def portable_key(key: str, lead: Sequence[str]) -> str:
    """``key`` without the shared leading wrapper prefixes ``lead`` and without wrapper-only components
    (``_orig_mod``, ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``) anywhere before its last component.

    A leading ``module.`` carried by only some keys is kept: it is then an attribute named ``module``, not
    DataParallel.
    """
    key = strip_prefix_key(key, lead)
    parts = key.split(".")
    kept = [c for c in parts[:-1] if c not in WRAPPER_ONLY_COMPONENTS] + parts[-1:]
    return ".".join(kept)


def _portable_state_dict(sd: Mapping[str, Any], memo: _Memo) -> dict:
    from ckptool.model.keys import metadata_key_mapping

    keys = list(sd)
    lead = [p for p in shared_prefixes(keys) if p[:-1] in WRAPPER_COMPONENTS]
    mapping = {k: portable_key(k, lead) for k in keys}
    raise_on_collisions(mapping)
    out: dict = {} if type(sd) is dict else OrderedDict()
    for k, v in sd.items():
        out[mapping[k]] = _portable_value(v, memo)
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        mm = metadata_key_mapping(meta, lambda k: portable_key(k, lead))
        new_meta: OrderedDict = OrderedDict()
        for m, v in meta.items():
            new_meta[mm[m]] = copy.deepcopy(v)
        out._metadata = new_meta  # type: ignore[attr-defined]
    return out


@dataclass
class _Memo:
    storages: dict[tuple[str, int, int], Any] = field(default_factory=dict)  # source storage -> its CPU copy
    objects: dict[int, Any] = field(default_factory=dict)  # id(source object) -> converted object
    keep: list[Any] = field(default_factory=list)  # sources, so their ids stay unique while converting


def _cpu_tensor(t: Any, memo: _Memo) -> Any:
    """``t`` on the CPU, keeping storage sharing: each source storage is copied once, and every tensor viewing it
    becomes a view (same offset, size, stride) of the one CPU copy."""
    import torch

    if t.device.type == "cpu":
        return t
    if t.layout != torch.strided or t.is_quantized or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return t.cpu()
    st = t.untyped_storage()
    sk = (str(st.device), st.data_ptr(), st.nbytes())
    cpu_st = memo.storages.get(sk)
    if cpu_st is None:
        cpu_st = memo.storages[sk] = st.cpu()
    with torch.no_grad():
        out = torch.empty(0, dtype=t.dtype, device="cpu").set_(cpu_st, t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if t.is_leaf else out.detach()


def _portable_value(v: Any, memo: _Memo) -> Any:
    import torch
    from torch import nn

    if id(v) in memo.objects:
        return memo.objects[id(v)]
    if isinstance(v, torch.Tensor):
        out: Any = _cpu_tensor(v, memo)
    elif isinstance(v, nn.Module):
        out = _portable_state_dict(_unwrap_module(v).state_dict(), memo)
    elif _is_state_dict(v):
        out = _portable_state_dict(v, memo)
    elif isinstance(v, dict):
        out = type(v)() if type(v) in (dict, OrderedDict) else {}
        for k, x in v.items():
            out[k] = _portable_value(x, memo)
        if hasattr(v, "_metadata"):
            out._metadata = v._metadata
    elif isinstance(v, list):
        out = [_portable_value(x, memo) for x in v]
    elif type(v) is tuple:
        out = tuple(_portable_value(x, memo) for x in v)
    else:
        out = v
    memo.objects[id(v)] = out
    memo.keep.append(v)
    return out


_SAFE_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray)


def _check_weights_only(obj: Any) -> None:
    """Raise when ``obj`` holds a value ``torch.load(weights_only=True)`` refuses (an argparse.Namespace, a
    dataclass, a NumPy array, a custom class, a tensor subclass...), naming where it is. Accepted: the types of
    torch's allowlist (:mod:`ckptool.allowlist`: dict, OrderedDict, Counter, list, tuple, set, scalars, str,
    bytes, ``torch.Tensor`` / ``Parameter``, ``torch.Size``, ``torch.dtype``, ``torch.device``, layouts) and
    classes registered with ``torch.serialization.add_safe_globals``."""
    from collections import Counter

    import torch

    registered = _registered_safe_globals()
    containers = (dict, OrderedDict, Counter, list, tuple, set)
    stack: list[tuple[str, Any]] = [("", obj)]
    seen: set[int] = set()
    while stack:
        w, o = stack.pop()
        if isinstance(o, _SAFE_SCALARS) or isinstance(o, (torch.dtype, torch.device, torch.layout)):
            continue
        if type(o) in (torch.Tensor, torch.nn.Parameter, torch.Size):
            continue
        if type(o) in containers:
            if id(o) in seen:
                continue
            seen.add(id(o))
            if isinstance(o, dict):
                stack += [(_join(w, f"<key {k!r}>"), k) for k in o] + [(_join(w, k), v) for k, v in o.items()]
            else:
                stack += [(_join(w, i), v) for i, v in enumerate(o)]
            continue
        name = f"{type(o).__module__}.{type(o).__qualname__}"
        if name in registered:
            continue
        raise UnsupportedError(
            f"save_portable: {w or 'the object'} is a {name}, which torch.load(weights_only=True) refuses; convert "
            "it to plain types first (vars(args), dataclasses.asdict(cfg), tensor.tolist()...) so the file loads "
            "anywhere; nothing was written")


def save_portable(obj: Any, path: str | os.PathLike[str]) -> str:
    """Save ``obj`` so that a plain ``torch.load(path, weights_only=True)`` opens it on any machine.

    ``obj`` may be an ``nn.Module`` (its ``state_dict()`` is saved, after peeling ``DataParallel`` /
    ``DistributedDataParallel`` / ``torch.compile`` wrappers off it), a state_dict, or a training-checkpoint dict
    (``{"epoch": ..., "model": module_or_state_dict, "optimizer": optimizer.state_dict(), ...}``) whose nested
    modules and state_dicts are converted the same way. In every state_dict, wrapper prefixes shared by all keys
    (``module.``, ``_orig_mod.``...) and wrapper-only components anywhere (``_orig_mod``,
    ``_checkpoint_wrapped_module``...) are removed (``_metadata`` renamed alongside); every tensor is copied to the
    CPU, once per storage so shared storages stay shared, so every storage is tagged ``cpu``; dtypes, shapes and
    strides are kept. The file is written with ``torch.save`` through :func:`ckptool.writer.atomic_output`
    (temporary file, fsync, rename). Returns the absolute path written.

    Raises:
        UnsupportedError: ``obj`` holds something ``torch.load(weights_only=True)`` refuses (argparse.Namespace,
            custom classes...); nothing is written.
        KeyCollisionError: removing prefixes would merge two keys.
        UsageError / CkptError: the destination folder is missing or the write failed (nothing left behind).
    """
    import torch
    from torch import nn

    from ckptool._fileio import atomic_output

    memo = _Memo()
    if isinstance(obj, nn.Module):
        out = _portable_state_dict(_unwrap_module(obj).state_dict(), memo)
    else:
        out = _portable_value(obj, memo)
    _check_weights_only(out)
    dst = os.path.abspath(os.fspath(path))
    with atomic_output(dst) as f:
        torch.save(out, f)
    return dst


# ------------------------------------------------------------------------------------------------ verify
_TOLERANCE = {"float64": 1e-7, "float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}


def _tolerance(dtype: Any, scale: float) -> float:
    """Bound on ``max |device - cpu|`` for outputs of ``dtype`` whose largest magnitude is ``scale``:
    ``rel * max(1, scale)`` with ``rel`` 1e-7 (float64), 1e-3 (float32: covers TF32 convolutions, cuDNN's default),
    1e-2 (float16), 5e-2 (bfloat16), 0 for integer and bool outputs."""
    name = _dtype_name(dtype)
    if name not in _TOLERANCE:
        return 0.0 if not ("float" in name or "complex" in name) else 1e-2 * max(1.0, scale)
    return _TOLERANCE[name] * max(1.0, scale)


def _output_tensors(out: Any) -> list[Any]:
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _output_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _output_tensors(v)]
    return []


def _forward_check(model: nn.Module, shape: Sequence[int], device: torch.device) -> ForwardCheck:
    import torch

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    fc = ForwardCheck(list(shape), _dtype_name(dtype), str(device))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).to(dtype)
    was_training = model.training
    try:
        ref_model = copy.deepcopy(model).to("cpu")
    except Exception as e:  # modules that cannot be deep-copied
        fc.error = f"could not copy the model to the CPU for the reference pass: {_first_line(e)}"
        return fc
    try:
        model.eval()
        ref_model.eval()
        with torch.no_grad():
            try:
                out = _output_tensors(model(x.to(device)))
            except Exception as e:
                fc.error = f"on {device}: {type(e).__name__}: {_first_line(e)}"
                return fc
            try:
                ref = _output_tensors(ref_model(x))
            except Exception as e:
                fc.error = f"on cpu: {type(e).__name__}: {_first_line(e)}"
                return fc
    finally:
        model.train(was_training)
    if not out:
        fc.error = "the model returned no tensor"
        return fc
    if len(out) != len(ref) or any(tuple(a.shape) != tuple(b.shape) for a, b in zip(out, ref)):
        fc.error = "the outputs on the device and on the CPU differ in number or shape"
        return fc
    fc.outputs = len(out)
    worst: tuple[float, float, float] | None = None  # (excess over tolerance, diff, tolerance)
    within = True
    for a, b in zip(out, ref):
        a = a.detach().to("cpu")
        wide = torch.complex128 if a.is_complex() else torch.float64
        a64, b64 = a.to(wide), b.to(wide)
        nan_a, nan_b = torch.isnan(a64), torch.isnan(b64)
        if not torch.equal(nan_a, nan_b):
            fc.error = "NaN in one output where the other device has a number"
            return fc
        diff = (a64 - b64).abs()[~nan_a]
        d = float(diff.max()) if diff.numel() else 0.0
        mags = b64.abs()[~nan_b]
        tol = _tolerance(a.dtype, float(mags.max()) if mags.numel() else 0.0)
        within = within and d <= tol
        if worst is None or d - tol > worst[0]:
            worst = (d - tol, d, tol)
    assert worst is not None
    fc.max_abs_diff, fc.tolerance, fc.within = worst[1], worst[2], within
    return fc


def verify(path: str | os.PathLike[str], model: nn.Module | Callable[[], nn.Module], *, device: Any = None,
           key: str | None = None, strict: bool = True, input_shape: Sequence[int] | None = None,
           trust: bool = False) -> VerifyReport:
    """Prove that checkpoint ``path`` lands intact in ``model`` on ``device``.

    ``model`` is an ``nn.Module`` or a zero-argument factory returning one. ``device`` defaults to ``cuda:0``
    when CUDA is available, else ``cpu``. Steps: ``model.to(device)``; load the file onto ``device``
    (``map_location``, ``weights_only=True`` unless ``trust``); choose the state_dict (``key`` or automatic) and
    reconcile wrapper prefixes, as :func:`load_into` with ``strict=False`` (nothing raises for a mismatch: it is
    reported); then check that every parameter and buffer is on ``device`` and that every loaded value is
    bit-identical to the checkpoint's tensor (after the dtype cast ``load_state_dict`` applies, which is
    reported). With ``input_shape`` (e.g. ``(1, 784)``), one forward pass in eval mode on a fixed-seed input
    runs on ``device`` and on a CPU copy of the model and the largest absolute difference is compared with a
    tolerance suited to the output dtype (:func:`_tolerance`).

    With ``strict=True`` missing, unexpected and shape-mismatched entries are failures; with ``strict=False``
    they are reported only. Returns a :class:`VerifyReport` (``ok`` when everything holds).

    Raises:
        UsageError: bad device, ``model`` (or what the factory returns) not an ``nn.Module``, ``key`` names no
            state_dict, bad ``input_shape``.
        UnsafeCheckpointError: the file needs globals outside the weights-only allowlist and ``trust`` is False.
        NotACheckpointError / CorruptCheckpointError / UnsupportedError: as :func:`load_checkpoint` and
            :func:`select_state_dict`.
        CkptError: the factory raised (its exception is chained), or the model's ``load_state_dict`` refused a
            value.
    """
    from torch import nn

    if not isinstance(model, nn.Module):
        if not callable(model):
            raise UsageError(f"model must be an nn.Module or a function that builds one, got {type(model).__name__}")
        factory = model
        try:
            model = factory()
        except CkptError:
            raise
        except Exception as e:
            name = getattr(factory, "__qualname__", repr(factory))
            raise CkptError(f"building the model with {name}() failed: {type(e).__name__}: {_first_line(e)}") from e
    _check_model(model)
    if input_shape is not None:
        shape = [int(s) for s in input_shape]
        if not shape or any(s <= 0 for s in shape):
            raise UsageError(f"input shape {input_shape!r}: give positive sizes such as 1,784")
    dev = resolve_device(device) if device is not None else default_device()
    model.to(dev)
    p = os.fspath(path)
    obj, saved = load_checkpoint(p, dev, trust=trust)
    done = _load_selected(model, obj, path=p, key=key, device=dev, strict=strict, prefixes="auto", saved=saved)
    del obj
    rep = VerifyReport(done.report, str(dev))
    ld = done.report

    # every parameter and buffer on the device
    params = list(model.named_parameters())
    bufs = list(model.named_buffers())
    rep.parameters, rep.buffers = len(params), len(bufs)
    rep.off_device = [[n, str(t.device)] for n, t in params + bufs if not _same_device(t.device, dev)]

    # every loaded value bit-identical to the checkpoint's tensor (after load_state_dict's cast)
    import torch

    current = model.state_dict()
    for mk, v in done.loaded.items():
        t = current.get(mk)
        if not isinstance(v, torch.Tensor) or not isinstance(t, torch.Tensor):
            continue
        rep.checked += 1
        expect = v.to(t.dtype) if v.dtype != t.dtype else v
        if not _same_bits(t, expect):
            rep.value_mismatches.append(mk)
    done.loaded.clear()

    if input_shape is not None:
        rep.forward = _forward_check(model, shape, dev)

    probs = rep.problems
    if ld.strict:
        if ld.missing:
            probs.append(f"{len(ld.missing)} model entries missing from the checkpoint")
        if ld.unexpected:
            probs.append(f"{len(ld.unexpected)} unexpected checkpoint entries")
        if ld.mismatched:
            n = len(ld.shape_groups)
            probs.append(f"shape mismatches in {n} module{'s' if n != 1 else ''} "
                         f"({', '.join(g.module or '(root)' for g in ld.shape_groups)})")
    if ld.loaded == 0:
        probs.append("nothing was loaded")
    if rep.off_device:
        probs.append(f"{len(rep.off_device)} parameters/buffers not on {dev}")
    if rep.value_mismatches:
        probs.append(f"{len(rep.value_mismatches)} loaded values differ from the checkpoint")
    if rep.forward is not None and not rep.forward.ok:
        f = rep.forward
        probs.append(f"forward pass failed ({f.error})" if f.error else
                     f"forward outputs differ from the CPU by {f.max_abs_diff:.3g} > {f.tolerance:.3g}")
    return rep
