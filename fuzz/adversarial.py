"""The adversarial corpus: generated files and folders that make a reader and the loader that normally reads them
disagree, each carrying a harmless marker payload.

The payload of every case is :func:`marker_pickle`: run by an unrestricted unpickler it executes
``touch "$CKPTOOL_MARKER"``, so a test sets ``CKPTOOL_MARKER`` to a path, runs a command (or the loader) and checks
whether that file appeared. Nothing here imports torch or ckptool at import time.

Each area of the issue "No code from a checkpoint runs in any command" keeps its cases in a module of its own,
``fuzz/adversarial_<area>.py``, with a module-level ``CASES: list[Case]``; :func:`cases` collects them all.
``tests/test_adversarial.py`` runs every command on every case and asserts that the marker never appears and that
``scan`` gives the verdict the case names. As a script it writes the corpus into a folder::

    python fuzz/adversarial.py OUTDIR
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import hostile_corpus as hc  # noqa: E402

#: the environment variable naming the file that the marker payload creates
MARKER_ENV = "CKPTOOL_MARKER"
#: the shell command the payload runs
MARKER_COMMAND = f'touch "${MARKER_ENV}"'


def marker_pickle(proto: int = 2) -> bytes:
    """A pickle that runs :data:`MARKER_COMMAND` through ``os.system`` when an unrestricted unpickler loads it
    (``GLOBAL os system`` + REDUCE), in pickle protocol ``proto`` (0-5)."""
    return hc.gadget_pickle("os", "system", MARKER_COMMAND, proto)


@dataclass(frozen=True)
class Case:
    """One adversarial input.

    ``make(folder)`` writes the input under ``folder`` and returns its path (a file or a folder).
    ``klass``: the class of trick, as named in the issue (e.g. ``"dcp bytes entry with a size"``).
    ``verdict``: what ``ckptool scan`` must say: ``"safe"`` (exit 0: a case about values, not code, such as a
    big-endian file), ``"dangerous"`` (exit 1), ``"needs-trust"`` (exit 4, only where no
    code can run; ``reason`` says why), or ``"refused"`` (an ``Error:`` line, exit 2 or more).
    ``loader``: optional, a snippet of Python run in a subprocess with ``PATH`` bound to the input's path, that loads
    it the way its normal loader does (``torch.load(PATH, weights_only=False)``...), to show the payload is live;
    ``None`` where no loader is modelled.
    ``commands``: the ckptool commands to run it through; ``None`` means every command in the test's list.
    """

    name: str
    klass: str
    make: Callable[[Path], Path]
    verdict: str = "dangerous"
    reason: str = ""
    loader: str | None = None
    commands: tuple[str, ...] | None = None


def cases() -> list[Case]:
    """Every case of every ``fuzz/adversarial_*.py`` module, in module then list order."""
    out: list[Case] = []
    for path in sorted(HERE.glob("adversarial_*.py")):
        module = importlib.import_module(path.stem)
        out.extend(module.CASES)
    names = [c.name for c in out]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"duplicate case names: {sorted(dupes)}")
    return out


def write(outdir: Path) -> list[tuple[Case, Path]]:
    """Write every case into its own subfolder of ``outdir``; returns (case, input path) pairs."""
    made = []
    for case in cases():
        folder = outdir / case.name
        folder.mkdir(parents=True, exist_ok=True)
        made.append((case, case.make(folder)))
    return made


if __name__ == "__main__":
    for case, path in write(Path(sys.argv[1])):
        print(f"{case.verdict:12} {case.klass:40} {path}")
