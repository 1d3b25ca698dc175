"""``ckptool scan`` of many checkpoints at once (``--jobs N``, ``--jsonl``, ``--cache PATH``, or a URL prefix):
results printed as each file finishes, then the table and the counts (text), one JSON document, one SARIF log over
all of them, or one JSON line per checkpoint (``--jsonl``); the exit status is the worst verdict's. A thin layer over
:class:`ckptool.ops.scan.many.ScanRun`; what one path prints is :mod:`ckptool.cli.scan`'s, unchanged.

``--jobs N`` runs N scans at once: in threads when a checkpoint is a URL (a remote scan waits on range requests,
during which Python releases the GIL, so threads overlap the waits at no cost), in processes otherwise (a local scan
is CPU work in Python: pickle opcodes, zip directories, which threads would run one at a time under the GIL).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import sys
from typing import Any

import click

from ckptool import __version__
from ckptool import _source as source
from ckptool.cli._common import emit_json, human_bytes, is_quiet, progress_wanted
from ckptool.errors import UsageError
from ckptool.ops.scan.cache import ScanCache
from ckptool.ops.scan.many import ScanRun
from ckptool.ops.scan.results import ScanResult, exit_status
from ckptool.ops.scan.sarif import to_sarif

__all__ = ["run_many", "wants_many"]


def wants_many(paths: tuple[str, ...]) -> bool:
    """Whether a path is a URL prefix or folder (``s3://bucket/models/``): one request per URL."""
    return any(source.is_url(p) and source.kind(p) == "directory" for p in paths)


def _executor(run: ScanRun, jobs: int) -> cf.Executor | None:
    if jobs <= 1:
        return None
    if any(source.is_url(t.path) for t in run.targets):
        return cf.ThreadPoolExecutor(jobs, thread_name_prefix="ckptool-scan")
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    return cf.ProcessPoolExecutor(jobs, mp_context=ctx)


def _bar(run: ScanRun) -> Any:
    if not progress_wanted():
        return None
    from tqdm import tqdm

    return tqdm(total=len(run.targets), desc="scan", unit="file", file=sys.stderr, dynamic_ncols=True)


def run_many(paths: tuple[str, ...], fmt: str, *, jobs: int, cache_path: str | None, strict: bool,
             show_all: bool, table: Any, summary: Any) -> int:
    """Scan ``paths`` as one run and print as ``fmt`` (``text``, ``json``, ``jsonl``, ``sarif``); ``table`` and
    ``summary`` are scan's own (results, strict) -> text. Returns the exit status.

    Raises:
        UsageError: no checkpoint was found under any path.
        OutputError: the cache cannot be opened.
    """
    cache = ScanCache(cache_path) if cache_path else None
    run = ScanRun(paths, cache=cache)
    run.executor = _executor(run, jobs)
    run.window = 4 * jobs
    total = sum(t.size or 0 for t in run.targets)
    bar, done, skipped = _bar(run), 0, 0
    results: list[ScanResult] = []
    text = fmt == "text" and not is_quiet()
    try:
        for t, res in run:
            done += t.size or 0
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{human_bytes(done)} of {human_bytes(total)}", refresh=False)
            if res is None:
                skipped += 1
                continue
            results.append(res)
            if fmt == "jsonl":
                click.echo(json.dumps(res.to_dict(strict=strict), default=str))
            elif text:
                click.echo(("\n" if len(results) > 1 else "") + res.report(show_all=show_all, strict=strict))
    finally:
        if bar is not None:
            bar.close()
        if run.executor is not None:
            run.executor.shutdown(cancel_futures=True)
        if cache is not None:
            cache.close()
    if not results:
        raise UsageError(f"{', '.join(paths)}: no checkpoint found ({skipped} object(s) listed, none a checkpoint by "
                         "its content); nothing was scanned: check the paths")
    code = exit_status(results, strict=strict)
    _finish(results, fmt, code, strict, text, table, summary)
    if text and skipped:
        click.echo(f"skipped {skipped} object(s) under the prefixes that are no checkpoint by their content")
    if text and cache is not None:
        click.echo(f"{run.hits} of {len(run.targets)} answered from the cache {cache_path}")
    return code


def _finish(results: list[ScanResult], fmt: str, code: int, strict: bool, text: bool, table: Any,
            summary: Any) -> None:
    """What follows the files: one JSON document, the SARIF log, or the table and the counts."""
    if fmt == "json":
        emit_json("scan", {"strict": strict, "exit_code": code, "files": [r.to_dict(strict=strict) for r in results]})
    elif fmt == "sarif":
        click.echo(json.dumps(to_sarif(results, version=__version__, strict=strict), indent=2))
    elif text:
        click.echo("")
        click.echo(table(results, strict))
        click.echo("")
        click.echo(summary(results, strict))
