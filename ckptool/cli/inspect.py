"""``ckptool inspect``: what a checkpoint holds, without running its code or importing torch."""

from __future__ import annotations

import gc
import json
from collections import Counter
from typing import Any

import click

from ckptool import _source as source
from ckptool._gc import gc_paused
from ckptool.cli._common import human_bytes
from ckptool.errors import UsageError
from ckptool.formats import plugin
from ckptool.model.allowlist import level_word
from ckptool.model.quantization import summary as quant_summary
from ckptool.model.units import human_count, plural
from ckptool.ops.inspect.advice import advice_lines, hidden_level, metadata_lines, security_lines
from ckptool.ops.inspect.entry import SCHEMA, CheckpointInfo, inspect
from ckptool.ops.inspect.values import ALL_VALUES, ValueInfo
from ckptool.readers import FORMATS

#: the schema of ``inspect --tree --json``
TREE_SCHEMA = "ckptool.inspect-tree/1"
_PATH_PART = 48  # characters of one dotted key component shown in the tables (the JSON keeps them whole)


@click.command("inspect")
@gc_paused  # 50,000 TensorInfo rows and their JSON: the cycle collector would walk them again and again
@click.argument("paths", metavar="PATH...", nargs=-1, required=True, type=click.Path(dir_okay=True))
@click.option("--json", "as_json", is_flag=True,
              help=f"Print one JSON object instead of tables: \"schema\": \"{SCHEMA}\", every tensor, \"totals\" "
                   "(storage bytes per device and dtype) and \"values\" (the non-tensor entries). With several "
                   "checkpoints: a JSON array of those objects.")
@click.option("--jsonl", is_flag=True,
              help="Print one JSON object per checkpoint (the object of --json), one line each, as checkpoints "
                   "finish; a checkpoint that cannot be read is {\"schema\", \"path\", \"error\"}.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="With several checkpoints: inspect N at once (threads for URLs, processes for local files, as "
                   "scan --jobs). Rows come as checkpoints finish.")
@click.option("--all", "show_all", is_flag=True,
              help="List every tensor and many more non-tensor entries (by default long tables, lists and dicts are "
                   "summarised).")
@click.option("--limit", default=30, show_default=True, type=click.IntRange(min=1),
              help="Tensor rows to show before summarising.")
@click.option("--tree", "as_tree", is_flag=True,
              help="Print the module tree instead of tables: a line per module (repeated blocks folded, "
                   "layers.0-31 x32) with parameters, bytes, dtypes and devices; with --json, the tree as data "
                   f"(\"schema\": \"{TREE_SCHEMA}\").")
@click.option("--depth", type=click.IntRange(min=1), metavar="N",
              help="With --tree: show N levels (1 = the top-level modules).")
@click.pass_context
def inspect_cmd(ctx: click.Context, paths: tuple[str, ...], as_json: bool, jsonl: bool, jobs: int, show_all: bool,
                limit: int, as_tree: bool, depth: int | None) -> None:
    """Show what checkpoint PATH holds, without running its code or reading tensor data.

    Prints the format (FORMATS), the kind (state_dict, training_checkpoint, full_model, torchscript,
    exported_program, package, tensors), a table of tensors (key, shape, dtype, saved device, size), storage bytes
    per device and dtype (a storage shared by several tensors, such as tied weights, counted once), the state_dicts
    found with their wrapper prefixes and the command that removes them, the non-tensor entries (epoch, steps,
    learning rates, hyper-parameters, scaler state; RNG states as "RNG state (N bytes)"), and the globals the pickle
    would import, marked by whether torch.load(weights_only=True) allows them and by the level `ckptool scan` gives
    them (safe, needs-trust, DANGEROUS). For a torch.export archive (.pt2): its weights and constants, the program's
    signature (inputs, outputs, lifted parameters and buffers) and the archive's versions. Torch is not imported and
    nothing from the file is run.

    PATH may be a URL fsspec reads (s3://, gs://, http(s)://, hf://; pip install 'ckptool[remote]'): only the
    zip directory, the pickle and the headers are fetched, by range requests, and the bytes read are shown.

    Several checkpoints (several paths, a URL prefix ending in /, --jsonl or --jobs; with --json or --jsonl): a
    folder that is one checkpoint (a sharded set, DCP, DeepSpeed or Megatron folder) is inspected as one, any other
    folder is walked as `ckptool scan` walks it (checkpoint files recognised by content, a DCP folder as one), a URL
    prefix lists its objects. Each checkpoint prints as it finishes; one that cannot be read is a row with its
    error, never the end of the run. Exit status: 0 every checkpoint read, 1 a row holds an error, 2 no checkpoint
    found (Error: line). See docs/scale.md.

    \b
    Examples:
      ckptool inspect model.safetensors
      ckptool inspect checkpoints/ runs/ --jsonl --jobs 4
      ckptool inspect s3://bucket/models/ --json --jobs 16
    """
    if depth is not None and not as_tree:
        raise click.UsageError("--depth applies to --tree")
    if len(paths) > 1 or jsonl or jobs > 1 or any(source.is_url(p) and p.endswith("/") for p in paths):
        ctx.exit(_many(paths, as_json, jsonl, jobs, show_all, as_tree))
    path = paths[0]
    info = inspect(path, ALL_VALUES) if show_all else inspect(path)
    if as_tree:
        _print_tree(info, depth, as_json)
        return
    if as_json:
        _echo_json(info)
        return
    _print_info(info, limit=None if show_all else limit)


#: the format names of ``--help``, from the registry: a format added there is listed without editing this text
inspect_cmd.help = (inspect_cmd.help or "").replace("(FORMATS)", f"({', '.join(FORMATS)})", 1)


def _many(paths: tuple[str, ...], as_json: bool, jsonl: bool, jobs: int, show_all: bool, as_tree: bool) -> int:
    """Many checkpoints as one run (:func:`ckptool.cli._many.run_inspect_many`); its exit status.

    Raises:
        UsageError: text or --tree output asked for, or both --json and --jsonl.
    """
    if as_json and jsonl:
        raise UsageError("--json and --jsonl ask for two outputs; give one")
    if as_tree or not (as_json or jsonl):
        raise UsageError(f"{'--tree' if as_tree else 'the tables'} show one checkpoint; for several paths (or "
                         "--jobs) give --json (one JSON array) or --jsonl (one JSON object a line)")
    from ckptool.cli._many import run_inspect_many  # noqa: PLC0415 - deferred: not on the path of one file

    # the command pauses the cycle collector for one checkpoint (gc_paused); a run over many needs it between them,
    # and each inspect pauses it again while it reads
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        return run_inspect_many(paths, jsonl, jobs=jobs, show_all=show_all)
    finally:
        if not was_enabled:
            gc.disable()


def _print_tree(info: CheckpointInfo, depth: int | None, as_json: bool) -> None:
    tree = info.tree()
    if as_json:
        click.echo(json.dumps({"schema": TREE_SCHEMA, "path": info.path, "format": info.format,
                               "tree": tree.to_dict(max_depth=depth)}))
        return
    params = f"{human_count(tree.params)} param{'' if tree.params == 1 else 's'}"
    click.echo(f"{info.path}: {info.format}, {plural(len(info.tensors), 'tensor')}, {params}, "
               f"{human_bytes(tree.nbytes)}")
    for line in plugin("ckptool.model.tree:tree_lines")(tree, depth):  # (--tree only)
        click.echo(line)


def _echo_json(info: CheckpointInfo) -> None:
    """``info`` as one JSON object and a newline (indented for up to 200 tensors), written piece by piece: the
    text of ``json.dumps(info.to_dict())``, without building it whole (9 MB for 50,000 tensors). Unindented JSON
    (ASCII, no line breaks) goes out as bytes: click then neither looks for ANSI colour codes in it (JSON escapes
    control characters) nor translates line ends."""
    indent = None if len(info.tensors) > 200 else 2
    for piece in info.json_pieces(indent=indent):
        click.echo(piece.encode("ascii") if indent is None else piece, nl=False)
    click.echo("")


def _print_info(info: CheckpointInfo, limit: int | None) -> None:
    """The tables of ``ckptool inspect``, then the safety line and the advice (:mod:`ckptool.ops.inspect.advice`)."""
    _print_summary(info)
    _print_tensors(info, limit)
    _print_state_dicts(info)
    for prog in info.programs:
        _print_program(prog)
    if info.package is not None:
        _print_package(info.package)
    _print_values(info)
    _print_globals(info)
    click.echo("")
    for line in security_lines(info) + advice_lines(info):
        click.echo(_one_line(line))


def _print_summary(info: CheckpointInfo) -> None:
    echo = click.echo
    uses = Counter(t.storage_key for t in info.tensors if t.storage_key is not None)
    shared = sum(n for n in uses.values() if n > 1)
    echo(f"File:     {info.path} ({human_bytes(info.size)})")
    if info.bytes_read is not None:
        echo(f"Read:     {human_bytes(info.bytes_read)} over the network (range requests; tensor data not read)")
    echo(f"Format:   {info.format}")
    echo(f"Kind:     {info.kind}")
    echo(f"Tensors:  {len(info.tensors)} tensors, {info.storages} storages, {human_bytes(info.total_bytes)} in "
         "storages (shared storages counted once)"
         + (f"; {shared} tensors share storages (tied weights, views)" if shared else ""))
    if info.quantization:
        echo(f"Quant:    {quant_summary(info.quantization)}")
    for line in metadata_lines(info):
        echo(_one_line(line))


def _print_tensors(info: CheckpointInfo, limit: int | None) -> None:
    from tabulate import tabulate

    if not info.tensors:
        return
    echo = click.echo
    rows = [(_short_path(t.key), "x".join(map(str, t.shape)) or "scalar", t.dtype, t.device, human_bytes(t.nbytes))
            for t in (info.tensors if limit is None else info.tensors[:limit])]
    echo("")
    echo(tabulate(rows, headers=["key", "shape", "dtype", "device", "size"]))
    if limit is not None and len(info.tensors) > limit:
        echo(f"... {len(info.tensors) - limit} more tensors (use --all to list every tensor, --json for machines)")
    echo("")
    echo(tabulate([(r.device, r.dtype, r.tensors, r.storages, human_bytes(r.bytes)) for r in info.totals],
                  headers=["device", "dtype", "tensors", "storages", "storage bytes"]))


def _print_state_dicts(info: CheckpointInfo) -> None:
    from tabulate import tabulate

    if not info.state_dicts:
        return
    click.echo("")
    click.echo("State dicts:")
    rows = [(sd.path or "(top level)", sd.tensors, " ".join(sd.prefixes) or "-", sd.remedy or "-")
            for sd in info.state_dicts]
    click.echo(tabulate(rows, headers=["path", "tensors", "wrapper prefix", "remove with"]))


def _print_values(info: CheckpointInfo) -> None:
    from tabulate import tabulate

    if not info.values:
        return
    click.echo("")
    click.echo("Other entries (not tensors):")
    click.echo(tabulate([_value_row(v) for v in info.values], headers=["key", "type", "value"],
                        disable_numparse=True))
    if not info.values_complete:
        click.echo("... more entries not shown (use --all to see more, --json for machines)")


def _print_globals(info: CheckpointInfo) -> None:
    """The globals with torch's weights_only verdict and scan's level, then the pickles torch.load does not read."""
    from tabulate import tabulate

    echo = click.echo
    if info.globals:
        echo("")
        echo("Globals the pickle would import:")
        echo(tabulate([(g.name, "allowed" if g.allowed else "NOT allowed", level_word(g.level, g.reason))
                       for g in info.globals], headers=["global", "torch.load(weights_only=True)", "ckptool scan"]))
    sc = info.scan
    if sc is not None and sc.hidden:
        echo("")
        echo("Pickles torch.load does not read today (other loaders, extraction tools or a later torch may):")
        echo(tabulate([(_one_line(p.where), _one_line(", ".join(p.globals)) or "-", _one_line(hidden_level(sc, p)))
                       for p in sc.hidden], headers=["where", "globals", "ckptool scan"]))


def _print_program(prog: dict[str, Any]) -> None:
    """The signature of one exported program (``CheckpointInfo.programs``, a ``torch.export`` archive)."""
    def arg(e: dict[str, Any]) -> str:
        shape = ("x".join(map(str, e["shape"])) or "scalar") if "shape" in e else ""
        return _one_line(" ".join(x for x in (e["name"], e.get("dtype", ""), shape) if x))

    echo = click.echo
    echo("")
    echo(f"Exported program {prog['name']!r} (schema {prog['schema_version']}, written by torch "
         f"{prog.get('torch_version') or '?'}): state_dict of {prog['parameters']} parameters and {prog['buffers']} "
         f"persistent buffers; {prog['constants']} constants (tensor constants, non-persistent buffers)")
    user = [arg(e) for e in prog["inputs"] if e["kind"] == "user_input"]
    lifted = [e for e in prog["inputs"] if e["kind"] != "user_input"]
    echo(f"  inputs:  {', '.join(user) or 'none'}")
    kinds = Counter(e["kind"] for e in lifted)
    if kinds:
        echo("  lifted:  " + ", ".join(f"{n} {k}" for k, n in kinds.items()) + " (the tensors above)")
    outs = [arg(e) if e["kind"] == "user_output" else f"{arg(e)} ({e['kind']})" for e in prog["outputs"]]
    echo(f"  outputs: {', '.join(outs) or 'none'}")


def _print_package(pkg: dict[str, Any]) -> None:
    """The pickles, shipped modules and extern modules of a ``torch.package`` archive (``CheckpointInfo.package``)."""
    echo = click.echo
    echo("")
    echo(f"torch.package archive (format version {pkg['version'] or '?'}, written by Python "
         f"{pkg['python_version'] or '?'}):")
    for r in pkg["resources"]:
        echo(f"  pickle {_one_line(r['member'])}: {r['kind']}, {r['tensors']} tensors "
             f"(load_pickle({_one_line(r['package'])!r}, {_one_line(r['resource'])!r}))")
    echo(f"  modules it ships (run when loaded): {_one_line(', '.join(pkg['modules'])) or 'none'}")
    extern = _one_line(", ".join(pkg["extern_modules"])) or "none"
    echo(f"  extern modules (taken from the loading environment): {extern}")


def _one_line(text: str) -> str:
    """``text`` with control characters escaped, so that a hostile key cannot break the table."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _short_path(path: str) -> str:
    """A dotted key for a table: components longer than :data:`_PATH_PART` characters (Lightning's callback state
    keys) cut, control characters escaped."""
    return _one_line(".".join(p if len(p) <= _PATH_PART else p[:_PATH_PART - 1] + "…" for p in path.split(".")))


def _value_row(v: ValueInfo) -> tuple[str, str, str]:
    return _short_path(v.path), _one_line(v.type), _one_line(v.shown)
