"""How the benchmarks run a measured command: as a child process of this checkout, page cache warmed first.

Shared by ``bench.py`` and ``bench_diff.py``: the child's environment (the repo root first on ``PYTHONPATH``),
reading a file once into the page cache, and one measured run (wall clock ``time.perf_counter`` around
``Popen`` .. ``os.wait4``; peak RSS ``ru_maxrss`` from ``wait4``'s rusage, KiB on Linux).
"""

from __future__ import annotations

import compileall
import contextlib
import os
import subprocess
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(root: str = REPO) -> dict[str, str]:
    """This process's environment with ``root`` first on ``PYTHONPATH``: the ckptool of this checkout, or of the
    folder another commit's ``ckptool/`` was exported to (``benchmarks/regression.py``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    return env


def compile_checkout(root: str = REPO) -> None:
    """Compile the ``ckptool`` package of checkout ``root`` to bytecode (``__pycache__``, git-ignored), as ``pip
    install`` does for a wheel: without it, on a machine that sets ``PYTHONDONTWRITEBYTECODE`` (and the children
    inherit it), every measured run would compile every ckptool module again (0.10-0.12 s of start-up on the
    development machine), a cost an installed ckptool does not pay, while torch, installed, is compiled."""
    compileall.compile_dir(os.path.join(root, "ckptool"), quiet=1)


def warm_cache(path: str) -> None:
    """Read the whole file once through a small buffer (keeps this process's RSS flat)."""
    view = memoryview(bytearray(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [view]) > 0:
            pass
    finally:
        os.close(fd)


def failure_summary(stderr: str, rc: int) -> str:
    """One line saying why a child failed: the ``Error:`` line of ``stderr`` if there is one, the last line of a
    Python traceback, else the first line of ``stderr`` (or the exit status ``rc`` when it is empty)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    if not lines:
        return f"exit status {rc}"
    for ln in reversed(lines):
        if ln.startswith("Error:"):
            return ln
    if lines[0].startswith("Traceback"):
        return lines[-1]
    return lines[0]


def run_child(cmd: list[str], workdir: str, *, stdout: bool = False,
              env: dict[str, str] | None = None) -> tuple[int, float, int, str, str]:
    """Run ``cmd`` in ``workdir`` with ``env`` (default :func:`child_env`): ``(exit status, wall seconds, peak RSS
    KiB, stdout, stderr)``; stdout is captured only when ``stdout`` (else discarded, and ``""``)."""
    with tempfile.TemporaryFile("w+", dir=workdir) as out, tempfile.TemporaryFile("w+", dir=workdir) as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out if stdout else subprocess.DEVNULL,
                                stderr=err, env=child_env() if env is None else env, cwd=workdir)
        try:
            _, status, ru = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()  # our own child, by pid
            proc.wait()
            raise
        wall = time.perf_counter() - t0
        proc.returncode = rc = os.waitstatus_to_exitcode(status)  # already reaped: keep Popen consistent
        out.seek(0)
        err.seek(0)
        return rc, wall, ru.ru_maxrss, out.read(), err.read()


#: seconds a run waits after a big output (>= :data:`SETTLE_BYTES`) was deleted. The development machine's ext4 is
#: mounted with ``discard``: deleting the 2 GiB output of the previous run sends discards to its virtual disk, and
#: writes in the next seconds went at a third of the speed. Without the pause ``cp && sync`` of 2 GiB took 1.09-4.64 s
#: (6 runs: three near 1.1 s, three near 4.2 s) and the same copy by ckptool's method 0.69-3.76 s; with a 4 s pause
#: (after ``os.sync``) 1.68-2.33 s and 1.38-1.98 s after the first run (``benchmarks/out`` on the same disk).
SETTLE_S = 4.0
SETTLE_BYTES = 64 << 20
_last_big_delete = [0.0]


def remove(path: str) -> None:
    """Delete ``path`` if it exists, noting when a big file went (see :data:`SETTLE_S`)."""
    with contextlib.suppress(FileNotFoundError):
        size = os.path.getsize(path)
        os.unlink(path)
        if size >= SETTLE_BYTES:
            _last_big_delete[0] = time.monotonic()


def settle() -> None:
    """Flush pending write-back (``os.sync``) and wait until :data:`SETTLE_S` have passed since a big delete."""
    os.sync()
    left = _last_big_delete[0] + SETTLE_S - time.monotonic()
    if left > 0:
        time.sleep(left)
