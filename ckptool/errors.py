"""Exceptions raised by ckptool.

Every failure that comes from the input (a file that is missing, corrupt, not a checkpoint, or that asks for
something we refuse to do) is a :class:`CkptError`. The command-line layer turns it into one ``Error: ...`` line
and a non-zero exit; any other exception is a bug in ckptool and is reported as such.

The message of each error says what was found and what to do next, in the manner of torch's
``validate_cuda_device`` ("... please use torch.load with map_location=torch.device('cpu')").
"""

from __future__ import annotations

import errno as _errno
from typing import Any

# ------------------------------------------------------------------------------------------------ exit status
# What the ``ckptool`` command's exit status means (``ckptool scan`` has its own verdict codes: 0 every file is
# safe, 1 a file is dangerous, 2 a file could not be read, 4 a file needs trust; see ckptool.ops.scan.entry.EXIT_CODES).

#: the command did what it was asked
EXIT_OK = 0
#: the input was refused or is invalid (a :class:`CkptError`), or the system refused: out of memory, permission
#: denied, disk full, a package missing
EXIT_FAILURE = 1
#: bad arguments: Click's usage errors and :class:`UsageError`
EXIT_USAGE = 2
#: an internal error: a bug in ckptool (the message says how to get the traceback)
EXIT_BUG = 3


class CkptError(Exception):
    """Base class of every error ckptool raises on purpose. ``str(err)`` is the one-line message."""

    exit_code = EXIT_FAILURE


class NotACheckpointError(CkptError):
    """The file is readable but is not a checkpoint format ckptool knows (PNG, random bytes, an empty file...)."""


class CorruptCheckpointError(CkptError):
    """The file starts like a known format but is truncated or damaged (bad zip directory, broken pickle...)."""


class UnsupportedError(CkptError):
    """A valid checkpoint that asks for an operation this format or layout cannot support (e.g. remapping a
    TorchScript archive, renaming FSDP flat parameters)."""


class UsageError(CkptError):
    """Bad arguments: an unknown device string, output path equal to the input, a missing output folder..."""

    exit_code = EXIT_USAGE


class OutputError(CkptError):
    """Writing an output file failed (disk full, quota exceeded, permission denied, read-only filesystem...) and
    nothing was written. ``path`` is the file or folder that could not be written; ``errno`` the OS error number
    (``errno.ENOSPC``...) or ``None``."""

    def __init__(self, message: str, path: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


class RemoteError(CkptError):
    """Reading or writing a URL (``s3://``, ``http(s)://``, ``memory://``... through fsspec) failed: the network
    dropped, the server refused, a package for the scheme is missing. Nothing was written. ``url`` is the URL."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url


class KeyCollisionError(CkptError):
    """A key rename would turn two distinct keys into one. ``collisions`` maps each new key to the old keys."""

    def __init__(self, message: str, collisions: dict[str, list[str]] | None = None) -> None:
        super().__init__(message)
        self.collisions = collisions or {}


class PrefixNotFoundError(CkptError):
    """A prefix to strip is carried by no key of the selected state_dict(s)."""


class UnsafeCheckpointError(CkptError):
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


class DeviceNotFoundError(CkptError):
    """A ``--map FROM=TO`` source device matches no storage of the checkpoint (nothing was written). ``found`` lists
    the location tags the checkpoint holds."""

    def __init__(self, message: str, found: list[str] | None = None) -> None:
        super().__init__(message)
        self.found = found or []


class NestedPrefixError(CkptError):
    """A prefix to add is already carried by the keys (the result would be ``module.module.``); nothing written."""


class VerificationError(CkptError):
    """The written output does not read back as the source: a name, shape, dtype, sharing or checksum differs.
    Nothing is left at the destination (or the output written there is removed). Raised by ``convert``'s check
    (:mod:`ckptool.ops.convert.verify`)."""


class StateDictMismatchError(CkptError):
    """The checkpoint's state_dict does not fit the model: missing or unexpected keys, or shape mismatches.

    ``str(err)`` is the one-line summary followed by the report's tables; ``report`` is the
    :class:`ckptool.LoadReport` (typed ``Any`` here: this module sits below the torch layer that defines it).
    """

    def __init__(self, message: str, report: Any) -> None:
        super().__init__(message)
        self.report = report


# ------------------------------------------------------------------------------------------------ interruption
# Exit status of a command stopped by a signal, as a shell reports it (128 + the signal number); the temporary
# output is removed and the source left untouched.

#: stopped by SIGINT (Ctrl-C)
EXIT_INTERRUPTED = 130
#: stopped by SIGTERM (``kill``)
EXIT_TERMINATED = 143
