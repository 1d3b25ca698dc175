"""``ckptool scan``: whether loading a checkpoint could run code, from the globals its pickles name (a thin
command over :func:`ckptool.scanning.entry.scan`; nothing is imported or run from the files, torch is not imported)."""

from __future__ import annotations

import json
from collections import Counter
from functools import partial
from typing import Any

import click

from ckptool import __version__
from ckptool import _source as source
from ckptool._gc import rare_collections
from ckptool.cli._common import emit_json, is_quiet, json_option, usable_cpus
from ckptool.errors import UsageError
from ckptool.formats import plugin
from ckptool.model.units import text_table
from ckptool.scanning.entry import ScanResult, exit_status, iter_targets, scan_listed
from ckptool.scanning.results import INCOMPLETE, Verdict, verdicts_exit_status, worst_verdict


def _table(results: list[ScanResult], strict: bool) -> str:
    """One row per file: verdict, format, pickles (hidden ones counted apart), globals not allowed, the worst."""
    return _table_of([_row(r) for r in results])


def _table_of(rows: list[tuple[str, ...]]) -> str:
    """The table of :func:`_row` rows."""
    return text_table(rows, ["file", "verdict", "format", "pickles", "not allowed", "worst global"], numparse=False)


def _row(r: ScanResult) -> tuple[str, ...]:
    """The table's row of one file: its verdict, format, pickles (hidden ones counted apart), globals not allowed,
    the worst of them (or of the code it ships)."""
    bad = r.unsafe
    worst = f"{bad[0].name} ({bad[0].level})" if bad else ("-" if not r.error else "unreadable")
    code = sorted(r.code, key=lambda c: (c.level != "dangerous", c.kind != "native-library"))
    if code and (not bad or bad[0].level != "dangerous"):
        worst = f"{code[0].kind} {code[0].member} ({code[0].level})"
    hidden = len(r.hidden)
    return (r.path, r.verdict.shown, r.format, f"{len(r.pickles)}" + (f" ({hidden} hidden)" if hidden else ""),
            str(len(bad)), worst)


def _rendered(r: ScanResult, *, show_all: bool, strict: bool) -> tuple[str, tuple[str, ...], Verdict]:
    """What the text output prints for one file: its report, its row of the table, and its verdict (the counts
    line, the exit status)."""
    return r.report(show_all=show_all, strict=strict), _row(r), r.verdict


def _summary(results: list[ScanResult], strict: bool) -> str:
    """The counts line: one verdict vocabulary with or without ``--strict`` (the policy changes the exit status)."""
    return _summary_of([r.verdict for r in results])  # each file's verdict worked out once, not once a word


def _summary_of(found: list[Verdict]) -> str:
    """:func:`_summary` of files whose verdicts are ``found``."""
    verdicts = Counter(v.value for v in found)
    counts = {v: verdicts[Verdict(v).value] for v in ("safe", "needs-trust", "dangerous", "error", INCOMPLETE)}
    return (f"{len(found)} files: {counts['safe']} safe, {counts['needs-trust']} need trust, "
            f"{counts['dangerous']} dangerous, {counts['error']} unreadable" + _incomplete(counts))


def _incomplete(counts: dict[str, int]) -> str:
    return f", {counts[INCOMPLETE]} incomplete" if counts[INCOMPLETE] else ""


def _is_prefix(p: str) -> bool:
    return source.is_url(p) and (p.endswith("/") or source.kind(p) == "directory")


def _many(paths: tuple[str, ...], fmt: str, jsonl: bool, jobs: int, cache_path: str | None, strict: bool,
          show_all: bool) -> int:
    """Many checkpoints as one run (:mod:`ckptool.cli._many`); its exit status."""
    if jsonl and fmt != "text":
        raise UsageError(f"--jsonl and --{'json' if fmt == 'json' else 'format ' + fmt} ask for two outputs; give one")
    from ckptool.cli._many import run_many  # noqa: PLC0415 - deferred: not on the path of one file's scan

    return run_many(paths, "jsonl" if jsonl else fmt, jobs=jobs, cache_path=cache_path, strict=strict,
                    show_all=show_all, table=_table, summary=_summary)


@click.command("scan")
@click.argument("paths", nargs=-1, required=True, type=click.Path(dir_okay=True))
@json_option("scan")
@click.option("--format", "out_format", type=click.Choice(["text", "json", "sarif"]), default=None,
              help="Output format: text (the default report), json (as --json) or sarif (a SARIF 2.1.0 log for "
                   "code-scanning dashboards: one result per dangerous or needs-trust global and pickle, with the "
                   "file, the pickle and the key path).")
@click.option("--jsonl", is_flag=True,
              help="Print one JSON object per checkpoint (its entry of --json), one line each, as files finish.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, metavar="N",
              help="Scan N checkpoints at once: threads for URLs (waits on the network), processes for local files "
                   "(CPU work). Results come as files finish. Without it, a folder of many local files (128 or more) "
                   "is shared among processes forked from this one, one per CPU it may use, and printed as with "
                   "--jobs 1; anything else is scanned one file at a time.")
@click.option("--cache", "cache_path", type=click.Path(dir_okay=False), default=None,
              help="A SQLite file of earlier results (made when missing): a checkpoint whose path or URL, size, "
                   "device, inode, modification and change times or ETag and ckptool version are unchanged is not "
                   "read again. A row that does not validate is scanned again; the file must be as trusted as "
                   "ckptool itself (whoever can write it can make a scan say safe). A symbolic link that dangles or "
                   "leaves its folder is refused.")
@click.option("--all", "show_all", is_flag=True, help="List allowed globals too, not only the ones that are not.")
@click.option("--strict", is_flag=True,
              help="A stricter exit status for the same verdicts: a file that needs trust fails as a dangerous one "
                   "(exit 0 safe, 1 dangerous or needs trust, 2 unreadable, 5 incomplete).")
@click.pass_context
def scan_cmd(ctx: click.Context, paths: tuple[str, ...], as_json: bool, out_format: str | None, jsonl: bool,
             jobs: int | None, cache_path: str | None, show_all: bool, strict: bool) -> None:
    """Say whether loading each checkpoint in PATHS could run code, without running or importing anything.

    Every pickle in each file is read (zip members such as data.pkl and other .pkl files, nested zips, the five
    pickles of a legacy stream, legacy tar members, plain pickles whatever their name, TorchScript pickles, and
    pickles or zips appended after the data), and every global it would import gets a level:

    \b
      safe         torch.load(weights_only=True) accepts it (in a TorchScript archive, also the
                   __torch__.* types torch.jit.load resolves itself)
      needs-trust  a library class that runs no code of the file's choosing when loaded (torch.nn
                   modules, optimizers, numpy arrays and RNG state, argparse.Namespace, pathlib
                   paths, DCP metadata), or a class on no list (mypkg.Net): load it with
                   weights_only=False only if you trust the file and the package
      dangerous    a process, file, network, import or eval gadget (os.system, builtins.eval,
                   subprocess.Popen, functools.partial, torch.load, ...), or a function on no list:
                   loading would call it with arguments the file chooses

    A file is as bad as its worst global; a file that could not be read to its end is unreadable (unless a
    dangerous global came first); a file cut short (a pickle, a zip, a legacy storage block or a DCP record ending
    past the end of the data: a truncated download) whose globals are all safe is incomplete, never safe. A
    pickle torch.load does not read today (another zip member, data after the end)
    counts the same: other loaders and tools may read it. Directories are walked recursively for checkpoint files
    (a torch.distributed.checkpoint folder is read as one, .metadata then each record's byte range of the .distcp
    files) and end with a table of every file's verdict and the counts. Known library files are recognised by
    their content (accelerate's random_states_N.pkl: needs trust).

    Code that ships in a file outside its pickles is listed under "code" and counts in the verdict: a native
    library in any zip member (an AOTInductor .so: dangerous), a torch.package module (dangerous when a pickle
    of the package names it), TorchScript code/ (needs trust when it calls only torch's built-in ops, dangerous
    when it calls a custom op).

    What ships beside the weights is read too: gzip, zlib (joblib's compress), tar (a NeMo .nemo) and 7z (the 7z
    extra) are opened within a budget and each member scanned as a file; a .npy object array (alone or in an .npz)
    is read as the pickle numpy.load(allow_pickle=True) unpickles; a member path that leaves the archive is a note.
    The Hydra _target_ entries of a NeMo config (in a .nemo, or a NeMo 2 folder's context/model.yaml) are rated
    as globals; the modules a Hugging Face config's auto_map makes transformers run under trust_remote_code are
    listed under "code" with their sha256 (dangerous when they call os.system, subprocess, eval, sockets...).
    A global the pickle only holds as a value (never calls: typing.Any in OmegaConf hyper-parameters) needs
    trust at most, unless a list names it; a "global" that is no Python name is never dangerous.

    \b
    Exit status (the worst file decides):
      0  every file is safe
      1  a file is dangerous
      2  a file could not be read (and none is dangerous)
      4  a file needs trust (and none is dangerous or unreadable)
      5  a file is incomplete (and none is dangerous, unreadable or needs trust)
      2  also: a path does not exist, or a folder holds no checkpoint file (Error: line)

    A path may be a URL prefix (s3://bucket/models/: its objects that are checkpoints by their content). With a
    prefix, --jobs, --jsonl or --cache, files print as they finish and a path that cannot be read is a row with its
    error, never the end of the run (docs/scale.md).

    With --strict (a policy on the same verdicts): 0 safe, 1 a file is dangerous or needs trust (names a global
    outside the allowlist or ships code), 2 unreadable, 5 incomplete.
    --quiet prints nothing (the exit status answers); --json gives "strict", "exit_code", "verdict" (the worst
    file's) and "files" (per file:
    "verdict" (safe, incomplete, needs-trust, error or dangerous) and "exit_code", each global's "status" and
    "level", each pickle's "hidden" and "key_paths");
    --format sarif prints a SARIF 2.1.0 log (rules CKPT001 dangerous, CKPT002 needs trust, CKPT003 unreadable,
    CKPT004 code in the file, CKPT005 incomplete, CKPT006 a config target), with the same exit status; --json
    gives each file's "incomplete" (what is cut short).

    \b
    Examples:
      ckptool scan model.pth
      ckptool scan ~/Downloads/*.bin --json
      ckptool scan checkpoints/ --strict
      ckptool scan models/ --format sarif > ckptool.sarif
      ckptool scan s3://bucket/models/ --jobs 16 --jsonl --cache scans.sqlite
    """
    if as_json and out_format not in (None, "json"):
        raise UsageError(f"--json and --format {out_format} ask for two outputs; give one")
    fmt = "json" if as_json else out_format or "text"
    with rare_collections():  # the results of many files are kept: collections that walk them, rarely
        ctx.exit(_many(paths, fmt, jsonl, jobs or 1, cache_path, strict, show_all)
                 if (jobs or 1) > 1 or jsonl or cache_path or any(_is_prefix(p) for p in paths)
                 else _one_run(paths, fmt, strict, show_all, usable_cpus() if jobs is None else jobs))


def _one_run(paths: tuple[str, ...], fmt: str, strict: bool, show_all: bool, jobs: int) -> int:
    """The checkpoints ``paths`` scanned and printed together (the report, --json or SARIF); the exit status.
    ``jobs``: many local files are shared among up to that many processes (:func:`_scanned`)."""
    listed = list(iter_targets(paths))  # a path that does not exist, a folder with no checkpoint: raised here
    if fmt == "text":  # each file's report, row and verdict: what the text prints (it shows no key paths)
        rendered = _scanned(listed, jobs, False, partial(_rendered, show_all=show_all, strict=strict))
        code = verdicts_exit_status([v for _r, _row, v in rendered], strict=strict)
        if not is_quiet():  # one write: the reports are all known by now (a row per echo flushed each, 2 per file)
            parts = [report for report, _row, _v in rendered]
            if len(rendered) > 1:
                parts += [_table_of([row for _r, row, _v in rendered]), _summary_of([v for _r, _row, v in rendered])]
            click.echo("\n\n".join(parts))
        return code
    results = _scanned(listed, jobs, True, None)
    code = exit_status(results, strict=strict)
    if fmt == "json":
        emit_json("scan", {"strict": strict, "exit_code": code, "verdict": worst_verdict(results),
                           "files": [r.to_dict(strict=strict) for r in results]})
    else:
        sarif = plugin("ckptool.ops.scan.sarif:to_sarif")  # only for --format sarif
        click.echo(json.dumps(sarif(results, version=__version__, strict=strict), indent=2))
    return code


def _scanned(listed: list[tuple[str, list[str]]], jobs: int, key_paths: bool, each: Any) -> list[Any]:
    """The results of the paths ``listed`` (``each`` of each, when given, worked out in the process that scanned
    it: what a report prints for it), many local files shared among up to ``jobs`` processes forked from this one
    (:func:`ckptool._fork.shared`; a run of one file does not import it)."""
    task = partial(_scan_one_listed, key_paths=key_paths, each=each)
    if jobs > 1 and len(listed) > 1 and not any(source.is_url(p) for p, _notes in listed):
        from ckptool import _fork  # noqa: PLC0415

        n = _fork.fork_count(len(listed), jobs)
        if n > 1:
            return list(_fork.shared(listed, task, n))
    return [task(item) for item in listed]


def _scan_one_listed(item: tuple[str, list[str]], *, key_paths: bool, each: Any) -> Any:
    """:func:`~ckptool.scanning.entry.scan_listed` of one item of a listing (``each`` of its result, when given)."""
    res = scan_listed(*item, key_paths=key_paths)
    return res if each is None else each(res)
