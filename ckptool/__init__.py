"""ckptool: make PyTorch checkpoints portable between machines, devices and model wrappers.

The public API is :data:`__all__`. Importing ckptool imports only its errors, never torch: every function and
result type is loaded from its module on first use (PEP 562 ``__getattr__``), so that a command pays at
start-up only for the modules it runs, and only those that materialise tensors (loading into a model,
``verify``, ``save_portable``, trusted paths) import torch, when called. Type checkers see every name with its
real type through the ``TYPE_CHECKING`` block below, which names the same modules as :data:`_LAZY`.

No submodule of ``ckptool`` shares a name with a public function: the operations live in ``ckptool.ops`` and
``ckptool.torch_ops``, so ``import ckptool.ops.convert`` never replaces ``ckptool.convert``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ckptool.errors import (
    CkptError,
    CorruptCheckpointError,
    DeviceNotFoundError,
    InputNotFoundError,
    KeyCollisionError,
    NestedPrefixError,
    NotACheckpointError,
    OutputError,
    PrefixNotFoundError,
    RemoteError,
    StateDictMismatchError,
    UnsafeCheckpointError,
    UnsupportedError,
    UsageError,
    VerificationError,
)

if TYPE_CHECKING:
    from ckptool.formats.tensors import Storage, Tensor
    from ckptool.model.rename_memory import rename_state_dict
    from ckptool.ops.convert import ConvertResult, convert
    from ckptool.ops.diff.compare import diff
    from ckptool.ops.diff.report import ReportResult, report
    from ckptool.ops.diff.result import DiffResult
    from ckptool.ops.extract import ExtractResult, extract_state_dict
    from ckptool.ops.inspect.entry import CheckpointInfo, StateDictInfo, TensorInfo, inspect
    from ckptool.ops.merge import MergeLoraResult, merge_lora
    from ckptool.ops.rewrite.prefixes import RenameResult, add_prefix, strip_dataparallel, strip_prefix, unwrap
    from ckptool.ops.rewrite.remap import remap
    from ckptool.ops.rewrite.stream import WriteResult
    from ckptool.ops.sanitize import SanitizeDryRun, SanitizeResult, sanitize, sanitize_dry_run
    from ckptool.ops.scan.many import scan_many
    from ckptool.ops.surgery.average import AverageResult, average
    from ckptool.ops.surgery.edit import FilterResult, RuleResult, filter_keys, rename
    from ckptool.readers import Opened, open_checkpoint
    from ckptool.scanning.entry import ScanResult, scan, scan_file
    from ckptool.torch_ops.load import load_into
    from ckptool.torch_ops.portable import save_portable
    from ckptool.torch_ops.reports import LoadReport, TrainingState, VerifyReport
    from ckptool.torch_ops.training import load_training_state
    from ckptool.torch_ops.verify import verify

__version__ = "0.1.0"

#: public name -> the module that defines it, for the names loaded on first use
_LAZY: dict[str, str] = {
    "open_checkpoint": "ckptool.readers",
    "Opened": "ckptool.readers",
    "Tensor": "ckptool.formats.tensors",
    "Storage": "ckptool.formats.tensors",
    "inspect": "ckptool.ops.inspect.entry",
    "CheckpointInfo": "ckptool.ops.inspect.entry",
    "StateDictInfo": "ckptool.ops.inspect.entry",
    "TensorInfo": "ckptool.ops.inspect.entry",
    "remap": "ckptool.ops.rewrite.remap",
    "WriteResult": "ckptool.ops.rewrite.stream",
    "strip_prefix": "ckptool.ops.rewrite.prefixes",
    "add_prefix": "ckptool.ops.rewrite.prefixes",
    "strip_dataparallel": "ckptool.ops.rewrite.prefixes",
    "unwrap": "ckptool.ops.rewrite.prefixes",
    "RenameResult": "ckptool.ops.rewrite.prefixes",
    "rename_state_dict": "ckptool.model.rename_memory",
    "load_into": "ckptool.torch_ops.load",
    "load_training_state": "ckptool.torch_ops.training",
    "save_portable": "ckptool.torch_ops.portable",
    "LoadReport": "ckptool.torch_ops.reports",
    "TrainingState": "ckptool.torch_ops.reports",
    "VerifyReport": "ckptool.torch_ops.reports",
    "verify": "ckptool.torch_ops.verify",
    "convert": "ckptool.ops.convert",
    "ConvertResult": "ckptool.ops.convert",
    "diff": "ckptool.ops.diff.compare",
    "DiffResult": "ckptool.ops.diff.result",
    "scan": "ckptool.scanning.entry",
    "scan_file": "ckptool.scanning.entry",
    "ScanResult": "ckptool.scanning.entry",
    "scan_many": "ckptool.ops.scan.many",
    "extract_state_dict": "ckptool.ops.extract",
    "ExtractResult": "ckptool.ops.extract",
    "sanitize": "ckptool.ops.sanitize",
    "SanitizeResult": "ckptool.ops.sanitize",
    "sanitize_dry_run": "ckptool.ops.sanitize",
    "SanitizeDryRun": "ckptool.ops.sanitize",
    "report": "ckptool.ops.diff.report",
    "ReportResult": "ckptool.ops.diff.report",
    "rename": "ckptool.ops.surgery.edit",
    "filter_keys": "ckptool.ops.surgery.edit",
    "RuleResult": "ckptool.ops.surgery.edit",
    "FilterResult": "ckptool.ops.surgery.edit",
    "average": "ckptool.ops.surgery.average",
    "AverageResult": "ckptool.ops.surgery.average",
    "merge_lora": "ckptool.ops.merge",
    "MergeLoraResult": "ckptool.ops.merge",
}


def __getattr__(name: str) -> object:
    """Load a public name listed in :data:`_LAZY` from its module on first use (PEP 562)."""
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckptool' has no attribute {name!r}")
    value: object = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AverageResult",
    "CheckpointInfo",
    "CkptError",
    "ConvertResult",
    "CorruptCheckpointError",
    "DeviceNotFoundError",
    "DiffResult",
    "ExtractResult",
    "FilterResult",
    "InputNotFoundError",
    "KeyCollisionError",
    "LoadReport",
    "MergeLoraResult",
    "NestedPrefixError",
    "NotACheckpointError",
    "Opened",
    "OutputError",
    "PrefixNotFoundError",
    "RemoteError",
    "RenameResult",
    "ReportResult",
    "RuleResult",
    "SanitizeDryRun",
    "SanitizeResult",
    "ScanResult",
    "StateDictInfo",
    "StateDictMismatchError",
    "Storage",
    "Tensor",
    "TensorInfo",
    "TrainingState",
    "UnsafeCheckpointError",
    "UnsupportedError",
    "UsageError",
    "VerificationError",
    "VerifyReport",
    "WriteResult",
    "add_prefix",
    "average",
    "convert",
    "diff",
    "extract_state_dict",
    "filter_keys",
    "inspect",
    "load_into",
    "load_training_state",
    "merge_lora",
    "open_checkpoint",
    "remap",
    "rename",
    "rename_state_dict",
    "report",
    "sanitize",
    "sanitize_dry_run",
    "save_portable",
    "scan",
    "scan_file",
    "scan_many",
    "strip_dataparallel",
    "strip_prefix",
    "unwrap",
    "verify",
]
