"""ckptool: make PyTorch checkpoints portable between machines, devices and model wrappers.

Importing ckptool does not import torch; only the functions that materialise tensors (loading into a model,
the demo) import it when called.
"""

from __future__ import annotations

from typing import Any

from ckptool.errors import (
    CkptError,
    CorruptCheckpointError,
    KeyCollisionError,
    NotACheckpointError,
    PrefixNotFoundError,
    UnsafeCheckpointError,
    UnsupportedError,
    UsageError,
)
from ckptool.ops.inspect import CheckpointInfo, StateDictInfo, TensorInfo, inspect
from ckptool.ops.remap import remap
from ckptool.ops.rewrite import WriteResult

__version__ = "0.1.0"

# name -> module for the parts of the API that are loaded on first use (they may import torch when called)
_LAZY = {
    "strip_prefix": "ckptool.ops.rename",
    "add_prefix": "ckptool.ops.rename",
    "strip_dataparallel": "ckptool.ops.rename",
    "unwrap": "ckptool.ops.rename",
    "rename_state_dict": "ckptool.ops.rename",
    "load_into": "ckptool.torch_ops.load",
    "load_training_state": "ckptool.torch_ops.training",
    "save_portable": "ckptool.torch_ops.portable",
    "LoadReport": "ckptool.torch_ops.reports",
    "verify": "ckptool.torch_ops.verify",
    "convert": "ckptool.ops.convert",
    "scan_file": "ckptool.ops.scan",
    "extract_state_dict": "ckptool.ops.extract",
}

def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckptool' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    # importing ckptool.convert binds the submodule as `ckptool.convert`; bind the function over it
    globals()[name] = value
    return value


__all__ = [
    "CheckpointInfo", "CkptError", "CorruptCheckpointError", "KeyCollisionError", "NotACheckpointError",
    "PrefixNotFoundError", "StateDictInfo", "TensorInfo", "UnsafeCheckpointError", "UnsupportedError",
    "UsageError", "WriteResult", "inspect", "remap", *_LAZY,
]
