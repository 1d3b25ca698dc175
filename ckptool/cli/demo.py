"""The ``ckptool demo`` command: train, save, break and fix a checkpoint on this machine (see :mod:`ckptool.demo`).

:mod:`ckptool.demo` imports torch; this module is imported only when the command runs (:data:`ckptool.cli.COMMANDS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckptool.cli._common import emit_json, is_quiet, json_option, muted_stdout, progress_wanted

if TYPE_CHECKING:
    from ckptool.demo.run import DemoResult


@click.command("demo")
@click.option("--out", "out", type=click.Path(file_okay=False), metavar="DIR",
              help="Folder for every file the demo writes (created if missing). Default: a new temporary folder.")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda:N",
              help="Where to train: auto picks the current CUDA device when there is one, else the CPU.")
@click.option("--epochs", default=30, show_default=True, type=click.IntRange(min=1), help="Training epochs.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seeds the train/held-out split, the initial weights and the batch order.")
@json_option("demo")
def demo_cmd(out: str | None, device: str, epochs: int, seed: int, as_json: bool) -> None:
    """Train a small digit classifier and walk the whole checkpoint portability story with it.

    Trains a 64-128-64-10 MLP wrapped in nn.DataParallel on the bundled UCI 8x8 handwritten digits (no
    download), saves it three ways (state_dict, full model, training checkpoint), inspects the files, shows the
    error a plain torch.load raises for a file saved on a GPU this machine lacks, fixes it with remap and
    strip-dataparallel, verifies it into a bare model with identical predictions, and resumes training from the
    checkpoint with load_training_state. Runs in seconds on a CPU; uses a GPU when there is one.

    \b
    Examples:
      ckptool demo
      ckptool demo --out demo-files --device cpu --epochs 10
    """
    # deferred: ckptool.demo imports torch, and `ckptool demo --help` works without it (torch-free install)
    from ckptool.demo import run_demo  # noqa: PLC0415

    quiet = is_quiet() or as_json
    if as_json:
        with muted_stdout():
            res = run_demo(out=out, device=device, epochs=epochs, seed=seed, quiet=True, progress_bar=False)
        emit_json("demo", _payload(res))
        return
    run_demo(out=out, device=device, epochs=epochs, seed=seed, quiet=quiet, progress_bar=progress_wanted())


def _payload(res: DemoResult) -> dict[str, Any]:
    """The ``ckptool.demo/1`` fields: ``out``, ``device``, ``accuracy`` (0..1), ``losses`` per epoch, the files
    written by kind (``saved``, ``received``, ``remapped``, ``portable``: ``{kind: path}``), ``gpu_tag``,
    ``plain_load_error``, ``n_test``, ``matches``, ``verified``, ``resumed``, ``summary`` (one object per row of
    the summary table) and ``seconds``."""
    from ckptool.demo.run import SUMMARY_HEADERS  # noqa: PLC0415 - deferred with run_demo (torch)

    files = {name: {k: str(p) for k, p in getattr(res, name).items()}
             for name in ("saved", "received", "remapped", "portable")}
    return {"out": str(res.out), "device": res.device, "accuracy": res.accuracy, "losses": res.losses, **files,
            "gpu_tag": res.gpu_tag, "plain_load_error": res.plain_load_error, "n_test": res.n_test,
            "matches": res.matches, "verified": res.verified, "resumed": res.resumed,
            "summary": [dict(zip(SUMMARY_HEADERS, row, strict=False)) for row in res.rows],
            "seconds": res.seconds}
