"""Exceptions raised by ckptool.

Every failure that comes from the input (a file that is missing, corrupt, not a checkpoint, or that asks for
something we refuse to do) is a :class:`CkptError`. The command-line layer turns it into one ``Error: ...`` line
and a non-zero exit; any other exception is a bug in ckptool and is reported as such.

The message of each error says what was found and what to do next, in the manner of torch's
``validate_cuda_device`` ("... please use torch.load with map_location=torch.device('cpu')").
"""

from __future__ import annotations


class CkptError(Exception):
    """Base class of every error ckptool raises on purpose. ``str(err)`` is the one-line message."""

    exit_code = 1


class NotACheckpointError(CkptError):
    """The file is readable but is not a checkpoint format ckptool knows (PNG, random bytes, an empty file...)."""


class CorruptCheckpointError(CkptError):
    """The file starts like a known format but is truncated or damaged (bad zip directory, broken pickle...)."""


class UnsupportedError(CkptError):
    """A valid checkpoint that asks for an operation this format or layout cannot support (e.g. remapping a
    TorchScript archive, renaming FSDP flat parameters)."""


class UsageError(CkptError):
    """Bad arguments: an unknown device string, output path equal to the input, a missing output folder..."""

    exit_code = 2


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

    def __init__(self, message: str, globals: list[str] | None = None) -> None:  # noqa: A002 - pickle term
        super().__init__(message)
        self.globals = globals or []
