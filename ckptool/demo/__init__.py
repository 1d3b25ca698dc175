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
   held-out predictions with the trained model's; the pickled full model, which verify refuses without trust,
   is fixed with :func:`extract_fix` (``ckptool.extract_state_dict``) and verified.
6. :func:`resume`: ``ckptool.load_training_state`` on the current device, then one more epoch.
7. A summary table (tabulate), and the run's own wall time.

The package imports torch at import time; ``ckptool`` and ``ckptool.cli`` import it only inside the ``demo``
command. Nothing is downloaded: the data ship in the package. Its modules: :mod:`ckptool.demo.training` (data,
model, training loop), :mod:`ckptool.demo.checkpoints` (the files saved, broken, fixed and resumed),
:mod:`ckptool.demo.run` (:func:`run_demo`, :class:`DemoRun`, :class:`Printer`).
"""

from __future__ import annotations

from ckptool.demo.checkpoints import (
    KINDS,
    STEM,
    fix_file,
    load_plain,
    make_received_copies,
    missing_gpu_tag,
    plain_load_error,
    resume,
    save_three_ways,
)
from ckptool.demo.run import SUMMARY_HEADERS, DemoResult, DemoRun, Printer, prepare_out, run_demo
from ckptool.demo.training import (
    DATA_FILE,
    DATA_PACKAGE,
    IMAGE_SHAPE,
    N_CLASSES,
    PIXEL_MAX,
    DigitsMLP,
    Split,
    Trained,
    accuracy,
    bare_model,
    digits_split,
    load_digits,
    make_optimizer,
    predict,
    predictions_match,
    resolve_device,
    train,
    train_one_epoch,
    wrap_data_parallel,
)

__all__ = [
    "DATA_FILE", "DATA_PACKAGE", "IMAGE_SHAPE", "KINDS", "N_CLASSES", "PIXEL_MAX", "STEM", "SUMMARY_HEADERS",
    "DemoResult", "DemoRun", "DigitsMLP", "Printer", "Split", "Trained", "accuracy", "bare_model", "digits_split",
    "fix_file", "load_digits", "load_plain", "make_optimizer", "make_received_copies", "missing_gpu_tag",
    "plain_load_error", "predict", "predictions_match", "prepare_out", "resolve_device", "resume", "run_demo",
    "save_three_ways", "train", "train_one_epoch", "wrap_data_parallel",
]
