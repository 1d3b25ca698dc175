"""The ``ckptool demo`` command: train, save, break and fix a checkpoint on this machine (see :mod:`ckptool.demo`).

:mod:`ckptool.demo` imports torch; this module is imported only when the command runs (:data:`ckptool.cli.COMMANDS`).
"""

from __future__ import annotations

import click

from ckptool.demo import run_demo


@click.command("demo")
@click.option("--out", "out", type=click.Path(file_okay=False), metavar="DIR",
              help="Folder for every file the demo writes (created if missing). Default: a new temporary folder.")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda:N",
              help="Where to train: auto picks the current CUDA device when there is one, else the CPU.")
@click.option("--epochs", default=30, show_default=True, type=click.IntRange(min=1), help="Training epochs.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seeds the train/held-out split, the initial weights and the batch order.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the summary table and the output folder.")
def demo_cmd(out: str | None, device: str, epochs: int, seed: int, quiet: bool) -> None:
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
    run_demo(out=out, device=device, epochs=epochs, seed=seed, quiet=quiet)
