"""The demo's data, model and training loop: the bundled UCI digits, :class:`DigitsMLP`, Adam + StepLR.

Everything here runs in torch: the data are read with ``gzip`` + ``csv`` from the package
(``ckptool/demo/data``, licence in ``LICENSE-digits.txt``), nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from torch import nn

from ckptool.errors import CkptError, UsageError

DATA_PACKAGE = "ckptool.demo.data"
DATA_FILE = "digits.csv.gz"
N_CLASSES = 10
IMAGE_SHAPE = (8, 8)
PIXEL_MAX = 16.0  # digits.rst: "8x8 image of integer pixels in the range 0..16"


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

    Pickled (``torch.save(model)``) as ``ckptool.demo.DigitsMLP``, its public name, whichever module defines it.
    """

    __module__ = "ckptool.demo"

    def __init__(self, hidden: Sequence[int] = (128, 64)) -> None:
        super().__init__()
        sizes = [IMAGE_SHAPE[0] * IMAGE_SHAPE[1], *hidden]
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], N_CLASSES))
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.linear_relu_stack(self.flatten(x))
        return logits


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


def wrap_data_parallel(model: nn.Module, device: torch.device) -> nn.DataParallel[nn.Module]:
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


# ---------------------------------------------------------------------------------------------------- training
@dataclass
class Trained:
    """What :func:`train` produced: the wrapped model on ``device`` (eval mode), its optimizer and scheduler, the
    mean training loss of each epoch, and the held-out accuracy (0..1)."""

    model: nn.DataParallel[nn.Module]
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
    logits: torch.Tensor = model(x.to(device))
    return logits.cpu()


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction (0..1) of rows whose argmax equals the label."""
    return float((logits.argmax(1) == labels).float().mean().item())


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
        for _ in it:  # one epoch at a time: the progress bar shows losses[-1] as each one ends
            losses.append(train_one_epoch(model, opt, sched, split, device, gen))  # noqa: PERF401
    acc = accuracy(predict(model, split.x_test, device), split.y_test)
    return Trained(model, opt, sched, device, losses, acc)


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
