"""Old spellings of the public API, kept working for one release with a ``DeprecationWarning``.

ckptool 0.2 settled two names that earlier releases spelled differently: every function that writes takes its
output as ``dst`` (``report`` took ``out=``, ``save_portable`` ``path=``), and every function that pairs a model with
a checkpoint takes the model first, as torch's ``model.load_state_dict(sd)`` and accelerate's
``load_checkpoint_in_model(model, checkpoint)`` do (``verify`` took ``(path, model)``). The decorators here accept
the old spelling, warn, and call the function with the new one; they are removed in ckptool 0.3.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])

#: the release that removes the old spellings
REMOVED_IN = "0.3"


def renamed_argument(old: str, new: str) -> Callable[[F], F]:
    """Decorate a function whose keyword argument ``new`` was called ``old``: a call with ``old=`` warns
    (``DeprecationWarning``) and passes the value as ``new=``; a call with both raises ``TypeError``."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{func.__name__}() got both {old}= and {new}=; pass {new}= only")
                warnings.warn(f"{func.__name__}({old}=...) is deprecated, use {new}=...; {old}= will be removed in "
                              f"ckptool {REMOVED_IN}", DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)

        return cast(F, wrapper)

    return decorate


def _is_path(value: object) -> bool:
    return isinstance(value, (str, os.PathLike))


def model_first(func: F) -> F:
    """Decorate a function taking ``(model, path, ...)`` so that the old order ``(path, model, ...)`` still works:
    when the first positional argument is a path (``str`` or ``os.PathLike``) and the second is not, or when the
    only positional argument is a path and ``model=`` is given by keyword, the two are swapped and a
    ``DeprecationWarning`` says so. A model is never a path, so the order is told by type alone."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        swapped = None
        if len(args) >= 2 and _is_path(args[0]) and not _is_path(args[1]):
            swapped = (args[1], args[0], *args[2:])
        elif len(args) == 1 and _is_path(args[0]) and "model" in kwargs and "path" not in kwargs:
            swapped = (kwargs.pop("model"), args[0])
        if swapped is not None:
            warnings.warn(f"{func.__name__}(path, model) is deprecated: pass the model first, "
                          f"{func.__name__}(model, path), as model.load_state_dict(state_dict) does; the old order "
                          f"will be removed in ckptool {REMOVED_IN}", DeprecationWarning, stacklevel=2)
            args = swapped
        return func(*args, **kwargs)

    return cast(F, wrapper)
