"""Resume a training checkpoint: the model, the optimizer (its state placed where torch would have created it),
the LR scheduler and the mixed-precision GradScaler, on any device.

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ckptool.errors import UnsupportedError, UsageError
from ckptool.model.graph import is_optimizer_state
from ckptool.model.keys import OPTIMIZER_NAMES, SCALER_NAMES, SCHEDULER_NAMES
from ckptool.model.paths import get_path
from ckptool.torch_ops.annotations import DeviceLike, nn, torch  # values at run time too (get_type_hints)
from ckptool.torch_ops.load import first_line, load_for_model, load_selected
from ckptool.torch_ops.reports import TrainingState
from ckptool.torch_ops.stream import FileSpans

__all__ = ["ScalerLike", "SchedulerLike", "load_training_state", "place_optimizer_state"]



class SchedulerLike(Protocol):
    """What :func:`load_training_state` needs of a scheduler: ``load_state_dict`` (torch's ``LRScheduler``,
    ``ReduceLROnPlateau``, timm's schedulers...)."""

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


class ScalerLike(Protocol):
    """What :func:`load_training_state` needs of a gradient scaler: ``load_state_dict`` (``torch.amp.GradScaler``,
    ``torch.cuda.amp.GradScaler``, ``torch.amp.GradScaler("cpu")``)."""

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


def _is_scaler_state(obj: object) -> bool:
    """A loaded ``GradScaler.state_dict()``: a mapping with ``scale`` and ``_growth_tracker`` (an enabled
    scaler's; a disabled one saves ``{}``, accepted too so that loading it says why it cannot be used)."""
    return isinstance(obj, Mapping) and (not obj or {"scale", "_growth_tracker"} <= set(obj))


def _is_optimizer_state(obj: object) -> bool:
    """A loaded ``optimizer.state_dict()``: a mapping with ``state`` and ``param_groups``
    (:func:`ckptool.model.graph.is_optimizer_state`)."""
    return isinstance(obj, Mapping) and is_optimizer_state(obj.items())


def _find_entry(ck: Mapping[str, Any], key: str | None, names: Sequence[str], what: str, path: str,
                accept: Callable[[Any], bool]) -> tuple[str | None, Any]:
    """``(dotted key, value)`` of the entry ``key`` names (:func:`ckptool.model.paths.get_path`), else of the
    first of ``names`` whose value (or a list's first element) ``accept`` takes; ``(None, None)`` when none does.

    Raises:
        UsageError: ``key`` names nothing.
    """
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


def load_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike[str], *,
                        device: DeviceLike | None = None, scheduler: SchedulerLike | None = None,
                        model_key: str | None = None, optimizer_key: str | None = None,
                        scheduler_key: str | None = None, scaler: ScalerLike | None = None,
                        scaler_key: str | None = None, strict: bool = True, trust: bool = False) -> TrainingState:
    """Resume a training checkpoint (model, optimizer, optional LR scheduler) on ``device``, whatever device it
    was saved on.

    The model is moved to ``device`` *before* the optimizer state is loaded (moving it afterwards is what leaves
    optimizer state behind and gives "Expected all tensors to be on the same device"). The file is opened once
    (:func:`~ckptool.torch_ops.load.load_checkpoint`; a torch zip file memory-mapped) and the model's state_dict
    is streamed into the model as in :func:`~ckptool.torch_ops.load.load_into` (``model_key`` or automatic: no
    second copy of the model); every other tensor (optimizer state, extras) is then read from the file into its
    own memory on ``device`` (:meth:`~ckptool.torch_ops.stream.FileSpans.materialize`, storage sharing kept),
    so nothing returned depends on the file afterwards; then ``optimizer.load_state_dict``
    (entry ``optimizer_key`` or the first of :data:`ckptool.model.keys.OPTIMIZER_NAMES`; Lightning's
    ``optimizer_states`` list gives its first element), which casts every state tensor to its parameter's device
    and floating dtype, ``step`` excepted (``Optimizer._process_value_according_to_param_policy``). Every state
    entry (custom ones and nested containers included) is then placed by torch's own rule
    (:func:`place_optimizer_state`). Then ``scheduler.load_state_dict`` (``scheduler_key`` or
    :data:`ckptool.model.keys.SCHEDULER_NAMES`), and ``scaler.load_state_dict`` for a ``torch.amp.GradScaler``
    (``scaler_key`` or the first of :data:`SCALER_NAMES` holding a GradScaler state: ``scale``,
    ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``).

    Returns a :class:`~ckptool.torch_ops.reports.TrainingState` (the model's ``LoadReport``, ``epoch``,
    ``global_step``, the keys used and every other top-level entry in ``extra``).

    Raises:
        StateDictMismatchError: ``strict`` and the model's state_dict does not fit.
        UsageError: bad device; no optimizer (or scheduler, or scaler) state found, or it does not match the
            optimizer (different number of parameter groups or parameters); the scaler state is empty (saved from
            a disabled GradScaler) or does not fit ``scaler``.
        UnsupportedError: the file is not a dict (not a training checkpoint: use ``load_into``), or it holds
            no state_dict.
        UnsafeCheckpointError / NotACheckpointError / CorruptCheckpointError: as ``load_checkpoint``.
        CkptError: the model's own ``load_state_dict`` refused a value.
    """
    with FileSpans() as spans:
        p, dev, ck, saved = load_for_model(model, path, device, trust=trust, spans=spans)
        if not isinstance(ck, Mapping):
            raise UnsupportedError(f"{p} holds a {type(ck).__name__}, not a training checkpoint dict; load it "
                                   "with ckptool.load_into(model, path)")
        done = load_selected(model, ck, path=p, key=model_key, device=dev, strict=strict, prefixes="auto",
                             saved=saved, spans=spans)
        ck = spans.materialize(ck, dev, skip=done.source)
    if strict:
        done.report.raise_for_errors()
    used = {done.report.key.split(".")[0]} if done.report.key else set()

    opt_key = sched_key = None
    if optimizer is not None:
        opt_key = _load_optimizer(optimizer, ck, optimizer_key, p)
        used.add(opt_key.split(".")[0])
    if scheduler is not None:
        sched_key = _load_scheduler(scheduler, ck, scheduler_key, p)
        used.add(sched_key.split(".")[0])
    if scaler is not None:
        used.add(_load_scaler(scaler, ck, scaler_key, p))

    extra = {k: v for k, v in ck.items() if k not in used}
    epoch = _as_int(ck.get("epoch"))
    step = next((_as_int(ck.get(n)) for n in ("global_step", "step", "iteration", "iter") if n in ck), None)
    return TrainingState(done.report, epoch, step, opt_key, sched_key, extra)


def _load_optimizer(optimizer: torch.optim.Optimizer, ck: Mapping[str, Any], key: str | None, path: str) -> str:
    """Load the optimizer state of ``ck`` (entry ``key``, else the first of :data:`OPTIMIZER_NAMES`) into
    ``optimizer`` and place its tensors (:func:`place_optimizer_state`); return the dotted key it came from.

    Raises:
        UsageError: no optimizer state, or one ``optimizer`` refuses (other groups or parameters).
    """
    found, state = _find_entry(ck, key, OPTIMIZER_NAMES, "optimizer state", path, _is_optimizer_state)
    if found is None or not _is_optimizer_state(state):
        raise UsageError(f"{path}: no optimizer state_dict (a dict with 'state' and 'param_groups') found"
                         + (f" at {key!r}" if key else "")
                         + f"; top-level keys: {', '.join(map(str, list(ck)[:20]))}; pass optimizer_key=")
    stray = _stray_state_keys(state)
    if stray:  # torch would keep them under those keys, for no parameter: the state silently lost
        raise UsageError(f"{path}: the optimizer state at {found!r} holds state under {repr(stray[:5])[:200]}, "
                         "no parameter index of its param_groups: torch would attach it to no parameter (a DCP "
                         "folder, for one, stores optimizer.state_dict()'s keys as strings); save the optimizer with "
                         "torch.distributed.checkpoint.state_dict.get_state_dict and load it with set_state_dict")
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as e:
        raise UsageError(f"{path}: the optimizer state at {found!r} does not fit this optimizer: {first_line(e)}; "
                         "build the optimizer over the same parameters, in the same groups, as when it was "
                         "saved") from e
    place_optimizer_state(optimizer)
    return found


def _stray_state_keys(state: Mapping[str, Any]) -> list[Any]:
    """The keys of an optimizer state_dict's ``state`` that are no parameter index of its ``param_groups``:
    ``Optimizer.load_state_dict`` keeps their state under those keys, attached to no parameter."""
    groups, st = state.get("param_groups"), state.get("state")
    if not isinstance(groups, (list, tuple)) or not isinstance(st, Mapping):
        return []  # load_state_dict itself names what is wrong
    ids = {i for g in groups if isinstance(g, Mapping) for i in (g.get("params") or ()) if type(i) is int}
    return [k for k in st if not (type(k) is int and k in ids)]


def _load_scheduler(scheduler: SchedulerLike, ck: Mapping[str, Any], key: str | None, path: str) -> str:
    """Load the LR scheduler state of ``ck`` (entry ``key``, else the first of :data:`SCHEDULER_NAMES`) into
    ``scheduler``; return the dotted key it came from.

    Raises:
        UsageError: no scheduler state.
    """
    found, state = _find_entry(ck, key, SCHEDULER_NAMES, "scheduler state", path, lambda v: isinstance(v, Mapping))
    if found is None or state is None:
        raise UsageError(f"{path}: no scheduler state found (looked for {', '.join(SCHEDULER_NAMES)}); "
                         "pass scheduler_key=")
    scheduler.load_state_dict(state)
    return found


def _load_scaler(scaler: ScalerLike, ck: Mapping[str, Any], key: str | None, path: str) -> str:
    """Load the GradScaler state of ``ck`` (entry ``key``, else the first of :data:`SCALER_NAMES`) into
    ``scaler``; return the top-level key it came from.

    Raises:
        UsageError: no scaler state, an empty one (saved from a disabled scaler), or one ``scaler`` refuses.
    """
    found, state = _find_entry(ck, key, SCALER_NAMES, "GradScaler state", path, _is_scaler_state)
    if found is None or not _is_scaler_state(state):
        raise UsageError(f"{path}: no GradScaler state_dict (a dict with 'scale' and '_growth_tracker') found"
                         + (f" at {key!r}" if key else f" (looked for {', '.join(SCALER_NAMES)})")
                         + f"; top-level keys: {', '.join(map(str, list(ck)[:20]))}; pass scaler_key=, or leave "
                         "scaler= out to start from a fresh scale")
    if not state:
        raise UsageError(f"{path}: the GradScaler state at {found!r} is empty: it was saved from a disabled "
                         "GradScaler (enabled=False); leave scaler= out to start from a fresh scale")
    try:
        scaler.load_state_dict(dict(state))
    except (RuntimeError, KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{path}: the GradScaler state at {found!r} does not fit this scaler: "
                         f"{first_line(e)}") from e
    return found.split(".")[0]


def _as_int(v: object) -> int | None:
    """``v`` as an int when it is a finite number or a one-element tensor holding one, else None."""
    try:
        import torch

        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None
    except (TypeError, ValueError):
        return None


def place_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Move every tensor of ``optimizer.state`` where torch would have created it; return how many moved.

    ``step`` (a 0-dim tensor) goes to the CPU unless its group is ``fused`` or ``capturable``, in which case it
    goes to the parameter's device (torch's ``Adam``/``AdamW``/``Adagrad``... create it there, and
    ``Optimizer.load_state_dict`` casts it so); every other tensor, in nested dicts, lists and tuples too, goes to
    its parameter's device. Values and dtypes are kept.
    """
    import torch

    moved = 0

    def place(v: Any, p: torch.Tensor, k: object, on_device_step: bool) -> Any:
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
