"""formats: bytes <-> structure, no torch.

:func:`plugin` resolves a ``"package.module:function"`` reference, importing its module the first time it is
needed. It lives here, at the bottom of the layers that read checkpoints, so that every layer can name the code of
a format it may not meet as a string (the registry of formats, :mod:`ckptool.readers.registry`, names each format's
plug-ins so; ``scan`` and ``inspect`` name the readers of the formats a given file is not), as fsspec's
``known_implementations`` and pip's ``commands_dict`` do: a command pays at start-up only for the modules of the
input it reads (``tests/test_startup_imports.py`` pins the sets). A reference names a module of a layer below the
caller's, as an import would; import-linter does not see these edges, the tests that run each format do.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

__all__ = ["plugin"]


def plugin(ref: str) -> Callable[..., Any]:
    """The function a dotted reference ``"package.module:function"`` names, its module imported the first time
    (then looked up in :data:`_modules`; the function is looked up on each call, so that a test can patch it).

    Raises:
        ImportError / AttributeError: no such module or function (a reference out of date).
        TypeError: the name is not callable.
    """
    module, _, name = ref.partition(":")
    mod = _modules.get(module)
    if mod is None:
        mod = _modules[module] = importlib.import_module(module)
    fn = getattr(mod, name)
    if not callable(fn):
        raise TypeError(f"{ref} is not callable")
    return cast(Callable[..., Any], fn)


#: the modules :func:`plugin` imported, by name
_modules: dict[str, ModuleType] = {}
