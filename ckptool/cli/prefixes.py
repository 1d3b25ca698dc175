"""The wrapper-prefix commands: ``strip-dataparallel``, ``strip-prefix``, ``add-prefix`` and ``unwrap``.

Each is a thin Click command over :mod:`ckptool.ops.rewrite.prefixes`; none imports torch.
"""

from __future__ import annotations

from collections.abc import Callable

import click

from ckptool.cli._common import (
    ZIP_NEEDS_SEEK,
    Progress,
    allow_missing_option,
    allow_nested_option,
    claim_output,
    device_options,
    emit_json,
    json_option,
    key_option,
    mapping_of,
    refuse_stdout,
    renamed_state_dict,
    report_kept,
    report_rename,
    set_output_options,
    source_size,
    write_payload,
)
from ckptool.cli._hints import hint_for, hint_payload, renamed_keys, report_hint
from ckptool.ops.rewrite.prefixes import (
    RenameResult,
    add_prefix,
    rename_output,
    strip_dataparallel,
    strip_prefix,
    unwrap,
)
from ckptool.ops.rewrite.sets import refuse_existing_set, set_payload
from ckptool.ops.rewrite.stream import ProgressFn

_EPILOG_SAFETY = (
    "Tensor records are copied, not decoded (torch is not imported): the cost is the cost of copying the file. "
    "The output is written to a temporary file, fsynced and renamed into place; SRC is left untouched unless "
    "--in-place is given, and nothing is written when the command fails. --to / --map re-tag the storages in the "
    "same pass, as `ckptool remap` does (--to cpu: a plain torch.load opens the output without a GPU). A "
    "torch.distributed.checkpoint folder is written as a new DCP folder (-o a new or empty folder): the FQNs are "
    "renamed in its .metadata as the state_dicts of its nesting, its .distcp files copied byte for byte."
)


def _run(operation: str, src: str, dst: str | None, in_place: bool, force: bool, as_json: bool, to: str | None,
         maps: tuple[str, ...], write: Callable[[str, ProgressFn], RenameResult]) -> None:
    """Check the output, run ``write(output path, progress callback)`` under the progress bar, and report."""
    refuse_stdout(dst, ZIP_NEEDS_SEEK)
    out = rename_output(operation, src, dst, in_place)
    refuse_existing_set(src, out, force=force)
    out = claim_output(out, force=force, in_place=in_place, given=dst)
    with Progress(operation, source_size(src)) as bar:
        res = write(out, bar)
    if as_json:
        hint = hint_for(res.dst, state_dict=renamed_state_dict(res), to=to, maps=maps, renamed=renamed_keys(res))
        emit_json(operation, {"operation": res.operation, **write_payload(res, res), **set_payload(res),
                              **hint_payload(hint)})
        return
    report_rename(res)
    click.echo(res)
    report_kept(res)
    report_hint(res.dst, state_dict=renamed_state_dict(res), to=to, maps=maps, renamed=renamed_keys(res))


@click.command("strip-dataparallel", epilog=_EPILOG_SAFETY)
@click.argument("src", type=click.Path(dir_okay=True))
@key_option()
@device_options
@allow_missing_option
@set_output_options
@json_option("strip-dataparallel")
def strip_dataparallel_cmd(src: str, key: str | None, to: str | None, maps: tuple[str, ...], allow_missing: bool,
                           dst: str | None, in_place: bool, force: bool, as_json: bool) -> None:
    """Remove the leading `module.` that nn.DataParallel / DistributedDataParallel add to state_dict keys.

    Fixes "Unexpected key(s) in state_dict: module.conv1.weight" when loading into the bare model. Only whole
    components are removed: mlp_module.fc.weight never changes. The state_dict's _metadata is renamed with the
    keys; optimizer state and other entries stay as they are. On a full-model pickle
    (torch.save(nn.DataParallel(model))) the output holds the inner module, written without importing its class.
    Without -o the result is written next to SRC as <stem>.stripped<ext> (a folder: <folder>.stripped).

    \b
    Examples:
      ckptool strip-dataparallel model.pth
      ckptool strip-dataparallel last.ckpt --key state_dict -o last.bare.ckpt
    """
    _run("strip-dataparallel", src, dst, in_place, force, as_json, to, maps, lambda out, bar: strip_dataparallel(
        src, out, key=key, in_place=in_place, allow_missing=allow_missing, to=to, mapping=mapping_of(maps),
        progress=bar))


@click.command("strip-prefix", epilog=_EPILOG_SAFETY)
@click.argument("src", type=click.Path(dir_okay=True))
@click.argument("prefixes", nargs=-1, required=True, metavar="PREFIX [PREFIX ...]")
@key_option()
@device_options
@allow_missing_option
@set_output_options
@json_option("strip-prefix")
def strip_prefix_cmd(src: str, prefixes: tuple[str, ...], key: str | None, to: str | None, maps: tuple[str, ...],
                     allow_missing: bool, dst: str | None, in_place: bool, force: bool, as_json: bool) -> None:
    """Remove PREFIX (whole dotted components, e.g. `model.`) from the front of state_dict keys.

    Several prefixes are removed in the order given, each at most once per key, so `strip-prefix SRC model.
    module.` turns both model.module.fc.weight and module.fc.weight into fc.weight. Keys without the prefix are
    kept. The state_dict's _metadata is renamed with the keys; optimizer state and other entries stay as they
    are. Exits with an error when no key carries a PREFIX (see --allow-missing) or when two keys would become
    one (the colliding keys are listed). Without -o the result is written next to SRC as <stem>.stripped<ext>
    (a folder: <folder>.stripped).

    \b
    Examples:
      ckptool strip-prefix lightning.ckpt model.          # LightningModule attribute
      ckptool strip-prefix ckpt.pt module. --key model_state_dict -o bare.pt
    """
    _run("strip-prefix", src, dst, in_place, force, as_json, to, maps, lambda out, bar: strip_prefix(
        src, list(prefixes), out, key=key, in_place=in_place, allow_missing=allow_missing, to=to,
        mapping=mapping_of(maps), progress=bar))


@click.command("add-prefix", epilog=_EPILOG_SAFETY)
@click.argument("src", type=click.Path(dir_okay=True))
@click.argument("prefix")
@key_option()
@device_options
@allow_nested_option
@allow_missing_option
@set_output_options
@json_option("add-prefix")
def add_prefix_cmd(src: str, prefix: str, key: str | None, to: str | None, maps: tuple[str, ...],
                   allow_nested: bool, allow_missing: bool, dst: str | None, in_place: bool, force: bool,
                   as_json: bool) -> None:
    """Put PREFIX (whole dotted components, e.g. `module.`) in front of every state_dict key.

    For loading a bare state_dict into a wrapped model with strict=True: `module.` for nn.DataParallel /
    DistributedDataParallel, `_orig_mod.` for a torch.compile model. The state_dict's _metadata gets the
    prefix too; optimizer state and other entries stay as they are. Keys that already start with PREFIX are
    refused (the result would be module.module.) unless --allow-nested. Without -o the result is written next
    to SRC as <stem>.prefixed<ext> (a folder: <folder>.prefixed).

    \b
    Examples:
      ckptool add-prefix model.pth module.
      ckptool add-prefix ckpt.pt _orig_mod. --key model_state_dict -o compiled.pt
    """
    _run("add-prefix", src, dst, in_place, force, as_json, to, maps, lambda out, bar: add_prefix(
        src, prefix, out, key=key, in_place=in_place, allow_nested=allow_nested, allow_missing=allow_missing, to=to,
        mapping=mapping_of(maps), progress=bar))


@click.command("unwrap", epilog=_EPILOG_SAFETY)
@click.argument("src", type=click.Path(dir_okay=True))
@key_option()
@device_options
@allow_missing_option
@set_output_options
@json_option("unwrap")
def unwrap_cmd(src: str, key: str | None, to: str | None, maps: tuple[str, ...], allow_missing: bool,
               dst: str | None, in_place: bool, force: bool, as_json: bool) -> None:
    """Remove every wrapper prefix that `ckptool inspect` reports from state_dict keys, and say what was removed.

    Removes `module.` (DataParallel, DDP), `_orig_mod.` (torch.compile), `_fsdp_wrapped_module.` (FSDP) and
    `_checkpoint_wrapped_module.` (activation checkpointing) from the front of keys in any stacking order
    (module._orig_mod. and _orig_mod.module. both go), the wrapper-only names _orig_mod,
    _fsdp_wrapped_module and _checkpoint_wrapped_module also from the middle of keys, and an attribute prefix
    that every key of the state_dict shares (Lightning's `model.`, `net.`). On a full-model pickle the
    wrapper objects are replaced by the modules they hold. FSDP flat parameters (_flat_param) cannot be renamed:
    the command explains how to consolidate them. Without -o the result is written next to SRC as
    <stem>.unwrapped<ext> (a folder: <folder>.unwrapped).

    \b
    Examples:
      ckptool unwrap compiled_ddp.pt
      ckptool unwrap model.pth --in-place
    """
    _run("unwrap", src, dst, in_place, force, as_json, to, maps, lambda out, bar: unwrap(
        src, out, key=key, in_place=in_place, allow_missing=allow_missing, to=to, mapping=mapping_of(maps),
        progress=bar))
