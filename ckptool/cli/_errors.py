"""One table from exception type to the ``Error: ...`` line and exit status of the ``ckptool`` command.

In the manner of huggingface_hub's ``cli/_errors.py``: the library raises its own :class:`~ckptool.errors.CkptError`
for everything about the input, and the exceptions of the system (out of memory, permission denied, disk full, a
missing package) pass through it unchanged; this table, used only by the group in :mod:`ckptool.cli`, says what
each means to the user in one line and which exit status it gives. The exit status lives here only: the exceptions
carry none (:data:`CKPT_EXIT_CODES` maps ckptool's error classes to theirs). Anything else is a bug in ckptool (exit
:data:`EXIT_BUG`), and its line says so and how to get the traceback.
"""

from __future__ import annotations

import errno
import platform
import sys
from collections.abc import Callable
from typing import Any

from ckptool.errors import CkptError, UsageError, os_error_advice

# ------------------------------------------------------------------------------------------------ exit status
# What the ``ckptool`` command's exit status means (``ckptool scan`` has its own verdict codes: 0 every file is
# safe, 1 a file is dangerous, 2 a file could not be read, 4 a file needs trust, 5 a file is incomplete (cut short:
# a truncated download); see ckptool.scanning.results.EXIT_CODES, whose codes never collide with the ones below).

#: the command did what it was asked
EXIT_OK = 0
#: the input was refused or is invalid (a :class:`~ckptool.errors.CkptError`, or a ``RecursionError``: input nested
#: deeper than a parser can go), or the system refused: out of memory, permission denied, disk full, a package missing
EXIT_FAILURE = 1
#: bad arguments: Click's usage errors and :class:`~ckptool.errors.UsageError` (a missing input included:
#: :class:`~ckptool.errors.InputNotFoundError` is a UsageError)
EXIT_USAGE = 2
#: an internal error: a bug in ckptool (the message says how to get the traceback)
EXIT_BUG = 3
#: stopped by SIGINT (Ctrl-C): 128 + the signal number, as a shell reports it; the temporary output is removed and
#: the source left untouched
EXIT_INTERRUPTED = 130
#: stopped by SIGTERM (``kill``), likewise
EXIT_TERMINATED = 143

#: ckptool's error class -> the exit status it gives; an error takes the entry of the first class of its MRO listed
#: here (an :class:`~ckptool.errors.InputNotFoundError` is a UsageError: 2; every other CkptError: 1)
CKPT_EXIT_CODES: dict[type[CkptError], int] = {
    UsageError: EXIT_USAGE,
    CkptError: EXIT_FAILURE,
}


def ckpt_exit_code(e: CkptError) -> int:
    """The exit status of ckptool's error ``e``: :data:`CKPT_EXIT_CODES` for the nearest class of ``type(e)``."""
    return next(CKPT_EXIT_CODES[c] for c in type(e).__mro__ if c in CKPT_EXIT_CODES)

#: pip's name for a module whose distribution is named differently (default: the module's own name)
_PIP_NAMES = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn"}

#: modules ``pip install ckptool`` leaves out -> the smallest extra of pyproject.toml that adds them: torch and
#: safetensors come with the ``torch`` extra (verify, demo, DCP conversion, casts, trusted loads); numpy alone is what
#: ``average``, ``report A B`` and ``diff --rtol/--atol`` need without torch, and the ``numpy`` extra adds just it
_EXTRAS = {"torch": "torch", "safetensors": "torch", "numpy": "numpy"}
_TORCH_EXTRA = frozenset(_EXTRAS)
TORCH_EXTRA_HINT = "pip install 'ckptool[torch]'"


def extra_hint(module: str) -> str:
    """The install line for ``module``, one ``pip install ckptool`` leaves out: its extra (``torch`` or ``numpy``)."""
    return f"pip install 'ckptool[{_EXTRAS[module]}]'"

#: the standard library as this Python names it, plus the modules later Pythons added (tomllib: 3.11), which a
#: ckptool bug could import on an older one: pip cannot install any of them
_STDLIB = frozenset(sys.stdlib_module_names) | {"tomllib"}

#: where a Python traceback starts in an exception's text (torch's CheckpointException carries one per rank)
TRACEBACK = "Traceback (most recent call last)"

DEBUG_HINT = "run again with --debug (or CKPTOOL_DEBUG=1) for the traceback"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _ckpt(e: CkptError) -> tuple[str, int]:
    cause = e.__cause__  # e.g. verify's --model module failed on `import torch`: the remedy is the torch extra
    if isinstance(cause, ModuleNotFoundError) and (cause.name or "").split(".")[0] in _TORCH_EXTRA:
        found = _import(cause)
        if found is not None:
            return found
    text = str(e)
    if TRACEBACK in text:  # a library's exception text carried into ours: never a traceback without --debug
        text = text[:text.index(TRACEBACK)].rstrip() or type(e).__name__
    return text, ckpt_exit_code(e)


def _memory(e: MemoryError) -> tuple[str, int]:
    detail = _first_line(e)
    msg = (f"out of memory{f' ({detail})' if detail else ''}: this needed more memory than the machine could give; "
           "close other programs or run it on a machine with more memory")
    return msg, EXIT_FAILURE


def _recursion(e: RecursionError) -> tuple[str, int]:
    """A ``RecursionError`` is input nested deeper than Python's parsers and walkers go (a JSON, YAML or TOML
    document, a pickle, a header nested thousands deep): bad input, refused like any other (exit
    :data:`EXIT_FAILURE`), not an internal error. The readers turn the ones they expect into their own errors; this
    row catches the rest."""
    detail = _first_line(e)
    msg = (f"the input is nested too deeply to read{f' ({detail})' if detail else ''}: it is damaged or hostile, "
           f"and ckptool refuses it; if you believe it is sound, {DEBUG_HINT}, and report it")
    return msg, EXIT_FAILURE


def _import(e: ImportError) -> tuple[str, int] | None:
    top = (e.name or "").split(".")[0]
    if top == "ckptool":
        return None  # ckptool failed to import its own module: a bug
    if top in _STDLIB:
        # the standard library cannot be upgraded with pip: ckptool used something this Python lacks (typing.Never
        # on 3.10, say) or a module this build left out; either way a bug or a packaging gap to report
        detail = _first_line(e)
        msg = (f"internal error (a bug in ckptool): {type(e).__name__}{f': {detail}' if detail else ''} "
               f"(standard library of Python {platform.python_version()}); {DEBUG_HINT}, and report it")
        return msg, EXIT_BUG
    pip = _PIP_NAMES.get(top, top)
    if not top:
        msg = (f"an import failed ({_first_line(e)}); reinstall ckptool's dependencies: "
               "pip install --force-reinstall ckptool")
    elif isinstance(e, ModuleNotFoundError) and top in _TORCH_EXTRA:
        msg = (f"this needs the {top} package, which is not installed (`pip install ckptool` leaves it out); "
               f"install it with: {extra_hint(top)}")
    elif isinstance(e, ModuleNotFoundError):
        msg = f"this needs the {pip} package, which is not installed; install it with: pip install {pip}"
    else:
        msg = (f"importing {e.name} failed ({_first_line(e)}); the installed {pip} may be too old or broken: "
               f"pip install --upgrade {pip}")
    return msg, EXIT_FAILURE


def _paths(e: OSError) -> str:
    if e.filename is None:
        return ""
    return f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")


def _permission(e: PermissionError) -> tuple[str, int]:
    where = _paths(e)
    msg = (f"permission denied: {where or _first_line(e)}; check its permissions, or choose a file or folder you "
           "can access")
    return msg, EXIT_FAILURE


def _os(e: OSError) -> tuple[str, int]:
    where = _paths(e)
    reason = e.strerror or _first_line(e) or type(e).__name__
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{reason}{f' writing {where}' if where else ''}; {os_error_advice(e.errno)}", EXIT_FAILURE)
    return (f"{where}: {reason}" if where else reason), EXIT_FAILURE


#: (exception type, formatter) in the order they are tried; a formatter gives (one-line message, exit status), or
#: None when the exception is a bug after all. Each formatter takes its own row's type, hence ``Any`` here.
ERRORS: tuple[tuple[type[BaseException], Callable[[Any], tuple[str, int] | None]], ...] = (
    (CkptError, _ckpt),
    (MemoryError, _memory),
    (RecursionError, _recursion),
    (ImportError, _import),
    (PermissionError, _permission),
    (OSError, _os),
)


def describe_error(e: BaseException) -> tuple[str, int]:
    """The one-line message (without ``Error: ``) and exit status for ``e``: the first row of :data:`ERRORS`
    whose type ``e`` is an instance of; otherwise, or when that row declines, an internal error (exit
    :data:`EXIT_BUG`) whose message says it is a bug and how to get the traceback."""
    for typ, formatter in ERRORS:
        if isinstance(e, typ):
            found = formatter(e)
            if found is not None:
                return found
            break
    detail = _first_line(e)
    msg = (f"internal error (a bug in ckptool): {type(e).__name__}{f': {detail}' if detail else ''}; "
           f"{DEBUG_HINT}, and report it")
    return msg, EXIT_BUG
