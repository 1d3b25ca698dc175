"""Coverage-guided fuzzing of ckptool's readers with atheris (libFuzzer for Python).

Not run by the test suite (atheris is not a dependency). Set up and run::

    pip install atheris
    python fuzz/atheris_target.py --write-seeds fuzz-corpus/      # real, generated and hostile files as seeds
    python fuzz/atheris_target.py fuzz-corpus/ -max_total_time=3600 -rss_limit_mb=4096 -timeout=20

libFuzzer keeps new interesting inputs in ``fuzz-corpus/`` and writes a crashing input as ``crash-*``. An input
fails when a reader (``inspect``, ``read_checkpoint``, ``read_pickle_file``, ``scan_file``, ``load_structure``,
``extract_state_dict``) raises anything but :class:`ckptool.errors.CkptError`, runs past ``-timeout`` seconds, or
needs more than ``-rss_limit_mb`` of memory. Reproduce one with ``python fuzz/fuzz_readers.py``'s
:func:`check_file` or ``ckptool --debug inspect crash-...``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fuzz_readers

_DIR = tempfile.mkdtemp(prefix="ckptool-atheris-")
_PATH = os.path.join(_DIR, "input.pt")


def test_one_input(data: bytes) -> None:
    """libFuzzer's entry point: write ``data`` to a file and run every reader on it."""
    with open(_PATH, "wb") as f:
        f.write(data)
    fuzz_readers.check_file(_PATH, timeout=float("inf"))  # libFuzzer's -timeout handles hangs


def write_seeds(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    seeds = fuzz_readers.load_seeds()
    for i, s in enumerate(seeds):
        (folder / f"seed-{i:04d}").write_bytes(s)
    return len(seeds)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-seeds":
        print(f"{write_seeds(Path(sys.argv[2]))} seeds written to {sys.argv[2]}")
        return
    import atheris  # optional: pip install atheris

    with atheris.instrument_imports():
        import ckptool.formats.torchfile
        import ckptool.formats.unpickler
        import ckptool.formats.zipdir
        import ckptool.ops.inspect.entry
        import ckptool.scanning.entry  # noqa: F401
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
