"""The wrapper-prefix commands: ``strip-dataparallel``, ``strip-prefix``, ``add-prefix`` and ``unwrap``.

Each is a thin Click command over :mod:`ckptool.ops.rename`; none imports torch.
"""

from __future__ import annotations

import click

from ckptool.cli._common import allow_missing_option, key_option, output_options, report_rename, report_write
from ckptool.ops.rename import RenameResult, add_prefix, strip_dataparallel, strip_prefix, unwrap

_EPILOG_SAFETY = (
    "Tensor records are copied, not decoded (torch is not imported): the cost is the cost of copying the file. "
    "The output is written to a temporary file, fsynced and renamed into place; SRC is left untouched unless "
    "--in-place is given, and nothing is written when the command fails."
)


def _load_hint(res: RenameResult) -> str | None:
    """``model.load_state_dict(torch.load(...)[...])`` for the one state_dict renamed, if there is exactly one."""
    if len(res.state_dicts) != 1 or any(c.is_module for c in res.changes):
        return None
    if res.format_in == "safetensors":
        return f"Load it with: model.load_state_dict(safetensors.torch.load_file({res.dst!r}))"
    path = res.state_dicts[0]
    index = "".join(f"[{int(c)}]" if c.isdigit() else f"[{c!r}]" for c in path.split(".")) if path else ""
    return f"Load it with: model.load_state_dict(torch.load({res.dst!r}, weights_only=True){index})"


def _report(res: RenameResult) -> None:
    report_rename(res)
    unit = "tensors" if res.format_in == "safetensors" else "storages"
    report_write(res.dst, res.bytes_written, f"{res.storages} {unit}")
    hint = _load_hint(res)
    if hint:
        click.echo(hint)


@click.command("strip-dataparallel", epilog=_EPILOG_SAFETY)
@click.argument("src", type=click.Path(dir_okay=True))
@key_option()
@allow_missing_option
@output_options
def strip_dataparallel_cmd(src: str, key: str | None, allow_missing: bool, dst: str | None, in_place: bool) -> None:
    """Remove the leading `module.` that nn.DataParallel / DistributedDataParallel add to state_dict keys.

    Fixes "Unexpected key(s) in state_dict: module.conv1.weight" when loading into the bare model. Only whole
    components are removed: mlp_module.fc.weight never changes. The state_dict's _metadata is renamed with the
    keys; optimizer state and other entries stay as they are. On a full-model pickle
    (torch.save(nn.DataParallel(model))) the output holds the inner module, written without importing its class.
    Without -o the result is written next to SRC as <stem>.stripped<ext>.

    \b
    Examples:
      ckptool strip-dataparallel model.pth
      ckptool strip-dataparallel last.ckpt --key state_dict -o last.bare.ckpt
    """
    _report(strip_dataparallel(src, dst, key=key, in_place=in_place, allow_missing=allow_missing))


@click.command("strip-prefix", epilog=_EPILOG_SAFETY)
@click.argument("src", type=click.Path(dir_okay=True))
@click.argument("prefixes", nargs=-1, required=True, metavar="PREFIX [PREFIX ...]")
@key_option()
@allow_missing_option
@output_options
def strip_prefix_cmd(src: str, prefixes: tuple[str, ...], key: str | None, allow_missing: bool, dst: str | None,
                     in_place: bool) -> None:
    """Remove PREFIX (whole dotted components, e.g. `model.`) from the front of state_dict keys.

    Several prefixes are removed in the order given, each at most once per key, so `strip-prefix SRC model.
    module.` turns both model.module.fc.weight and module.fc.weight into fc.weight. Keys without the prefix are
    kept. The state_dict's _metadata is renamed with the keys; optimizer state and other entries stay as they
    are. Exits with an error when no key carries a PREFIX (see --allow-missing) or when two keys would become
    one (the colliding keys are listed). Without -o the result is written next to SRC as <stem>.stripped<ext>.

    \b
    Examples:
      ckptool strip-prefix lightning.ckpt model.          # LightningModule attribute
      ckptool strip-prefix ckpt.pt module. --key model_state_dict -o bare.pt
    """
    _report(strip_prefix(src, list(prefixes), dst, key=key, in_place=in_place, allow_missing=allow_missing))


@click.command("add-prefix", epilog=_EPILOG_SAFETY)
@click.argument("src", type=click.Path(dir_okay=True))
@click.argument("prefix")
@key_option()
@output_options
def add_prefix_cmd(src: str, prefix: str, key: str | None, dst: str | None, in_place: bool) -> None:
    """Put PREFIX (whole dotted components, e.g. `module.`) in front of every state_dict key.

    For loading a bare state_dict into a wrapped model with strict=True: `module.` for nn.DataParallel /
    DistributedDataParallel, `_orig_mod.` for a torch.compile model. The state_dict's _metadata gets the
    prefix too; optimizer state and other entries stay as they are. Without -o the result is written next to
    SRC as <stem>.prefixed<ext>.

    \b
    Examples:
      ckptool add-prefix model.pth module.
      ckptool add-prefix ckpt.pt _orig_mod. --key model_state_dict -o compiled.pt
    """
    _report(add_prefix(src, prefix, dst, key=key, in_place=in_place))


@click.command("unwrap", epilog=_EPILOG_SAFETY)
@click.argument("src", type=click.Path(dir_okay=True))
@key_option()
@allow_missing_option
@output_options
def unwrap_cmd(src: str, key: str | None, allow_missing: bool, dst: str | None, in_place: bool) -> None:
    """Remove every wrapper component from state_dict keys and report what was removed.

    Removes `module.` (DataParallel, DDP), `_orig_mod.` (torch.compile), `_fsdp_wrapped_module.` (FSDP) and
    `_checkpoint_wrapped_module.` (activation checkpointing) from the front of keys in any stacking order
    (module._orig_mod. and _orig_mod.module. both go), and the wrapper-only names _orig_mod,
    _fsdp_wrapped_module and _checkpoint_wrapped_module also from the middle of keys. On a full-model pickle the
    wrapper objects are replaced by the modules they hold. FSDP flat parameters (_flat_param) cannot be renamed:
    the command explains how to consolidate them. Without -o the result is written next to SRC as
    <stem>.unwrapped<ext>.

    \b
    Examples:
      ckptool unwrap compiled_ddp.pt
      ckptool unwrap model.pth --in-place
    """
    _report(unwrap(src, dst, key=key, in_place=in_place, allow_missing=allow_missing))
