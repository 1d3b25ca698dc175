"""``ckptool scan`` of many checkpoints at once (``--jobs N``, ``--jsonl``, ``--cache PATH``, or a URL prefix):
results printed as each file finishes, then the table and the counts (text), one JSON document, one SARIF log over
all of them, or one JSON line per checkpoint (``--jsonl``); the exit status is the worst verdict's. A thin layer over
:class:`ckptool.ops.scan.many.ScanRun`; what one path prints is :mod:`ckptool.cli.scan`'s, unchanged. The same
machinery (the executor, the progress bar, the rows as they come) runs ``ckptool inspect --json`` / ``--jsonl`` of
several paths (:func:`run_inspect_many`, over :class:`ckptool.ops.inspect.many.InspectRun`).

``--jobs N`` runs N scans at once: in threads when a checkpoint is a URL (a remote scan waits on range requests,
during which Python releases the GIL, so threads overlap the waits at no cost), in processes when the local files
are big enough to repay starting them (a local scan is CPU work in Python: pickle opcodes, zip directories, which
threads would run one at a time under the GIL), and one after another in this process otherwise: starting a worker
process (importing ckptool) costs more than scanning hundreds of small files, so ``--jobs 2`` of 500 small pickles
would be slower than ``--jobs 1`` (:data:`PROCESS_BYTES_PER_JOB`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ckptool import __version__
from ckptool import _source as source
from ckptool.cli._common import emit_json, human_bytes, is_quiet, progress_wanted
from ckptool.cli._errors import EXIT_FAILURE, EXIT_OK
from ckptool.errors import UsageError
from ckptool.ops.scan.many import ManyRun, ScanRun, fork_count
from ckptool.scanning.results import ScanResult, exit_status, worst_verdict

if TYPE_CHECKING:  # a pool is made only for URLs or big local work: many small files need neither import
    import concurrent.futures as cf

__all__ = ["run_inspect_many", "run_many", "wants_many"]

R = TypeVar("R")


def wants_many(paths: tuple[str, ...]) -> bool:
    """Whether a path is a URL prefix or folder (``s3://bucket/models/``): one request per URL."""
    return any(source.is_url(p) and source.kind(p) == "directory" for p in paths)


#: local checkpoints are scanned in worker processes only when they come to this many bytes per worker or more:
#: starting a worker (a fresh interpreter importing ckptool) takes about 0.3 s, while a scan reads pickles and
#: headers only (about a millisecond per small file, 0.1-0.3 s per GB of torch checkpoint); below, threads
PROCESS_BYTES_PER_JOB = 1 << 30


def _executor(run: ManyRun[Any], jobs: int) -> cf.Executor | None:
    """The pool of ``--jobs N``: none (this process, one file after another) for one job and for local work too
    small to repay starting processes (:data:`PROCESS_BYTES_PER_JOB`: CPU work in Python, which threads would run
    one at a time under the GIL), threads for URLs, processes (forkserver, else spawn) for big local work."""
    if jobs <= 1:
        return None
    remote = any(source.is_url(t.path) for t in run.targets)
    if not remote and (len(run.targets) < 2 or sum(t.size or 0 for t in run.targets) < PROCESS_BYTES_PER_JOB * min(
            jobs, len(run.targets))):
        # in this process (threads would only take turns under the GIL), or, for many files, shared with children
        # forked from it, which start in a millisecond with everything imported (a pool's workers import ckptool)
        if getattr(run, "cache", None) is None:
            run.forks = fork_count(run.targets, jobs)
        return None
    import concurrent.futures as cf  # noqa: PLC0415 (only a pool needs it: not for the work done in this process)

    if remote:
        return cf.ThreadPoolExecutor(jobs, thread_name_prefix="ckptool-many")
    import multiprocessing  # noqa: PLC0415 (only a pool of processes needs it: not at start-up)

    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    return cf.ProcessPoolExecutor(jobs, mp_context=ctx)


def _results(run: ManyRun[R], jobs: int, desc: str, skipped: list[int]) -> Iterator[R]:
    """The results of ``run`` on ``jobs`` workers (:func:`_executor`) as they come, under a progress bar over the
    files and their bytes (``desc``); the objects that are no checkpoint counted in ``skipped[0]``. The pool is
    shut down (tasks not started cancelled) when the iteration ends, however it ends."""
    run.executor = _executor(run, jobs)
    run.window = 4 * jobs
    total = sum(t.size or 0 for t in run.targets)
    bar = None
    if progress_wanted():
        from tqdm import tqdm

        bar = tqdm(total=len(run.targets), desc=desc, unit="file", file=sys.stderr, dynamic_ncols=True)
    done = 0
    try:
        for t, res in run:
            done += t.size or 0
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{human_bytes(done)} of {human_bytes(total)}", refresh=False)
            if res is None:
                skipped[0] += 1
                continue
            yield res
    finally:
        if bar is not None:
            bar.close()
        if run.executor is not None:
            run.executor.shutdown(cancel_futures=True)


#: the rows of files that finished are written together, at least this often (seconds) and every this many rows
FLUSH_SECONDS, FLUSH_ROWS = 0.2, 256


class _Rows:
    """The rows of a run printed as files finish, in as few writes as that allows: each :meth:`add` keeps its text
    until :data:`FLUSH_SECONDS` passed since the last write or :data:`FLUSH_ROWS` rows wait (a flushed write a row
    cost ``scan --jobs 2`` of 500 small files more than the rows of ``--jobs 1``, written at once; issue 52)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.last = time.monotonic()

    def add(self, text: str) -> None:
        self.parts.append(text)
        if len(self.parts) >= FLUSH_ROWS or time.monotonic() - self.last >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Write the rows kept (one ``click.echo``, flushed)."""
        if self.parts:
            click.echo("".join(self.parts), nl=False)
            self.parts.clear()
        self.last = time.monotonic()


def _nothing_found(paths: tuple[str, ...], skipped: int, what: str) -> UsageError:
    return UsageError(f"{', '.join(paths)}: no checkpoint found ({skipped} object(s) listed, none a checkpoint by "
                      f"its content); nothing was {what}: check the paths")


def run_many(paths: tuple[str, ...], fmt: str, *, jobs: int, cache_path: str | None, strict: bool,
             show_all: bool, table: Any, summary: Any) -> int:
    """Scan ``paths`` as one run and print as ``fmt`` (``text``, ``json``, ``jsonl``, ``sarif``); ``table`` and
    ``summary`` are scan's own (results, strict) -> text. Returns the exit status.

    Raises:
        UsageError: no checkpoint was found under any path.
        OutputError: the cache cannot be opened.
    """
    cache = None
    if cache_path:  # sqlite3 imported only for --cache (start-up)
        from ckptool.ops.scan.cache import ScanCache  # noqa: PLC0415

        cache = ScanCache(cache_path)
    text = fmt == "text" and not is_quiet()
    run = ScanRun(paths, cache=cache, key_paths=fmt != "text")  # the text report shows no key paths
    results: list[ScanResult] = []
    skipped = [0]
    rows = _Rows()
    try:
        for res in _results(run, jobs, "scan", skipped):
            results.append(res)
            if fmt == "jsonl":
                rows.add(json.dumps(res.to_dict(strict=strict), default=str) + "\n")
            elif text:
                rows.add(("\n" if len(results) > 1 else "") + res.report(show_all=show_all, strict=strict) + "\n")
    finally:
        rows.flush()
        if cache is not None:
            cache.close()
    if not results:
        raise _nothing_found(paths, skipped[0], "scanned")
    code = exit_status(results, strict=strict)
    _finish(results, fmt, code, strict, text, table, summary)
    if text and skipped[0]:
        click.echo(f"skipped {skipped[0]} object(s) under the prefixes that are no checkpoint by their content")
    if text and cache is not None:
        click.echo(f"{run.hits} of {len(run.targets)} answered from the cache {cache_path}")
    return code


def run_inspect_many(paths: tuple[str, ...], jsonl: bool, *, jobs: int, show_all: bool) -> int:
    """``inspect --json`` / ``--jsonl`` of the checkpoints of ``paths`` as one run
    (:class:`ckptool.ops.inspect.many.InspectRun`), each printed as it finishes: with ``jsonl`` one line per
    checkpoint (its ``inspect --json`` object, or ``{"schema", "path", "error"}``), else one JSON array of them, one
    element a line. Returns the exit status: 0 when every checkpoint was read, 1 when a row holds an error.

    Raises:
        UsageError: no checkpoint was found under any path (nothing printed).
    """
    rows, failed, skipped = 0, 0, [0]
    # imported here: ``scan`` of many files, the common use, need not import inspect's modules (start-up)
    from ckptool.ops.inspect.many import InspectRun  # noqa: PLC0415

    for row in _results(InspectRun(paths, show_all=show_all), jobs, "inspect", skipped):
        failed += row.error is not None
        click.echo(row.line() if jsonl else ("[\n" if not rows else ",\n") + row.line(), nl=jsonl)
        rows += 1
    if not rows:
        raise _nothing_found(paths, skipped[0], "inspected")
    if not jsonl:
        click.echo("\n]")
    return EXIT_FAILURE if failed else EXIT_OK


def _finish(results: list[ScanResult], fmt: str, code: int, strict: bool, text: bool, table: Any,
            summary: Any) -> None:
    """What follows the files: one JSON document, the SARIF log, or the table and the counts."""
    if fmt == "json":
        emit_json("scan", {"strict": strict, "exit_code": code, "verdict": worst_verdict(results),
                           "files": [r.to_dict(strict=strict) for r in results]})
    elif fmt == "sarif":
        from ckptool.ops.scan.sarif import to_sarif  # noqa: PLC0415 (only --format sarif)

        click.echo(json.dumps(to_sarif(results, version=__version__, strict=strict), indent=2))
    elif text:
        click.echo("")
        click.echo(table(results, strict))
        click.echo("")
        click.echo(summary(results, strict))
