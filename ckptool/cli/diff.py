"""``ckptool diff``: what changed between two checkpoints (a thin command over :func:`ckptool.ops.diff.compare.diff`;
nothing is run from the files, torch is not imported). Exit status as GNU ``diff``: 0 identical, 1 different,
2 usage errors; a file that cannot be read exits with its error's status."""

from __future__ import annotations

import json
import math
from collections import Counter

import click

from ckptool.ops.diff.compare import EQUAL, DiffResult, KeyDiff, diff


def _number(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


def _not_stored_lines(res: DiffResult) -> list[str]:
    """One line per property and side for :attr:`~ckptool.ops.diff.compare.KeyDiff.not_stored` (``"72 tensors: device
    cuda:0 in A, not stored in B (safetensors)"``), saying whether it counts (``--strict``)."""
    lost: dict[tuple[str, str], Counter[str]] = {}
    for t in res.tensors:
        for entry in t.not_stored:  # "device cuda:0 not stored in B", "stride [1, 6] not stored in B"
            what, side = entry.rsplit(" not stored in ", 1)
            prop, value = what.split(" ", 1)
            lost.setdefault((prop, side), Counter())[value] += 1
    counted = "counted (--strict)" if res.strict else "not counted as a difference (--strict counts it)"
    lines = []
    for (prop, side), values in lost.items():
        n = sum(values.values())
        other, fmt = ("A", res.format_b) if side == "B" else ("B", res.format_a)
        shown = ", ".join(values) if len(values) <= 3 else f"({len(values)} different)"
        what = f"non-contiguous stride {shown}" if prop == "stride" else f"{prop} {shown}"
        lines.append(f"{_tensors(n)}: {what} in {other}, not stored in {side} ({fmt}): {counted}")
    return lines


def _tensors(n: int) -> str:
    return f"{n} tensor{'' if n == 1 else 's'}"


def _print_folded(res: DiffResult) -> set[str]:
    """Print every change repeated over several tensors as one summary line (``"72 tensors: device cuda:0 ->
    cpu"``) and every property a format cannot store (:func:`_not_stored_lines`); return the changes folded. A
    shape change is never folded: its tensor's values are not compared, so it has a row, which shows it."""
    counts = Counter(c for t in res.tensors for c in t.changes if not c.startswith("shape "))
    repeated = {c for c, n in counts.items() if n > 1}
    for c, n in counts.items():
        if n > 1:
            click.echo(f"{_tensors(n)}: {c}")
    for line in _not_stored_lines(res):
        click.echo(line)
    return repeated


def _row(t: KeyDiff, changes: list[str]) -> tuple[str, ...]:
    """One table row: key (``A / B`` when renamed), changes, values verdict, max abs, max rel, mismatched."""
    return (t.key if t.key == t.key_b else f"{t.key} / {t.key_b}", "; ".join(changes) or "-",
            t.values + (f" ({t.note})" if t.note else ""), _number(t.max_abs), _number(t.max_rel),
            "-" if t.mismatched is None else f"{t.mismatched}/{t.numel}")


def _print_tensors(res: DiffResult, verbose: bool) -> None:
    """The tensors that differ: one row each with ``verbose``; else every change repeated over several tensors
    (and every property a format cannot store) as one summary line, and rows only for what is left (a shape
    change is never folded: it stays in its row)."""
    from tabulate import tabulate

    repeated = set() if verbose else _print_folded(res)
    rows = []
    for t in res.tensors:
        changes = [c for c in t.changes if c not in repeated] + (t.not_stored if verbose else [])
        if verbose or changes or t.values != EQUAL:
            rows.append(_row(t, changes))
    if rows:
        click.echo(tabulate(rows, headers=["tensor", "changes", "values", "max abs", "max rel", "mismatched"]))


def _print_result(res: DiffResult, verbose: bool = False) -> None:
    from tabulate import tabulate

    for who, path, fmt, key in (("A", res.a, res.format_a, res.key_a), ("B", res.b, res.format_b, res.key_b)):
        click.echo(f"{who}: {path} ({fmt})" + ("" if key is None else f", state_dict {key!r}"))
    if res.prefix:
        click.echo(f"keys: {res.prefix}")
    for who, keys in (("A", res.only_a), ("B", res.only_b)):
        if keys:
            shown = ", ".join(keys[:20]) + (f" (and {len(keys) - 20} more)" if len(keys) > 20 else "")
            click.echo(f"only in {who} ({len(keys)}): {shown}")
    _print_tensors(res, verbose)
    if res.values:
        click.echo(tabulate([(v.key, repr(v.a), repr(v.b)) for v in res.values], headers=["value", "A", "B"]))
    for line in res.shared:
        click.echo(f"shared storage differs: {line}")
    for note in res.notes:
        click.echo(f"note: {note}")
    click.echo(res.summary())


@click.command("diff")
@click.argument("a", type=click.Path(dir_okay=True))
@click.argument("b", type=click.Path(dir_okay=True))
@click.option("--rtol", type=float, default=None,
              help="Relative tolerance: compare values numerically, as torch.testing.assert_close does "
                   "(|b - a| <= atol + rtol * |a|; needs numpy). Default: bit-exact.")
@click.option("--atol", type=float, default=None, help="Absolute tolerance (see --rtol); the one not given is 0.")
@click.option("--keys-only", is_flag=True, help="Compare keys, shapes, dtypes, devices and sharing; skip values.")
@click.option("--strict", is_flag=True,
              help="Count as differences the properties one format cannot store (a device or a non-contiguous "
                   "stride against safetensors or DCP); default: listed as 'not stored in B', exit status "
                   "unchanged.")
@click.option("-v", "--verbose", is_flag=True,
              help="One row per tensor; default: a change repeated over several tensors is one summary line "
                   "('72 tensors: device cuda:0 -> cpu').")
@click.option("--key", default=None, metavar="PATH",
              help="Compare the state_dict at this dotted path (e.g. model_state_dict) of each torch file where it "
                   "resolves; default: a training checkpoint against a bare state_dict is compared through the "
                   "state_dict convert would pick.")
@click.option("--json", "as_json", is_flag=True, help='Print the result as JSON ("schema": "ckptool.diff/1").')
@click.pass_context
def diff_cmd(ctx: click.Context, a: str, b: str, rtol: float | None, atol: float | None, keys_only: bool,
             strict: bool, key: str | None, verbose: bool, as_json: bool) -> None:
    """Show what changed between checkpoints A and B, of any formats ckptool reads.

    Works across torch.save files (zip and legacy), safetensors, sharded sets (an *.index.json or its folder),
    torch.distributed.checkpoint folders (names, dtypes and shapes), .pt2 archives and DeepSpeed ZeRO folders
    (their consolidated fp32 state_dict, as convert reads it), and between them. A training checkpoint against
    a bare state_dict (safetensors, sharded...) is compared through the state_dict convert picks in it (--key
    PATH chooses it; the report names it). Keys are matched after
    removing wrapper prefixes such as DataParallel's `module.` (reported once); keys on one side only, shape,
    dtype, saved-device and stride changes, tied / shared storage differences and plain values (epoch,
    hyper-parameters) are reported. A property one format cannot store (safetensors keeps no device and stores
    every tensor contiguous) is listed as "not stored in B", not counted as a difference unless --strict. A
    change repeated over several tensors is one line (--verbose: a row per tensor). Values are compared tensor
    by tensor, streamed from the files (memory bounded by the largest tensor): bit-exact by default, or with
    --rtol/--atol by value, with the greatest absolute and relative difference per tensor. Nothing from the
    files is run, and torch is not needed.

    Exit status: 0 when A and B are identical, 1 when they differ, 2 on usage errors; with --quiet nothing is
    printed and the exit status alone says it.

    \b
    Examples:
      ckptool diff model.pth model.safetensors
      ckptool diff base.pth finetuned.pth --atol 1e-6 --rtol 1e-5
      ckptool diff a.pth b.pth --keys-only --json
      ckptool diff train.ckpt model.safetensors --key model_state_dict
      ckptool diff ds_checkpoint/ model.safetensors    # a DeepSpeed ZeRO folder
      ckptool diff gpu_model.pth model.safetensors --strict   # a device the file cannot keep counts too
    """
    res = diff(a, b, rtol=rtol, atol=atol, keys_only=keys_only, strict=strict, key=key)
    if as_json:
        click.echo(json.dumps(res.to_dict(), indent=2))
    else:
        _print_result(res, verbose)
    ctx.exit(0 if res.identical else 1)
