"""``ckptool remap``: re-tag the storages of a checkpoint for another device, optionally renaming keys in the same
pass (a thin command over :func:`ckptool.ops.rewrite.remap.remap`)."""

from __future__ import annotations

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
    report_write,
    set_output_options,
    source_size,
    write_payload,
)
from ckptool.cli._hints import hint_for, hint_payload, renamed_keys, report_hint
from ckptool.ops.rewrite.prefixes import RenameResult
from ckptool.ops.rewrite.remap import remap, remap_output
from ckptool.ops.rewrite.sets import refuse_existing_set, set_payload


@click.command("remap")
@click.argument("src", type=click.Path(dir_okay=True))
@device_options
@click.option("--unwrap", "unwrap_keys", is_flag=True,
              help="Also remove wrapper prefixes from the keys (module., _orig_mod., Lightning's model., ...; see "
                   "`ckptool unwrap`).")
@click.option("--strip-dataparallel", is_flag=True, help="Also remove the leading module. from the keys.")
@click.option("--strip-prefix", "strip_prefixes", metavar="PREFIX", multiple=True,
              help="Also remove PREFIX from the front of the keys (repeatable, applied in order).")
@click.option("--add-prefix", metavar="PREFIX", help="Also put PREFIX in front of every key (after any removal).")
@key_option("Dotted path of the state_dict to rename (default: every one found).")
@allow_missing_option
@allow_nested_option
@set_output_options
@json_option("remap")
def remap_cmd(src: str, to: str | None, maps: tuple[str, ...], unwrap_keys: bool, strip_dataparallel: bool,
              strip_prefixes: tuple[str, ...], add_prefix: str | None, key: str | None, allow_missing: bool,
              allow_nested: bool, dst: str | None, in_place: bool, force: bool, as_json: bool) -> None:
    """Re-tag the storages of checkpoint SRC so that a plain torch.load opens it on another device.

    Tensor bytes are copied, not decoded: no GPU is needed for any source or target tag, and memory stays
    bounded however large the file. Zip and legacy inputs, and sharded sets of torch shards
    (*.index.json or its folder: written as a set of the same layout with its index, -o a folder); the output
    is torch's zip format. A torch.distributed.checkpoint folder is written as a new DCP folder (-o a new or
    empty folder): its tensor chunks are always stored from CPU, so only the tensors its non-tensor entries hold
    are re-tagged, and a folder with none to change is refused. A torch.package archive gets the tags of its
    pickles' storage ids rewritten (every other member copied as it is; nothing of the package runs). Without -o the
    result is written next to SRC with the target in the name (model.cpu.pth; a folder: <folder>.cpu). A --map
    FROM that matches no storage is an error (the tags found are listed) unless --allow-missing. --unwrap,
    --strip-dataparallel, --strip-prefix and --add-prefix rename the state_dict keys in the same pass (one
    write).

    \b
    Examples:
      ckptool remap model.pth --to cpu
      ckptool remap model.pth --map cuda:1=cuda:0 -o model.gpu0.pth
      ckptool remap ddp_compiled.pth --to cpu --unwrap
      ckptool remap llama_bin/ --to cpu -o llama_cpu/    # a sharded set (pytorch_model.bin.index.json)
    """
    refuse_stdout(dst, ZIP_NEEDS_SEEK)
    out = remap_output(src, dst, to=to, in_place=in_place)
    refuse_existing_set(src, out, force=force)
    out = claim_output(out, force=force, in_place=in_place, given=dst)
    with Progress("remap", source_size(src)) as bar:
        res = remap(src, out, to=to, mapping=mapping_of(maps), in_place=in_place, unwrap=unwrap_keys,
                    strip_dataparallel=strip_dataparallel, strip_prefixes=strip_prefixes, add_prefix=add_prefix,
                    key=key, allow_missing=allow_missing, allow_nested=allow_nested, progress=bar)
    rename = res if isinstance(res, RenameResult) else None
    state_dict = renamed_state_dict(rename) if rename is not None else None
    if as_json:
        hint = hint_payload(hint_for(res.dst, state_dict=state_dict, to=to, maps=maps, renamed=renamed_keys(res)))
        emit_json("remap", {**write_payload(res, rename), **set_payload(res), **hint})
        return
    if rename is not None:
        report_rename(rename)
    report_write(res.dst, res.bytes_written,
                 res.detail() + ("" if res.retagged else "; nothing re-tagged (tags already match)"))
    report_kept(res)
    report_hint(res.dst, state_dict=state_dict, to=to, maps=maps, renamed=renamed_keys(res))
