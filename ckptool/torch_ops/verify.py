"""Prove that a checkpoint lands intact in a model on a device: :func:`verify` (``ckptool verify``) loads it into
a freshly built model and checks that every parameter and buffer is on the device, that every value is
bit-identical to the checkpoint's tensor (dtype casts reported), and optionally that one forward pass matches the
CPU's within a tolerance suited to the output dtype.

Importing this module does not import torch; each function imports it when called.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence

from ckptool._deprecate import model_first
from ckptool.errors import CkptError, UsageError
from ckptool.torch_ops.annotations import DeviceLike, nn, torch  # values at run time too (get_type_hints)
from ckptool.torch_ops.devices import default_device, same_device
from ckptool.torch_ops.load import Loaded, check_model, first_line, load_for_model, load_selected, same_bits
from ckptool.torch_ops.reports import ForwardCheck, VerifyReport, dtype_name
from ckptool.torch_ops.stream import FileSpans

__all__ = ["verify"]

_TOLERANCE = {"float64": 1e-7, "float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}


def _tolerance(dtype: torch.dtype, scale: float) -> float:
    """Bound on ``max |device - cpu|`` for outputs of ``dtype`` whose largest magnitude is ``scale``:
    ``rel * max(1, scale)`` with ``rel`` 1e-7 (float64), 1e-3 (float32: covers TF32 convolutions, cuDNN's default),
    1e-2 (float16), 5e-2 (bfloat16), 0 for integer and bool outputs."""
    name = dtype_name(dtype)
    if name not in _TOLERANCE:
        return 0.0 if not ("float" in name or "complex" in name) else 1e-2 * max(1.0, scale)
    return _TOLERANCE[name] * max(1.0, scale)


def _output_tensors(out: object) -> list[torch.Tensor]:
    """Every tensor in a model's output (a tensor, or mappings, lists and tuples of them), in order."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _output_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _output_tensors(v)]
    return []


def _forward_check(model: nn.Module, shape: Sequence[int], device: torch.device) -> ForwardCheck:
    """One forward pass of ``model`` on ``device`` and of a CPU copy on the same fixed-seed input, compared (see
    :class:`~ckptool.torch_ops.reports.ForwardCheck`); failures are reported in it, never raised."""
    import torch

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    fc = ForwardCheck(list(shape), dtype_name(dtype), str(device))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).to(dtype)
    was_training = model.training
    try:
        ref_model = copy.deepcopy(model).to("cpu")
    except Exception as e:  # modules that cannot be deep-copied
        fc.error = f"could not copy the model to the CPU for the reference pass: {first_line(e)}"
        return fc
    try:
        model.eval()
        ref_model.eval()
        with torch.no_grad():
            try:
                out = _output_tensors(model(x.to(device)))
            except Exception as e:
                fc.error = f"on {device}: {type(e).__name__}: {first_line(e)}"
                return fc
            try:
                ref = _output_tensors(ref_model(x))
            except Exception as e:
                fc.error = f"on cpu: {type(e).__name__}: {first_line(e)}"
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
    for got, b in zip(out, ref):
        a = got.detach().to("cpu")
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


@model_first
def verify(model: nn.Module | Callable[[], nn.Module], path: str | os.PathLike[str], *,
           device: DeviceLike | None = None, key: str | None = None, strict: bool = True,
           input_shape: Sequence[int] | None = None, trust: bool = False,
           max_expand: float | None = None) -> VerifyReport:
    """Prove that checkpoint ``path`` lands intact in ``model`` on ``device``.

    The model comes first, as in :func:`load_into` and torch's ``model.load_state_dict(state_dict)``; the order of
    ckptool 0.1, ``verify(path, model)``, still works with a ``DeprecationWarning`` until ckptool 0.3.
    ``model`` is an ``nn.Module`` or a zero-argument factory returning one. ``device`` defaults to ``cuda:0``
    when CUDA is available, else ``cpu``. Steps: ``model.to(device)``; load the file onto ``device``
    (``map_location``, ``weights_only=True`` unless ``trust``); choose the state_dict (``key`` or automatic) and
    reconcile wrapper prefixes, as :func:`load_into` with ``strict=False`` (nothing raises for a mismatch: it is
    reported); then check that every parameter and buffer is on ``device`` and that every loaded value is
    bit-identical to the checkpoint's tensor (after the dtype cast ``load_state_dict`` applies, which is
    reported); a model entry absent from the file because it is tied to a loaded one (``LoadReport.tied``) is
    not missing, and is compared with what its partner was given. With ``input_shape`` (e.g. ``(1, 784)``), one
    forward pass in eval mode on a fixed-seed input runs on ``device`` and on a CPU copy of the model and the
    largest absolute difference is compared with a tolerance suited to the output dtype (:func:`_tolerance`).

    With ``strict=True`` missing, unexpected and shape-mismatched entries are failures; with ``strict=False``
    they are reported only. ``max_expand``: as :func:`load_into` (a DCP folder's tensors bounded by what its
    records hold, :mod:`ckptool.readers.budget`). Returns a :class:`VerifyReport` (``ok`` when everything holds).

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
            raise CkptError(f"building the model with {name}() failed: {type(e).__name__}: {first_line(e)}") from e
    check_model(model)
    if input_shape is not None:
        shape = [int(s) for s in input_shape]
        if not shape or any(s <= 0 for s in shape):
            raise UsageError(f"input shape {input_shape!r}: give positive sizes such as 1,784")
    with FileSpans() as spans:
        p, dev, obj, saved = load_for_model(model, path, default_device() if device is None else device,
                                            trust=trust, spans=spans, key=key, max_expand=max_expand)
        done = load_selected(model, obj, path=p, key=key, device=dev, strict=strict, prefixes="auto", saved=saved,
                             spans=spans)
        del obj
        rep = _check(model, done, dev)
    if input_shape is not None:
        rep.forward = _forward_check(model, shape, dev)
    return _problems(rep)


def _check(model: nn.Module, done: Loaded, dev: torch.device) -> VerifyReport:
    """The device and value checks of :func:`verify`: every parameter and buffer on ``dev``, every loaded value
    bit-identical to the checkpoint's (read back from the file :data:`~ckptool.torch_ops.stream.CHUNK` at a time
    when it was streamed, so the check needs no second copy of the model either)."""
    rep = VerifyReport(done.report, str(dev))
    ld = done.report

    # every parameter and buffer on the device
    params = list(model.named_parameters())
    bufs = list(model.named_buffers())
    rep.parameters, rep.buffers = len(params), len(bufs)
    rep.off_device = [[n, str(t.device)] for n, t in params + bufs if not same_device(t.device, dev)]

    # every loaded value bit-identical to the checkpoint's tensor (after load_state_dict's cast)
    import torch

    current = model.state_dict()
    tied = [(m, done.loaded[k]) for m, k in ld.tied.items()
            if k in done.loaded and tuple(current[m].shape) == tuple(done.loaded[k].shape)]
    for mk, v in [*done.loaded.items(), *tied]:  # a tied entry must hold what its partner was given
        t = current.get(mk)
        if not isinstance(v, torch.Tensor) or not isinstance(t, torch.Tensor):
            continue
        rep.checked += 1
        same = done.spans.same_bits(t, v) if done.spans is not None else None
        if same is None:
            same = same_bits(t, v.to(t.dtype) if v.dtype != t.dtype else v)
        if not same:
            rep.value_mismatches.append(mk)
    done.loaded.clear()
    return rep


def _problems(rep: VerifyReport) -> VerifyReport:
    """``rep`` with its ``problems`` listed (what makes it not ``ok``)."""
    ld = rep.load
    dev = rep.device
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
