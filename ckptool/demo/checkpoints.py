"""The checkpoint files of the demo: saved three ways, re-tagged for a GPU this machine lacks, fixed, resumed.

Each function is one step of the portability story of :mod:`ckptool.demo` and calls the ckptool operation a user
would (:func:`ckptool.remap`, :func:`ckptool.strip_dataparallel`, :func:`ckptool.extract_state_dict`,
:func:`ckptool.load_training_state`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptool.demo.training import Split, Trained, accuracy, bare_model, make_optimizer, predict, train_one_epoch
from ckptool.ops.extract import extract_state_dict
from ckptool.ops.rewrite.prefixes import strip_dataparallel
from ckptool.ops.rewrite.remap import remap
from ckptool.torch_ops.reports import TrainingState
from ckptool.torch_ops.training import load_training_state

#: the files the demo writes under ``--out`` are ``<STEM>.<kind>[.<stage>].pt`` for each kind of ``KINDS``
STEM = "digits_mlp"
KINDS = ("state_dict", "full_model", "checkpoint")


def save_three_ways(trained: Trained, out: Path) -> dict[str, Path]:
    """``torch.save`` the trained model into ``out`` as real projects do; returns kind -> path:

    ``state_dict`` (``model.state_dict()`` of the DataParallel wrapper: keys ``module.*``), ``full_model``
    (``torch.save(model)``: the pickled ``nn.DataParallel`` object and its ``DigitsMLP``), ``checkpoint`` (a dict
    with ``epoch``, ``model_state_dict``, ``optimizer_state_dict``, ``scheduler_state_dict``, ``loss``).
    Tensors are saved on the training device, so their location tags name it.
    """
    paths = {k: out / f"{STEM}.{k}.pt" for k in KINDS}
    torch.save(trained.model.state_dict(), paths["state_dict"])
    torch.save(trained.model, paths["full_model"])
    torch.save({
        "epoch": len(trained.losses),
        "model_state_dict": trained.model.state_dict(),
        "optimizer_state_dict": trained.optimizer.state_dict(),
        "scheduler_state_dict": trained.scheduler.state_dict(),
        "loss": trained.losses[-1] if trained.losses else None,
    }, paths["checkpoint"])
    return paths


def missing_gpu_tag() -> str:
    """A CUDA location tag this machine cannot restore: ``cuda:1`` without CUDA or with one GPU, else
    ``cuda:<device_count>``. ``torch.load`` needs a device for every tag it restores without ``map_location``
    (``default_restore_location`` / ``validate_cuda_device`` in torch/serialization.py)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"cuda:{max(1, n)}"


def make_received_copies(paths: dict[str, Path], tag: str) -> dict[str, Path]:
    """``ckptool.remap(src, dst, to=tag)`` for each file: the copies a user receives from a machine that saved on
    ``tag``. Returns kind -> path (``<stem>.<kind>.<tag without colon>.pt``).

    Raises:
        CkptError: from :func:`ckptool.remap` (not expected for files written by :func:`save_three_ways`).
    """
    out = {}
    for kind, src in paths.items():
        dst = src.with_name(f"{STEM}.{kind}.{tag.replace(':', '')}.pt")
        remap(src, dst, to=tag)
        out[kind] = dst
    return out


def plain_load_error(path: Path) -> str | None:
    """The message of the exception ``torch.load(path, weights_only=True)`` raises, or ``None`` if it loads."""
    try:
        torch.load(path, weights_only=True)
    except Exception as e:  # the point is to show whatever torch raises
        return f"{type(e).__name__}: {e}"
    return None


def fix_file(received: Path, kind: str) -> tuple[Path, Path]:
    """Make ``received`` portable in two rewrites, neither of which needs torch or a GPU:
    ``ckptool.remap(received, <stem>.<kind>.cpu.pt, to="cpu")`` re-tags every storage for the CPU, then
    ``ckptool.strip_dataparallel(cpu, <stem>.<kind>.portable.pt)`` removes ``module.`` from the model's keys
    (for the full-model pickle it removes the ``nn.DataParallel`` object itself). Returns ``(cpu, portable)``.

    Raises:
        CkptError: from :func:`ckptool.remap` or :func:`ckptool.strip_dataparallel` (for instance
            ``PrefixNotFoundError`` when no key carries ``module.``).
    """
    cpu = received.with_name(f"{STEM}.{kind}.cpu.pt")
    portable = received.with_name(f"{STEM}.{kind}.portable.pt")
    remap(received, cpu, to="cpu")
    strip_dataparallel(cpu, portable)
    return cpu, portable


def extract_fix(full_model: Path) -> Path:
    """The fix for a pickled model that ``verify`` refuses without trust: ``ckptool.extract_state_dict(full_model,
    <stem>.full_model.state_dict.pt)`` writes its state_dict, read from the pickle without importing or running
    its classes. Returns the path written."""
    out = full_model.with_name(f"{STEM}.full_model.state_dict.pt")
    extract_state_dict(full_model, out)
    return out


def load_plain(model: nn.Module, path: Path, key: str | None = None) -> None:
    """What a user does with a portable file, with torch alone: ``model.load_state_dict(torch.load(path,
    weights_only=True)[key])`` (strict; no ``map_location``: the file's CPU tags load anywhere and
    ``load_state_dict`` copies the values onto the model's device)."""
    obj = torch.load(path, weights_only=True)
    model.load_state_dict(obj[key] if key else obj)


def resume(path: Path, split: Split, device: torch.device, seed: int) -> dict[str, Any]:
    """Rebuild a bare :class:`DigitsMLP`, Adam and StepLR on ``device``, restore them from the training
    checkpoint ``path`` with ``ckptool.load_training_state`` and train one more epoch.

    Returns ``epoch`` and ``loss`` as saved, ``loss_after`` (mean loss of the extra epoch), ``lr`` (after the
    scheduler step), ``state_device`` (where the restored Adam state lives) and ``accuracy`` (held-out, 0..1).

    Raises:
        CkptError: from :func:`ckptool.load_training_state` (a model, optimizer or scheduler state that does not
            fit, an unreadable file).
    """
    model = bare_model(device)
    opt, sched = make_optimizer(model)
    state = load_training_state(model, opt, path, device=device, scheduler=sched)
    epoch, loss = _saved_progress(state)
    loss_after = train_one_epoch(model, opt, sched, split, device, torch.Generator().manual_seed(seed + epoch))
    st: dict[str, Any] = next(iter(opt.state.values()), {})
    return {"epoch": epoch, "loss": loss, "loss_after": loss_after, "lr": opt.param_groups[0]["lr"],
            "state_device": str(st["exp_avg"].device) if "exp_avg" in st else "-",
            "accuracy": accuracy(predict(model, split.x_test, device), split.y_test)}


def _saved_progress(state: TrainingState) -> tuple[int, float]:
    """``(epoch, loss)`` from a :class:`ckptool.torch_ops.reports.TrainingState` (``loss`` NaN when the file has
    none)."""
    loss = state.extra.get("loss")
    return int(state.epoch or 0), float(loss) if loss is not None else float("nan")
