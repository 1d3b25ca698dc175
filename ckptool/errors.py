"""Exceptions raised by ckptool.

Every failure that comes from the input (a file that is missing, corrupt, not a checkpoint, or that asks for
something we refuse to do) is a :class:`CkptError`. The command-line layer turns it into one ``Error: ...`` line
and a non-zero exit (the exit status is decided there, in :mod:`ckptool.cli._errors`, not here); any other exception
is a bug in ckptool and is reported as such.

As huggingface_hub's errors do (``LocalEntryNotFoundError(EntryNotFoundError, FileNotFoundError, ValueError)``),
each subclass also derives from the built-in exception that means the same thing, so that a caller who does not
know ckptool catches it too: :class:`InputNotFoundError` is a ``FileNotFoundError``; the errors about the input's
content or the arguments (:class:`NotACheckpointError`, :class:`CorruptCheckpointError`, :class:`UnsupportedError`,
:class:`UsageError`...) are ``ValueError``; :class:`OutputError` and :class:`RemoteError` are ``OSError``;
:class:`UnsafeCheckpointError` is the ``pickle.UnpicklingError`` that ``torch.load(weights_only=True)`` raises;
:class:`StateDictMismatchError` the ``RuntimeError`` of torch's ``load_state_dict(strict=True)``.

The message of each error says what was found and what to do next, in the manner of torch's
``validate_cuda_device`` ("... please use torch.load with map_location=torch.device('cpu')").
"""

from __future__ import annotations

import errno as _errno
import pickle
from typing import Any


class CkptError(Exception):
    """Base class of every error ckptool raises on purpose. ``str(err)`` is the one-line message."""


class NotACheckpointError(CkptError, ValueError):
    """The file is readable but is not a checkpoint format ckptool knows (PNG, random bytes, an empty file...)."""


class CorruptCheckpointError(CkptError, ValueError):
    """The file starts like a known format but is truncated or damaged (bad zip directory, broken pickle...)."""


class TruncatedError(CorruptCheckpointError):
    """The file ends before what its own structure declares: a pickle cut before its STOP opcode, a zip without
    its end of central directory, a member, storage block or DCP record past the end of its file (a truncated
    download or copy). ``ckptool scan`` calls such a file ``incomplete``."""


class UnsupportedError(CkptError, ValueError):
    """A valid checkpoint that asks for an operation this format or layout cannot support (e.g. remapping a
    TorchScript archive, renaming FSDP flat parameters)."""


class UsageError(CkptError, ValueError):
    """Bad arguments: an unknown device string, output path equal to the input, a missing output folder..."""


class InputNotFoundError(UsageError, FileNotFoundError):
    """An input file, folder, shard or URL does not exist. A :class:`UsageError` (the ``ckptool`` command exits
    with its usage status) and a ``FileNotFoundError`` whose ``errno`` is ``errno.ENOENT``; ``str(err)`` is the
    message, which names the path."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = _errno.ENOENT


class OutputError(CkptError, OSError):
    """Writing an output file failed (disk full, quota exceeded, permission denied, read-only filesystem...) and
    nothing was written. ``path`` is the file or folder that could not be written; ``errno`` the OS error number
    (``errno.ENOSPC``...) or ``None``."""

    def __init__(self, message: str, path: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


class RemoteError(CkptError, OSError):
    """Reading or writing a URL (``s3://``, ``http(s)://``, ``memory://``... through fsspec) failed: the network
    dropped, the server refused, a package for the scheme is missing. Nothing was written. ``url`` is the URL."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url


class KeyCollisionError(CkptError, ValueError):
    """A key rename would turn two distinct keys into one. ``collisions`` maps each new key to the old keys."""

    def __init__(self, message: str, collisions: dict[str, list[str]] | None = None) -> None:
        super().__init__(message)
        self.collisions = collisions or {}


class PrefixNotFoundError(CkptError, ValueError):
    """A prefix to strip is carried by no key of the selected state_dict(s)."""


class UnsafeCheckpointError(CkptError, pickle.UnpicklingError):
    """Loading would need globals outside the ``torch.load(weights_only=True)`` allowlist and no trust flag
    was given. ``globals`` lists them as ``module.qualname`` strings."""

    def __init__(self, message: str, globals: list[str] | None = None) -> None:  # "globals": the pickle term
        super().__init__(message)
        self.globals = globals or []


_OS_ADVICE = {
    _errno.ENOSPC: "free some space or write elsewhere with -o",
    _errno.EDQUOT: "free some space or write elsewhere with -o",
    _errno.EACCES: "choose a folder you can write to",
    _errno.EPERM: "choose a folder you can write to",
    _errno.EROFS: "the filesystem is read-only: choose another output folder",
}


def os_error_advice(errno: int | None) -> str | None:
    """What to do next after an OS error numbered ``errno`` while writing (``ENOSPC`` -> "free some space or write
    elsewhere with -o"), or ``None`` when there is nothing better to say than the error itself."""
    return _OS_ADVICE.get(errno) if errno is not None else None


class DeviceNotFoundError(CkptError, ValueError):
    """A ``--map FROM=TO`` source device matches no storage of the checkpoint (nothing was written). ``found`` lists
    the location tags the checkpoint holds."""

    def __init__(self, message: str, found: list[str] | None = None) -> None:
        super().__init__(message)
        self.found = found or []


class NestedPrefixError(CkptError, ValueError):
    """A prefix to add is already carried by the keys (the result would be ``module.module.``); nothing written."""


class VerificationError(CkptError):
    """The written output does not read back as the source: a name, shape, dtype, sharing or checksum differs.
    Nothing is left at the destination (or the output written there is removed). Raised by ``convert``'s check
    (:mod:`ckptool.ops.convert.verify`)."""


class StateDictMismatchError(CkptError, RuntimeError):
    """The checkpoint's state_dict does not fit the model: missing or unexpected keys, or shape mismatches.

    ``str(err)`` is the one-line summary followed by the report's tables; ``report`` is the
    :class:`ckptool.LoadReport` (typed ``Any`` here: this module sits below the torch layer that defines it).
    """

    def __init__(self, message: str, report: Any) -> None:
        super().__init__(message)
        self.report = report

