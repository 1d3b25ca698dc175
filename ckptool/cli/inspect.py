"""``ckptool inspect``: what a checkpoint holds, without running its code or importing torch."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import click

from ckptool._gc import gc_paused
from ckptool.cli._common import human_bytes
from ckptool.model.allowlist import DANGEROUS
from ckptool.model.tree import tree_lines
from ckptool.model.units import human_count
from ckptool.ops.inspect.entry import SCHEMA, CheckpointInfo, inspect
from ckptool.ops.inspect.values import ALL_VALUES, ValueInfo
from ckptool.ops.scan.entry import PickleFinding, ScanResult

#: the schema of ``inspect --tree --json``
TREE_SCHEMA = "ckptool.inspect-tree/1"
_PATH_PART = 48  # characters of one dotted key component shown in the tables (the JSON keeps them whole)


@click.command("inspect")
@gc_paused  # 50,000 TensorInfo rows and their JSON: the cycle collector would walk them again and again
@click.argument("path", type=click.Path(dir_okay=True))
@click.option("--json", "as_json", is_flag=True,
              help=f"Print one JSON object instead of tables: \"schema\": \"{SCHEMA}\", every tensor, \"totals\" "
                   "(storage bytes per device and dtype) and \"values\" (the non-tensor entries).")
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
def inspect_cmd(path: str, as_json: bool, show_all: bool, limit: int, as_tree: bool, depth: int | None) -> None:
    """Show what checkpoint PATH holds, without running its code or reading tensor data.

    Prints the format (torch-zip, torch-legacy, torchscript, torch-export, torch-package, safetensors, pickle), the
    kind (state_dict, training_checkpoint, full_model, torchscript, exported_program, package, tensors), a table of
    tensors (key, shape, dtype, saved device, size), storage bytes per device and dtype (a storage shared by several
    tensors, such as tied weights, counted once), the state_dicts found with their wrapper prefixes and the
    command that removes them, the non-tensor entries (epoch, steps, learning rates, hyper-parameters, scaler
    state; RNG states as "RNG state (N bytes)"), and the globals the pickle would import, marked by whether
    torch.load(weights_only=True) allows them. For a torch.export archive (.pt2): its weights and constants, the
    program's signature (inputs, outputs, lifted parameters and buffers) and the archive's versions. Torch is
    not imported and nothing from the file is run.

    PATH may be a URL fsspec reads (s3://, gs://, http(s)://, hf://; pip install 'ckptool[remote]'): only the
    zip directory, the pickle and the headers are fetched, by range requests, and the bytes read are shown.
    """
    if depth is not None and not as_tree:
        raise click.UsageError("--depth applies to --tree")
    info = inspect(path, ALL_VALUES) if show_all else inspect(path)
    if as_tree:
        _print_tree(info, depth, as_json)
        return
    if as_json:
        _echo_json(info)
        return
    _print_info(info, limit=None if show_all else limit)


def _print_tree(info: CheckpointInfo, depth: int | None, as_json: bool) -> None:
    tree = info.tree()
    if as_json:
        click.echo(json.dumps({"schema": TREE_SCHEMA, "path": info.path, "format": info.format,
                               "tree": tree.to_dict(max_depth=depth)}))
        return
    click.echo(f"{info.path}: {info.format}, {len(info.tensors)} tensors, {human_count(tree.params)} params, "
               f"{human_bytes(tree.nbytes)}")
    for line in tree_lines(tree, depth):
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
    from tabulate import tabulate

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
    if info.format == "deepspeed" and info.metadata:  # ZeRO facts, one per line (ckptool.ops.inspect.deepspeed)
        for k, v in info.metadata.items():
            if k != "consolidate":
                echo(f"  {k.replace('_', ' ')}: {_one_line(v)}")
    elif info.metadata:
        echo(f"Metadata: {json.dumps(info.metadata)[:200]}")
    if info.tensors:
        rows = [(_short_path(t.key), "x".join(map(str, t.shape)) or "scalar", t.dtype, t.device, human_bytes(t.nbytes))
                for t in (info.tensors if limit is None else info.tensors[:limit])]
        echo("")
        echo(tabulate(rows, headers=["key", "shape", "dtype", "device", "size"]))
        if limit is not None and len(info.tensors) > limit:
            echo(f"... {len(info.tensors) - limit} more tensors (use --all to list every tensor, --json for machines)")
        echo("")
        echo(tabulate([(r.device, r.dtype, r.tensors, r.storages, human_bytes(r.bytes)) for r in info.totals],
                      headers=["device", "dtype", "tensors", "storages", "storage bytes"]))
    if info.state_dicts:
        echo("")
        echo("State dicts:")
        sd_rows: list[tuple[str, int, str, str]] = []
        for sd in info.state_dicts:
            fix = sd.fix or ""
            if sd.flat_params:
                fix = "FSDP flat parameters: consolidate first (torch.distributed.checkpoint / Lightning)"
            sd_rows.append((sd.path or "(top level)", sd.tensors, " ".join(sd.prefixes) or "-", fix or "-"))
        echo(tabulate(sd_rows, headers=["path", "tensors", "wrapper prefix", "remove with"]))
    for prog in info.programs:
        _print_program(prog)
    if info.package is not None:
        _print_package(info.package)
    if info.values:
        echo("")
        echo("Other entries (not tensors):")
        echo(tabulate([_value_row(v) for v in info.values], headers=["key", "type", "value"], disable_numparse=True))
        if not info.values_complete:
            echo("... more entries not shown (use --all to see more, --json for machines)")
    if info.globals:
        echo("")
        echo("Globals the pickle would import:")
        echo(tabulate([(g.name, "allowed" if g.allowed else "NOT allowed",
                        g.status if g.status != "dangerous" else f"DANGEROUS: {g.reason}") for g in info.globals],
                      headers=["global", "torch.load(weights_only=True)", "ckptool scan"]))
    sc = info.scan
    if sc is not None and sc.hidden:
        echo("")
        echo("Pickles torch.load does not read today (other loaders, extraction tools or a later torch may):")
        echo(tabulate([(_one_line(p.where), _one_line(", ".join(p.globals)) or "-", _hidden_level(sc, p))
                       for p in sc.hidden], headers=["where", "globals", "ckptool scan"]))
    echo("")
    for line in _security(info) + _advice(info):
        echo(line)


def _hidden_level(sc: ScanResult, p: PickleFinding) -> str:
    level = sc.pickle_level(p)
    shown = level.upper() if level == DANGEROUS else level
    return shown if not p.error or level == DANGEROUS else f"{shown}; unreadable: {_one_line(p.error[:80])}"


def _security(info: CheckpointInfo) -> list[str]:
    """One line with the verdict of ``ckptool scan`` (the same analysis) when it is not plain safe."""
    sc = info.scan
    if sc is None or sc.verdict == "safe":
        return []
    if sc.verdict == DANGEROUS:
        bad = [g for g in sc.globals if g.status == DANGEROUS]
        code = [c for c in sc.code if c.level == DANGEROUS]
        if not bad and code:  # code that ships in the file (scan_code), not a global
            return [(f"DANGEROUS: {_one_line(code[0].member)}: {code[0].reason}"
                     + (f" (and {len(code) - 1} more)" if len(code) > 1 else "")
                     + f". Do not load it; see `ckptool scan {info.path}`.")]
        where = sorted({w for g in bad for w in g.where})
        names = ", ".join(g.name for g in bad[:3])
        if all(p.hidden for p in sc.pickles if any(g.name in p.globals for g in bad)):
            return [(f"DANGEROUS: {', '.join(where[:3])}, a pickle torch.load does not read today, names {names}: "
                    "another loader, an unpacking tool or a later torch would run it. Do not use this file; see "
                    f"`ckptool scan {info.path}`.")]
        return [(f"DANGEROUS: loading this file can run {names}, named in {', '.join(where[:3])}. Do not load it; "
                f"see `ckptool scan {info.path}`.")]
    if sc.verdict == "error":
        return [(f"Part of this file could not be read to its end, so ckptool cannot vouch for it; see "
                f"`ckptool scan {info.path}`.")]
    if sc.recognised is not None:
        return [f"Needs trust: {sc.recognised[1]}."]
    if not info.unsafe_globals:  # needs trust only because of a hidden pickle
        return [(f"Needs trust: a pickle torch.load does not read today names globals outside the weights_only "
                f"allowlist; see `ckptool scan {info.path}`.")]
    return []


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


def _advice(info: CheckpointInfo) -> list[str]:
    out = []
    gpu = sorted(d for d in info.devices if d not in ("cpu", "meta"))
    if info.format == "torchscript":
        out.append("TorchScript archive: load it with torch.jit.load(path, map_location='cpu').")
    elif info.format == "deepspeed" and info.metadata:
        out.append(f"DeepSpeed ZeRO checkpoint: the tensors above are its consolidated state_dict. Consolidate it "
                   f"(no deepspeed needed) with: {info.metadata['consolidate']}")
    elif info.format == "torch-package":
        out.append("torch.package archive: torch.load does not read it; torch.package.PackageImporter(path)"
                   ".load_pickle(package, resource) loads a pickle and runs the modules it ships (listed above).")
    elif info.format == "torch-export":
        out.append(f"torch.export archive: `ckptool convert {info.path} -o weights.pth` (or .safetensors) writes its "
                   "state_dict (--key constants: its constants); torch.export.load(path) loads the program.")
    elif gpu:
        alt = f" (or --map {gpu[-1]}=cuda:0 for one GPU)" if gpu[-1] not in ("cuda:0", "cuda") else ""
        out.append(f"Saved on {', '.join(gpu)}: a plain torch.load needs that device. "
                   f"Run `ckptool remap {info.path} --to cpu`{alt} to load it anywhere.")
    unsafe = info.unsafe_globals
    if unsafe and info.format == "deepspeed":
        out.append(f"{len(unsafe)} global(s) name deepspeed classes: torch.load(weights_only=True) refuses these "
                   "files; ckptool reads them without importing anything.")
    elif unsafe and info.format == "torch-export":
        out.append(f"{len(unsafe)} global(s) are outside the weights_only allowlist: torch.export.load unpickles "
                   "these members without that allowlist; run `ckptool scan` and load it only if you trust its source.")
    elif unsafe and info.format not in ("torchscript", "torch-package"):
        out.append(f"{len(unsafe)} global(s) are outside the weights_only allowlist: torch.load(weights_only=True) "
                   "refuses this file; load with weights_only=False only if you trust its source.")
    elif info.weights_only_refusal is not None and info.format != "torchscript":
        out.append(f"torch.load(weights_only=True) refuses this file: its pickle uses {info.weights_only_refusal}, "
                   "which torch's weights_only unpickler does not read; load with weights_only=False only if you "
                   "trust its source.")
    return out
