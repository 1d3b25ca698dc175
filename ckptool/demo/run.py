"""The demo's run: :func:`run_demo` walks the seven steps of :mod:`ckptool.demo` (:class:`DemoRun`, one method
each) and prints each as a headed section (:class:`Printer`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import torch
from tabulate import tabulate

from ckptool.demo.checkpoints import (
    KINDS,
    extract_fix,
    fix_file,
    load_plain,
    make_received_copies,
    missing_gpu_tag,
    plain_load_error,
    resume,
    save_three_ways,
)
from ckptool.demo.training import (
    IMAGE_SHAPE,
    Trained,
    bare_model,
    digits_split,
    predictions_match,
    resolve_device,
    train,
)
from ckptool.errors import UnsafeCheckpointError, UsageError
from ckptool.ops.inspect.entry import CheckpointInfo, inspect
from ckptool.torch_ops.verify import verify


class Printer:
    """Prints the demo's sections through ``echo`` (``click.echo``): ``section`` a numbered heading and what the
    step does, ``commands`` the equivalent ``$ ckptool ...`` lines and ``>>> python`` calls, ``result`` indented
    results. ``quiet=True`` drops everything except lines printed with ``force=True``; ``silent=True`` drops
    everything."""

    def __init__(self, quiet: bool = False, echo: Callable[..., None] = click.echo, silent: bool = False) -> None:
        self.quiet = quiet or silent
        self.silent = silent
        self._echo = echo

    def line(self, text: str = "", force: bool = False, **style: Any) -> None:
        if not self.silent and (force or not self.quiet):
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


# ---------------------------------------------------------------------------------------------------- the run
def _tags(info: CheckpointInfo) -> str:
    return ", ".join(sorted(info.devices)) or "-"


def _prefixes(info: CheckpointInfo) -> str:
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
    ``module.``); ``extracted`` the full model's state_dict (the fix for verify's refusal of the pickled model);
    ``plain_load_error`` what ``torch.load`` raised for the received state_dict; ``matches`` kind -> held-out
    predictions equal to the trained model's (of ``n_test``); ``resumed`` see :func:`resume`;
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
    extracted: Path | None = None
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
                        ("torch.save({'epoch': ..., 'model_state_dict': ..., 'optimizer_state_dict': ..., "
                         f"'scheduler_state_dict': ..., 'loss': ...}}, {saved['checkpoint'].name!r})")])
        for path in saved.values():
            p.result(f"{path.name:30} {path.stat().st_size:>8,} bytes")

    def inspect(self) -> None:
        """Step 3: :func:`ckptool.inspect` each saved file; print a table with its unsafe globals."""
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
                   [f"ckptool.remap({saved['state_dict'].name!r}, {rec['state_dict'].name!r}, to={tag!r})",
                    f"torch.load({rec['state_dict'].name!r})"])
        err = self.res.plain_load_error = plain_load_error(rec["state_dict"])
        p.result(err or "(it loaded: this machine has that GPU)", fg="red" if err else None)

    def fix(self) -> None:
        """Step 5: :func:`fix_file` each received copy, :func:`ckptool.verify` it into :func:`bare_model`, compare
        predictions (:func:`predictions_match`) and load the fixed state_dict with plain torch (:func:`load_plain`)."""
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
                   [f"ckptool.remap({rec['state_dict'].name!r}, {sd_cpu.name!r}, to='cpu')",
                    f"ckptool.strip_dataparallel({sd_cpu.name!r}, {sd.name!r})",
                    f"ckptool.verify(DigitsMLP().to({str(dev)!r}), {sd.name!r}, device={str(dev)!r}"
                    + (f", input_shape={shape})" if shape else ")")])
        for kind, key in (("state_dict", None), ("checkpoint", "model_state_dict"), ("full_model", None)):
            path = self.res.portable[kind]
            try:
                self._verify(kind, path, key, shape)
            except UnsafeCheckpointError:
                # the full model: verify will not unpickle its classes without trust=True (project rule 1); the
                # fix it recommends, shown: its state_dict extracted without running it, then verified
                fixed = self.res.extracted = extract_fix(path)
                p.result(f"{path.name}: a pickled model; verify refuses to import and run its classes without "
                         "trust=True.\nThe fix: extract its state_dict without running anything, then verify that:",
                         fg="yellow")
                p.commands([f"ckptool extract-state-dict {path.name} -o {fixed.name}",
                            f"ckptool verify {fixed.name} --model ckptool.demo:DigitsMLP --device {dev}"],
                           f"ckptool.extract_state_dict({path.name!r}, {fixed.name!r})")
                self._verify(kind, fixed, None, shape, "after extract-state-dict ")
        model = bare_model(dev)
        load_plain(model, sd)
        same, _ = predictions_match(self.trained, model, self.split)
        p.commands([], f"model.load_state_dict(torch.load({sd.name!r}))   # plain torch, strict")
        p.result(f"loads strictly with plain torch: {same}/{n} held-out predictions match")

    def _verify(self, kind: str, path: Path, key: str | None, shape: tuple[int, ...] | None, how: str = "") -> None:
        """:func:`ckptool.verify` ``path`` into a fresh bare model, compare its held-out predictions with the trained
        model's and print both; ``how`` prefixes the summary's "verified" cell."""
        assert self.trained is not None
        model, n = bare_model(self.device), self.res.n_test
        report = verify(model, path, device=self.device, key=key, input_shape=shape)
        same, equal = predictions_match(self.trained, model, self.split)
        self.res.matches[kind] = same
        self.res.verified[kind] = f"yes {how}({same}/{n} same predictions)" if report.ok else "FAILED"
        self.p.result(f"{report.summary()}\n  held-out predictions equal to the trained model's: {same}/{n}; "
                      f"logits bitwise equal: {'yes' if equal else 'no'}", fg=None if report.ok else "red")

    def resume(self) -> None:
        """Step 6: :func:`resume` from the received training checkpoint and print the losses."""
        p, dev, rec = self.p, self.device, self.res.received
        p.section(6, self.TOTAL, "Resume",
                  f"Continue training for one epoch on {dev} from the received {self.res.gpu_tag} training "
                  "checkpoint\n(its model_state_dict keys still carry module.).")
        p.commands([], [(f"ckptool.load_training_state(model, optimizer, {rec['checkpoint'].name!r}, "
                         f"device={str(dev)!r}, scheduler=scheduler)")])
        r = self.res.resumed = resume(rec["checkpoint"], self.split, dev, self.seed)
        p.result(f"epoch {r['epoch']} loss {r['loss']:.4f} (saved) -> epoch {r['epoch'] + 1} loss "
                 f"{r['loss_after']:.4f}; lr now {r['lr']:.2e}; Adam state on {r['state_device']}; "
                 f"held-out accuracy {r['accuracy']:.1%}")

    def summary(self) -> None:
        """Step 7: the summary table (received vs portable file of each kind), printed unless silent."""
        self.p.section(7, self.TOTAL, "Summary", "")
        for kind in KINDS:
            before, after = inspect(self.res.received[kind]), inspect(self.res.portable[kind])
            self.res.rows.append([self.res.portable[kind].name, after.format, after.kind, _tags(before),
                                  _tags(after), _prefixes(before), _prefixes(after), self.res.verified.get(kind, "-")])
        self.p.line(tabulate(self.res.rows, headers=SUMMARY_HEADERS), force=True)


def run_demo(out: str | os.PathLike[str] | None = None, device: str = "auto", epochs: int = 30, seed: int = 0,
             quiet: bool = False, echo: Callable[..., None] = click.echo, progress_bar: bool = True,
             summary_only: bool = False) -> DemoResult:
    """Run the seven steps of the module docstring, printing each as a headed section with ``echo``.

    ``out``: folder for every file written (created if missing; default a new temporary folder, named in the
    output). ``device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. ``epochs`` >= 1 (about 0.02 s each on a CPU).
    ``seed`` seeds the train/held-out split, the initial weights and the batch order. ``quiet`` prints nothing at
    all (no sections, no summary, no progress bar; read the returned :class:`DemoResult`); ``summary_only``
    prints only the summary table and the closing line (``ckptool demo --quiet``); ``progress_bar`` shows Click's
    progress bar over the epochs (never with ``quiet`` or ``summary_only``).

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
    p = Printer(summary_only, echo, silent=quiet)
    p.line(f"ckptool demo: training on {dev} for {epochs} epochs (seed {seed}); files go to {out_dir}", bold=True)
    demo = DemoRun(out_dir, dev, epochs, seed, p, progress_bar and not p.quiet)
    for step in DemoRun.STEPS:
        getattr(demo, step)()
    res = demo.res
    res.seconds = time.perf_counter() - t0
    p.line("")
    p.line(f"Done in {res.seconds:.1f} s. Held-out accuracy {res.accuracy:.1%}. Files: {out_dir}", force=True)
    p.line(f"Next: ckptool inspect {res.received['state_dict']}")
    return res
