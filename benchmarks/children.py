"""How the benchmarks run a measured command: as a child process of this checkout, page cache warmed first.

Shared by ``bench.py`` and ``bench_diff.py``: the child's environment (the repo root first on ``PYTHONPATH``),
reading a file once into the page cache, and one measured run (wall clock ``time.perf_counter`` around
``Popen`` .. ``os.wait4``; peak RSS ``ru_maxrss`` from ``wait4``'s rusage, KiB on Linux).
"""

from __future__ import annotations

import compileall
import os
import subprocess
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env() -> dict[str, str]:
    """This process's environment with the repo root first on ``PYTHONPATH`` (the ckptool of this checkout)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
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


def run_child(cmd: list[str], workdir: str, *, stdout: bool = False) -> tuple[int, float, int, str, str]:
    """Run ``cmd`` in ``workdir``: ``(exit status, wall seconds, peak RSS KiB, stdout, stderr)``; stdout is
    captured only when ``stdout`` (else discarded, and ``""``)."""
    with tempfile.TemporaryFile("w+", dir=workdir) as out, tempfile.TemporaryFile("w+", dir=workdir) as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out if stdout else subprocess.DEVNULL,
                                stderr=err, env=child_env(), cwd=workdir)
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
