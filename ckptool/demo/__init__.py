"""``ckptool.demo``: train a small classifier, save it the ways real projects do, and walk the portability story.

The steps (each a function here, printed by :func:`run_demo` as a short headed section):

1. :func:`train`: a 64-128-64-10 MLP in the style of the PyTorch quickstart (``nn.Flatten`` + a
   ``linear_relu_stack``), wrapped in ``nn.DataParallel`` so its state_dict keys carry ``module.``, trained with
   ``nn.CrossEntropyLoss``, ``torch.optim.Adam`` and ``torch.optim.lr_scheduler.StepLR`` on the bundled UCI
   handwritten digits (8x8, 1797 samples; ``ckptool/demo/data/LICENSE-digits.txt``).
2. :func:`save_three_ways`: ``torch.save`` of ``model.state_dict()``, of the model object itself, and of a training
   checkpoint (``epoch``, ``model_state_dict``, ``optimizer_state_dict``, ``scheduler_state_dict``, ``loss``).
3. :func:`ckptool.inspect` on each file.
4. :func:`make_received_copies` + :func:`plain_load_error`: copies tagged for a GPU this machine lacks
   (:func:`missing_gpu_tag`), as a file saved on another machine is, and the error a plain ``torch.load`` raises.
5. :func:`fix_file`: ``ckptool.remap(..., to="cpu")`` then ``ckptool.strip_dataparallel``, then
   ``ckptool.verify`` into a fresh bare model moved with ``.to(device)``; :func:`predictions_match` compares its
   held-out predictions with the trained model's.
6. :func:`resume`: ``ckptool.load_training_state`` on the current device, then one more epoch.
7. A summary table (tabulate).

This module imports torch at import time; ``ckptool`` and ``ckptool.cli`` import it only inside the ``demo``
command. Nothing is downloaded: the data ship in the package.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import click
import torch
from torch import nn

from ckptool.errors import CkptError, UnsafeCheckpointError, UsageError

DATA_PACKAGE = "ckptool.demo.data"
DATA_FILE = "digits.csv.gz"
N_CLASSES = 10
IMAGE_SHAPE = (8, 8)
PIXEL_MAX = 16.0  # digits.rst: "8x8 image of integer pixels in the range 0..16"

#: the files the demo writes under ``--out`` are ``<STEM>.<kind>[.<stage>].pt`` for each kind of ``KINDS``
STEM = "digits_mlp"
KINDS = ("state_dict", "full_model", "checkpoint")


# ---------------------------------------------------------------------------------------------------- data
def load_digits() -> tuple[list[list[int]], list[int]]:
    """Read the bundled UCI optical-recognition digits (the copy scikit-learn ships as ``digits.csv.gz``).

    Returns ``(pixels, labels)``: 1797 rows of 64 integers 0..16 (an 8x8 image, row by row) and 1797 labels
    0..9. Read with ``gzip`` + ``csv`` only.

    Raises:
        CkptError: the bundled file is missing or malformed (a broken installation: reinstall ckptool).
    """
    try:
        raw = resources.files(DATA_PACKAGE).joinpath(DATA_FILE).read_bytes()
        text = gzip.decompress(raw).decode("ascii")
    except (OSError, ModuleNotFoundError, EOFError, UnicodeDecodeError) as e:
        raise CkptError(f"bundled data set {DATA_PACKAGE}/{DATA_FILE} is missing or damaged ({e}): "
                        "reinstall ckptool") from e
    pixels: list[list[int]] = []
    labels: list[int] = []
    for n, row in enumerate(csv.reader(text.splitlines()), 1):
        if not row:
            continue
        try:
            values = [int(float(v)) for v in row]
        except ValueError as e:
            raise CkptError(f"bundled data set {DATA_FILE} line {n} is not numeric: reinstall ckptool") from e
        if len(values) != IMAGE_SHAPE[0] * IMAGE_SHAPE[1] + 1 or not 0 <= values[-1] < N_CLASSES:
            raise CkptError(f"bundled data set {DATA_FILE} line {n} has {len(values)} values, expected 65: "
                            "reinstall ckptool")
        pixels.append(values[:-1])
        labels.append(values[-1])
    return pixels, labels


@dataclass
class Split:
    """The digits as tensors: ``x_*`` float32 ``[N, 8, 8]`` scaled to 0..1, ``y_*`` int64 ``[N]`` labels."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def digits_split(seed: int = 0, test_fraction: float = 0.2) -> Split:
    """Shuffle the bundled digits with ``torch.Generator().manual_seed(seed)`` and hold out ``test_fraction``
    of them (359 of 1797 by default) for evaluation. Tensors are on the CPU."""
    pixels, labels = load_digits()
    x = torch.tensor(pixels, dtype=torch.float32).reshape(-1, *IMAGE_SHAPE) / PIXEL_MAX
    y = torch.tensor(labels, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return Split(x[train], y[train], x[test], y[test])


# ---------------------------------------------------------------------------------------------------- model
class DigitsMLP(nn.Module):
    """A 64-128-64-10 MLP for 8x8 digit images, laid out like the PyTorch quickstart's ``NeuralNetwork``.

    Input float32 ``[N, 8, 8]`` (or ``[N, 64]``); output ``[N, 10]`` logits. Parameters (FQN):
    ``linear_relu_stack.{0,2,4}.{weight,bias}``.
    """

    def __init__(self, hidden: Sequence[int] = (128, 64)) -> None:
        super().__init__()
        sizes = [IMAGE_SHAPE[0] * IMAGE_SHAPE[1], *hidden]
        layers: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], N_CLASSES))
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_relu_stack(self.flatten(x))


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` -> the current CUDA device when ``torch.cuda.is_available()``, else ``cpu``; ``cpu``;
    ``cuda`` / ``cuda:N`` (checked against ``torch.cuda.device_count()``).

    Raises:
        UsageError: an unknown device string, or a CUDA device this machine does not have.
    """
    s = spec.strip().lower()
    if s == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if s == "cpu":
        return torch.device("cpu")
    if s == "cuda" or (s.startswith("cuda:") and s[5:].isdigit()):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: torch.cuda.is_available() is False on this machine; "
                             "use --device cpu or --device auto")
        idx = int(s[5:]) if ":" in s else torch.cuda.current_device()
        if idx >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(cuda:0..cuda:{torch.cuda.device_count() - 1}); pick one of them or --device auto")
        return torch.device("cuda", idx)
    raise UsageError(f"unknown --device {spec!r}: expected auto, cpu, cuda or cuda:N")


def wrap_data_parallel(model: nn.Module, device: torch.device) -> nn.DataParallel:
    """Wrap ``model`` in ``nn.DataParallel`` on ``device``, as multi-GPU training code does.

    On CUDA it uses ``device_ids=[device.index]``. On the CPU, ``DataParallel`` with no accelerator present keeps
    ``device_ids=[]`` and calls the module directly (``DataParallel.__init__`` / ``forward``); on a CUDA machine
    asked for the CPU the same state is set after construction. Either way the state_dict keys carry ``module.``.
    """
    if device.type == "cuda":
        return nn.DataParallel(model.to(device), device_ids=[device.index], output_device=device.index)
    if not torch.cuda.is_available():
        return nn.DataParallel(model.to(device))
    dp = nn.DataParallel(model, device_ids=[0])  # would move the module to cuda:0: undo, as on a CPU-only host
    dp.device_ids = []
    return dp.to(device)


# ---------------------------------------------------------------------------------------------------- printing
class Printer:
    """Prints the demo's sections through ``echo`` (``click.echo``): ``section`` a numbered heading and what the
    step does, ``commands`` the equivalent ``$ ckptool ...`` lines and ``>>> python`` calls, ``result`` indented
    results. ``quiet=True`` drops everything except lines printed with ``force=True``."""

    def __init__(self, quiet: bool = False, echo: Callable[..., None] = click.echo) -> None:
        self.quiet = quiet
        self._echo = echo

    def line(self, text: str = "", force: bool = False, **style: Any) -> None:
        if force or not self.quiet:
            self._echo(click.style(text, **style) if style else text)

    def section(self, n: int, total: int, title: str, what: str) -> None:
        self.line()
        self.line(f"== {n}/{total} {title} ==", bold=True)
        for ln in what.splitlines():
            self.line(ln)

    def commands(self, cli: str | Sequence[str], api: str | Sequence[str] = ()) -> None:
        for c in [cli] if isinstance(cli, str) else cli:
            self.line(f"  $ {c}", fg="cyan")
        for a in [api] if isinstance(api, str) else api:
            self.line(f"  >>> {a}", fg="cyan")

    def result(self, text: str, **style: Any) -> None:
        for ln in text.splitlines():
            self.line(f"  {ln}", **style)


# ---------------------------------------------------------------------------------------------------- steps
@dataclass
class Trained:
    """What :func:`train` produced: the wrapped model on ``device`` (eval mode), its optimizer and scheduler, the
    mean training loss of each epoch, and the held-out accuracy (0..1)."""

    model: nn.DataParallel
    optimizer: torch.optim.Optimizer
    scheduler: Any
    device: torch.device
    losses: list[float]
    accuracy: float


def make_optimizer(model: nn.Module, lr: float = 3e-3, step_size: int = 10) -> tuple[torch.optim.Optimizer, Any]:
    """``torch.optim.Adam(model.parameters(), lr)`` and ``StepLR(step_size, gamma=0.5)``, the demo's recipe."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=step_size, gamma=0.5)


def train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, split: Split,
                    device: torch.device, generator: torch.Generator, batch_size: int = 64) -> float:
    """One pass over ``split.x_train`` in shuffled mini-batches (order from ``generator``) with
    ``nn.CrossEntropyLoss``, then ``scheduler.step()``. Returns the mean loss per sample (nats)."""
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    order = torch.randperm(len(split.y_train), generator=generator)
    total = 0.0
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        x, y = split.x_train[idx].to(device), split.y_train[idx].to(device)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item() * len(idx)
    scheduler.step()
    model.eval()
    return total / len(order)


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Logits float32 ``[N, 10]`` of ``model`` (put in eval mode) for ``x`` moved to ``device``, returned on CPU."""
    model.eval()
    return model(x.to(device)).cpu()


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction (0..1) of rows whose argmax equals the label."""
    return (logits.argmax(1) == labels).float().mean().item()


def train(split: Split, device: torch.device, epochs: int, seed: int,
          progress: Callable[[range, list[float]], Any] | None = None) -> Trained:
    """Train ``nn.DataParallel(DigitsMLP())`` on ``device`` for ``epochs`` epochs, seeded with ``seed``.

    ``progress(epochs_range, losses)``, when given, returns a context manager that iterates over the epochs (the
    CLI passes Click's progress bar; ``losses`` fills in as epochs finish). Returns a :class:`Trained` with the
    held-out accuracy measured on ``split.x_test``.
    """
    torch.manual_seed(seed)
    model = wrap_data_parallel(DigitsMLP(), device)
    opt, sched = make_optimizer(model)
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    with progress(range(epochs), losses) if progress else contextlib.nullcontext(range(epochs)) as it:
        for _ in it:
            losses.append(train_one_epoch(model, opt, sched, split, device, gen))
    acc = accuracy(predict(model, split.x_test, device), split.y_test)
    return Trained(model, opt, sched, device, losses, acc)


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
    from ckptool.ops.remap import remap

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
    except Exception as e:  # noqa: BLE001 - the point is to show whatever torch raises
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
    from ckptool.ops.rename import strip_dataparallel
    from ckptool.ops.remap import remap

    cpu = received.with_name(f"{STEM}.{kind}.cpu.pt")
    portable = received.with_name(f"{STEM}.{kind}.portable.pt")
    remap(received, cpu, to="cpu")
    strip_dataparallel(cpu, portable)
    return cpu, portable


def bare_model(device: torch.device) -> DigitsMLP:
    """A fresh, unwrapped :class:`DigitsMLP` moved with ``.to(device)``, initialised from another seed than the
    trained one, so that a load which silently skipped a tensor would show in the predictions."""
    torch.manual_seed(12345)
    return DigitsMLP().to(device)


def predictions_match(trained: Trained, model: nn.Module, split: Split) -> tuple[int, bool]:
    """Compare ``model`` with the trained model on the held-out set: ``(rows whose predicted class is the same,
    whether the logits are bitwise equal)``."""
    a = predict(trained.model, split.x_test, trained.device)
    b = predict(model, split.x_test, trained.device)
    return int((a.argmax(1) == b.argmax(1)).sum()), bool(torch.equal(a, b))


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
    from ckptool.torch_ops.loading import load_training_state

    model = bare_model(device)
    opt, sched = make_optimizer(model)
    state = load_training_state(model, opt, path, device=device, scheduler=sched)
    epoch, loss = _saved_progress(state)
    loss_after = train_one_epoch(model, opt, sched, split, device, torch.Generator().manual_seed(seed + epoch))
    st = next(iter(opt.state.values()), {})
    return {"epoch": epoch, "loss": loss, "loss_after": loss_after, "lr": opt.param_groups[0]["lr"],
            "state_device": str(st["exp_avg"].device) if "exp_avg" in st else "-",
            "accuracy": accuracy(predict(model, split.x_test, device), split.y_test)}


def _saved_progress(state: Any) -> tuple[int, float]:
    """``(epoch, loss)`` from a :class:`ckptool.loading.TrainingState` (``loss`` NaN when the file has none)."""
    loss = state.extra.get("loss")
    return int(state.epoch or 0), float(loss) if loss is not None else float("nan")


# ---------------------------------------------------------------------------------------------------- the run
def _tags(info: Any) -> str:
    return ", ".join(sorted(info.devices)) or "-"


def _prefixes(info: Any) -> str:
    return " ".join(sorted({p for sd in info.state_dicts for p in sd.prefixes})) or "none"


def prepare_out(out: str | os.PathLike[str] | None) -> Path:
    """The output folder: ``out`` (created if missing) or a new ``tempfile.mkdtemp(prefix="ckptool-demo-")``.

    Raises:
        UsageError: ``out`` exists and is not a folder, or cannot be created.
    """
    if out is None:
        return Path(tempfile.mkdtemp(prefix="ckptool-demo-"))
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder; give a folder (it is created if missing)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot create the folder ({e.strerror or e}); choose another path") from e
    return p


SUMMARY_HEADERS = ["file", "format", "kind", "tags received", "tags after", "prefix received", "prefix after",
                   "verified"]


@dataclass
class DemoResult:
    """What :func:`run_demo` did.

    ``out`` the folder; ``device`` the training device; ``accuracy`` held-out accuracy (0..1) after training;
    ``losses`` the mean training loss of each epoch; kind -> path maps of the files written: ``saved`` (as
    trained), ``received`` (tagged ``gpu_tag``), ``remapped`` (tagged cpu), ``portable`` (tagged cpu, no
    ``module.``); ``plain_load_error`` what ``torch.load`` raised for the received state_dict; ``matches`` kind ->
    held-out predictions equal to the trained model's (of ``n_test``); ``resumed`` see :func:`resume`;
    ``rows`` the summary table (``SUMMARY_HEADERS``); ``seconds`` wall-clock time.
    """

    out: Path
    device: str
    accuracy: float = 0.0
    losses: list[float] = field(default_factory=list)
    saved: dict[str, Path] = field(default_factory=dict)
    gpu_tag: str = ""
    received: dict[str, Path] = field(default_factory=dict)
    plain_load_error: str | None = None
    remapped: dict[str, Path] = field(default_factory=dict)
    portable: dict[str, Path] = field(default_factory=dict)
    n_test: int = 0
    matches: dict[str, int] = field(default_factory=dict)
    verified: dict[str, str] = field(default_factory=dict)
    resumed: dict[str, Any] = field(default_factory=dict)
    rows: list[list[Any]] = field(default_factory=list)
    seconds: float = 0.0


class DemoRun:
    """The seven steps of :func:`run_demo`, one method each (named in ``STEPS``, to be called in that order),
    sharing the run's state; each prints its section and fills in ``self.res`` (a :class:`DemoResult`)."""

    STEPS = ("train", "save", "inspect", "failure", "fix", "resume", "summary")
    TOTAL = len(STEPS)

    def __init__(self, out: Path, device: torch.device, epochs: int, seed: int, p: Printer, bar: bool) -> None:
        self.device, self.epochs, self.seed, self.p, self.bar = device, epochs, seed, p, bar
        self.split = digits_split(seed)
        self.res = DemoResult(out, str(device), n_test=len(self.split.y_test))
        self.trained: Trained | None = None

    def train(self) -> None:
        """Step 1: train (:func:`train`) and print the held-out accuracy."""
        p, s, n = self.p, self.split, len(self.split.y_test)
        p.section(1, self.TOTAL, "Train",
                  f"A 64-128-64-10 MLP on the bundled UCI 8x8 handwritten digits ({len(s.y_train)} to train on, "
                  f"{n} held out),\nwrapped in nn.DataParallel as multi-GPU code does (its keys get module.).\n"
                  "CrossEntropyLoss, Adam (lr 3e-3), StepLR (halves the lr every 10 epochs).")
        p.commands([], "model = nn.DataParallel(DigitsMLP()).to(device)")

        def progress(it: Any, losses: list[float]) -> Any:
            return click.progressbar(it, label="  training", length=self.epochs, show_pos=True,
                                     item_show_func=lambda _: f"loss {losses[-1]:.3f}" if losses else None)

        t = self.trained = train(s, self.device, self.epochs, self.seed, progress if self.bar else None)
        self.res.accuracy, self.res.losses = t.accuracy, t.losses
        p.result(f"held-out accuracy {t.accuracy:.1%} ({round(t.accuracy * n)}/{n}; chance is 10%), "
                 f"final training loss {t.losses[-1]:.4f}")

    def save(self) -> None:
        """Step 2: :func:`save_three_ways` into the output folder and print the file sizes."""
        assert self.trained is not None
        p = self.p
        p.section(2, self.TOTAL, "Save", f"Save on the training device ({self.device}) the three ways real "
                                         "projects do.")
        saved = self.res.saved = save_three_ways(self.trained, self.res.out)
        p.commands([], [f"torch.save(model.state_dict(), {saved['state_dict'].name!r})",
                        f"torch.save(model, {saved['full_model'].name!r})",
                        "torch.save({'epoch': ..., 'model_state_dict': ..., 'optimizer_state_dict': ..., "
                        f"'scheduler_state_dict': ..., 'loss': ...}}, {saved['checkpoint'].name!r})"])
        for path in saved.values():
            p.result(f"{path.name:30} {path.stat().st_size:>8,} bytes")

    def inspect(self) -> None:
        """Step 3: :func:`ckptool.inspect` each saved file; print a table with its unsafe globals."""
        from tabulate import tabulate

        from ckptool.ops.inspect import inspect

        p, saved = self.p, self.res.saved
        p.section(3, self.TOTAL, "Inspect", "Read each file without running its code or importing torch.")
        p.commands([f"ckptool inspect {saved['state_dict'].name}"], "info = ckptool.inspect(path)")
        rows, full = [], []
        for path in saved.values():
            info = inspect(path)
            unsafe = info.unsafe_globals
            rows.append([path.name, info.format, info.kind, _tags(info), _prefixes(info),
                         f"{len(unsafe)}: " + ", ".join(g.rsplit(".", 1)[-1] for g in unsafe) if unsafe else "none"])
            if unsafe:
                full = unsafe
        p.result(tabulate(rows, headers=["file", "format", "kind", "devices", "prefix", "unsafe globals"]))
        if full:
            p.result(f"The full model's pickle imports classes (such as {full[0]})\nthat torch.load(weights_only=True) "
                     "refuses: loading it means running code named by the file.")

    def failure(self) -> None:
        """Step 4: :func:`make_received_copies` for :func:`missing_gpu_tag` and print :func:`plain_load_error`."""
        p, saved = self.p, self.res.saved
        tag = self.res.gpu_tag = missing_gpu_tag()
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        p.section(4, self.TOTAL, "The failure users meet",
                  f"A file saved on {tag} reaches a machine without that GPU (this one has {n_gpu} CUDA "
                  f"device{'s' if n_gpu != 1 else ''}).\nCopies re-tagged for {tag} stand in for it; then a plain "
                  "torch.load:")
        rec = self.res.received = make_received_copies(saved, tag)
        p.commands(f"ckptool remap {saved['state_dict'].name} --to {tag} -o {rec['state_dict'].name}",
                   [f"ckptool.ops.remap({saved['state_dict'].name!r}, {rec['state_dict'].name!r}, to={tag!r})",
                    f"torch.load({rec['state_dict'].name!r})"])
        err = self.res.plain_load_error = plain_load_error(rec["state_dict"])
        p.result(err or "(it loaded: this machine has that GPU)", fg="red" if err else None)

    def fix(self) -> None:
        """Step 5: :func:`fix_file` each received copy, :func:`ckptool.verify` it into :func:`bare_model`, compare
        predictions (:func:`predictions_match`) and load the fixed state_dict with plain torch (:func:`load_plain`)."""
        from ckptool.torch_ops.loading import verify

        assert self.trained is not None
        p, rec, dev, n = self.p, self.res.received, self.device, self.res.n_test
        p.section(5, self.TOTAL, "Fix it",
                  "Re-tag every storage for the CPU (a CPU file loads anywhere; .to(device) moves the model),\n"
                  "strip DataParallel's module., then verify each file into a fresh bare DigitsMLP moved with "
                  ".to(device).\nThe same two rewrites fix the full model and the training checkpoint.")
        for kind in KINDS:
            self.res.remapped[kind], self.res.portable[kind] = fix_file(rec[kind], kind)
        sd_cpu, sd = self.res.remapped["state_dict"], self.res.portable["state_dict"]
        shape = (1, *IMAGE_SHAPE) if dev.type != "cpu" else None  # off the CPU: one forward pass, dev vs CPU
        p.commands([f"ckptool remap {rec['state_dict'].name} --to cpu -o {sd_cpu.name}",
                    f"ckptool strip-dataparallel {sd_cpu.name} -o {sd.name}",
                    f"ckptool verify {sd.name} --model ckptool.demo:DigitsMLP --device {dev}"
                    + (" --input-shape " + ",".join(map(str, shape)) if shape else "")],
                   [f"ckptool.ops.remap({rec['state_dict'].name!r}, {sd_cpu.name!r}, to='cpu')",
                    f"ckptool.strip_dataparallel({sd_cpu.name!r}, {sd.name!r})",
                    f"ckptool.verify({sd.name!r}, DigitsMLP().to({str(dev)!r}), device={str(dev)!r}"
                    + (f", input_shape={shape})" if shape else ")")])
        for kind, key in (("state_dict", None), ("checkpoint", "model_state_dict"), ("full_model", None)):
            path, model = self.res.portable[kind], bare_model(dev)
            try:
                report = verify(path, model, device=dev, key=key, input_shape=shape)
            except UnsafeCheckpointError as e:
                # the full model: verify will not unpickle its classes without trust=True (project rule 1)
                self.res.verified[kind] = "no: needs trust"
                p.result(f"{path.name}: refused without trust=True, as it should be:\n  {e}", fg="yellow")
                continue
            same, equal = predictions_match(self.trained, model, self.split)
            self.res.matches[kind] = same
            self.res.verified[kind] = f"yes ({same}/{n} same predictions)" if report.ok else "FAILED"
            p.result(f"{report.summary()}\n  held-out predictions equal to the trained model's: {same}/{n}; "
                     f"logits bitwise equal: {'yes' if equal else 'no'}", fg=None if report.ok else "red")
        model = bare_model(dev)
        load_plain(model, sd)
        same, _ = predictions_match(self.trained, model, self.split)
        p.commands([], f"model.load_state_dict(torch.load({sd.name!r}))   # plain torch, strict")
        p.result(f"loads strictly with plain torch: {same}/{n} held-out predictions match")

    def resume(self) -> None:
        """Step 6: :func:`resume` from the received training checkpoint and print the losses."""
        p, dev, rec = self.p, self.device, self.res.received
        p.section(6, self.TOTAL, "Resume",
                  f"Continue training for one epoch on {dev} from the received {self.res.gpu_tag} training "
                  "checkpoint\n(its model_state_dict keys still carry module.).")
        p.commands([], [f"ckptool.load_training_state(model, optimizer, {rec['checkpoint'].name!r}, "
                        f"device={str(dev)!r}, scheduler=scheduler)"])
        r = self.res.resumed = resume(rec["checkpoint"], self.split, dev, self.seed)
        p.result(f"epoch {r['epoch']} loss {r['loss']:.4f} (saved) -> epoch {r['epoch'] + 1} loss "
                 f"{r['loss_after']:.4f}; lr now {r['lr']:.2e}; Adam state on {r['state_device']}; "
                 f"held-out accuracy {r['accuracy']:.1%}")

    def summary(self) -> None:
        """Step 7: the summary table (received vs portable file of each kind), printed even when quiet."""
        from tabulate import tabulate

        from ckptool.ops.inspect import inspect

        self.p.section(7, self.TOTAL, "Summary", "")
        for kind in KINDS:
            before, after = inspect(self.res.received[kind]), inspect(self.res.portable[kind])
            self.res.rows.append([self.res.portable[kind].name, after.format, after.kind, _tags(before),
                                  _tags(after), _prefixes(before), _prefixes(after), self.res.verified.get(kind, "-")])
        self.p.line(tabulate(self.res.rows, headers=SUMMARY_HEADERS), force=True)


def run_demo(out: str | os.PathLike[str] | None = None, device: str = "auto", epochs: int = 30, seed: int = 0,
             quiet: bool = False, echo: Callable[..., None] = click.echo, progress_bar: bool = True) -> DemoResult:
    """Run the seven steps of the module docstring, printing each as a headed section with ``echo``.

    ``out``: folder for every file written (created if missing; default a new temporary folder, named in the
    output). ``device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. ``epochs`` >= 1 (about 0.02 s each on a CPU).
    ``seed`` seeds the train/held-out split, the initial weights and the batch order. ``quiet`` prints only the
    summary table and the closing line; ``progress_bar`` shows Click's progress bar over the epochs.

    Returns a :class:`DemoResult` (paths of every file, accuracy, summary rows, seconds).

    Raises:
        UsageError: unknown or absent ``device``, ``epochs`` < 1, or an ``out`` that is not a usable folder.
        CkptError: a ckptool step failed on the demo's own files (a bug in ckptool: please report it).
    """
    t0 = time.perf_counter()
    if epochs < 1:
        raise UsageError(f"--epochs must be at least 1, got {epochs}")
    dev = resolve_device(device)
    out_dir = prepare_out(out)
    p = Printer(quiet, echo)
    p.line(f"ckptool demo: training on {dev} for {epochs} epochs (seed {seed}); files go to {out_dir}", bold=True)
    demo = DemoRun(out_dir, dev, epochs, seed, p, progress_bar and not quiet)
    for step in DemoRun.STEPS:
        getattr(demo, step)()
    res = demo.res
    res.seconds = time.perf_counter() - t0
    p.line("")
    p.line(f"Done in {res.seconds:.1f} s. Held-out accuracy {res.accuracy:.1%}. Files: {out_dir}", force=True)
    p.line(f"Next: ckptool inspect {res.received['state_dict']}")
    return res
