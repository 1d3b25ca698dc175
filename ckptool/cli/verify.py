"""``ckptool verify``: prove a checkpoint lands intact in the user's model on the user's device.

A thin command over :func:`ckptool.torch_ops.verify.verify`, which imports torch when it runs; the helpers here
turn ``--model MODULE:CALLABLE`` and ``--model-kwargs JSON`` into a model factory.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import click

from ckptool.cli._common import emit_json, json_option, key_option, max_expand_option
from ckptool.errors import CkptError, InputNotFoundError, UsageError
from ckptool.torch_ops.verify import verify


def parse_input_shape(text: str) -> list[int]:
    """``"1,784"`` (or ``1x784``, ``1 784``) -> ``[1, 784]``.

    Raises:
        UsageError: empty, or a size that is not a positive integer.
    """
    parts = [p for p in text.replace("x", ",").replace(" ", ",").split(",") if p]
    try:
        shape = [int(p) for p in parts]
    except ValueError:
        shape = []
    if not shape or any(s <= 0 for s in shape):
        raise UsageError(f"--input-shape {text!r}: give positive sizes separated by commas, such as 1,784")
    return shape


def import_callable(spec: str) -> Callable[..., Any]:
    """Import ``MODULE:CALLABLE`` and return the callable.

    ``MODULE`` is an importable module name (``mypkg.models``; the current folder is importable, as with
    ``python -m``) or the path of a ``.py`` file (``path/to/models.py``; its folder is put on ``sys.path`` so its
    own imports work). ``CALLABLE`` may be dotted (``Net.from_config``). Importing runs the user's code, which is
    the point: it is their model definition.

    Raises:
        UsageError: no ``:``, the module cannot be imported, or the attribute is missing or not callable.
    """
    if ":" not in spec:
        raise UsageError(f"--model {spec!r}: expected MODULE:CALLABLE, e.g. mypkg.models:Net or models.py:build")
    mod_part, attr = spec.rsplit(":", 1)
    if not mod_part or not attr:
        raise UsageError(f"--model {spec!r}: expected MODULE:CALLABLE, e.g. mypkg.models:Net or models.py:build")
    try:
        if mod_part.endswith(".py") or os.sep in mod_part or "/" in mod_part:
            module = _import_file(mod_part)
        else:
            cwd = os.getcwd()
            if cwd not in sys.path and "" not in sys.path:
                sys.path.insert(0, cwd)
            module = importlib.import_module(mod_part)
    except CkptError:
        raise
    except Exception as e:  # the user's module failed to import: say which and why
        raise UsageError(f"--model {spec!r}: cannot import {mod_part}: {type(e).__name__}: {e}") from e
    obj: object = module
    for name in attr.split("."):
        if not hasattr(obj, name):
            raise UsageError(f"--model {spec!r}: {mod_part} has no attribute {attr!r}")
        obj = getattr(obj, name)
    if not callable(obj):
        raise UsageError(f"--model {spec!r}: {attr} is a {type(obj).__name__}, not a class or function")
    return obj


def _import_file(path: str) -> ModuleType:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise InputNotFoundError(f"--model: {path}: no such file")
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = "_ckptool_user_" + os.path.splitext(os.path.basename(full))[0].replace("-", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise UsageError(f"--model: cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def build_factory(spec: str, kwargs_json: str | None) -> Callable[[], Any]:
    """A zero-argument factory ``lambda: CALLABLE(**kwargs)`` for ``--model`` and ``--model-kwargs``.

    Raises:
        UsageError: as :func:`import_callable`, or ``--model-kwargs`` is not a JSON object.
    """
    fn = import_callable(spec)
    kwargs: dict[str, Any] = {}
    if kwargs_json:
        try:
            kwargs = json.loads(kwargs_json)
        except json.JSONDecodeError as e:
            raise UsageError(f"--model-kwargs is not valid JSON ({e}); e.g. '{{\"num_classes\": 10}}'") from e
        if not isinstance(kwargs, dict):
            raise UsageError(f"--model-kwargs must be a JSON object such as '{{\"num_classes\": 10}}', got "
                             f"{type(kwargs).__name__}")

    def factory() -> Any:
        return fn(**kwargs)

    factory.__qualname__ = spec.rsplit(":", 1)[1] + (f"(**{kwargs_json})" if kwargs else "")
    return factory


@click.command("verify")
@click.argument("ckpt", type=click.Path(dir_okay=True))
@click.option("--model", "model_spec", required=True, metavar="MODULE:CALLABLE",
              help="Function or class that builds the model: mypkg.models:Net or path/to/models.py:build.")
@click.option("--model-kwargs", metavar="JSON", help="Keyword arguments for CALLABLE, as a JSON object.")
@click.option("--device", metavar="DEVICE", help="Target device. Default: cuda:0 when CUDA is available, else cpu.")
@key_option("Dotted path of the state_dict inside the checkpoint (state_dict, ema, model...). Default: detected.")
@click.option("--strict/--no-strict", default=True, show_default=True,
              help="Missing, unexpected and shape-mismatched keys fail the check (--no-strict: only reported).")
@click.option("--input-shape", metavar="N,...", help="Run one forward pass on a fixed-seed input of this shape "
              "on DEVICE and on the CPU, and compare the outputs.")
@click.option("--trust", is_flag=True, help="Allow a full (unrestricted) unpickle. Runs code named by the file: "
              "only for files from a source you trust.")
@max_expand_option
@json_option("verify")
@click.pass_context
def verify_cmd(ctx: click.Context, ckpt: str, model_spec: str, model_kwargs: str | None, device: str | None,
               key: str | None, strict: bool, input_shape: str | None, trust: bool, max_expand: float | None,
               as_json: bool) -> None:
    """Check that checkpoint CKPT loads intact into the model --model builds, on DEVICE.

    Builds the model and moves it to DEVICE, opens CKPT memory-mapped (weights_only unless --trust; tensors are
    read from the file straight into the model, no second copy), picks the state_dict and reconciles wrapper
    prefixes (module., _orig_mod., Lightning's model.) in either direction, loads it, then checks that every
    parameter and buffer is on DEVICE, that every loaded value is bit-identical to the checkpoint's tensor, and
    reports dtype casts. Exit status 0 only when everything holds.

    \b
    Examples:
      ckptool verify model.pth --model mypkg.models:Net --device cpu
      ckptool verify run.ckpt --model models.py:build --model-kwargs '{"num_classes": 10}' --input-shape 1,3,32,32
    """
    shape = parse_input_shape(input_shape) if input_shape else None
    factory = build_factory(model_spec, model_kwargs)
    report = verify(factory, ckpt, device=device, key=key, strict=strict, input_shape=shape, trust=trust,
                    max_expand=max_expand)
    if as_json:
        emit_json("verify", report.to_dict())
    else:
        click.echo(report.format())
    if not report.ok:
        ctx.exit(1)
