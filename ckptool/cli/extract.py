"""``ckptool extract-state-dict``: the state_dict of a ``torch.save(model)`` file, without importing the model's
class (a thin command over :func:`ckptool.ops.extract.extract_state_dict`; torch is imported only to write
safetensors or with ``--trust``)."""

from __future__ import annotations

import click

from ckptool.cli._common import (
    ZIP_NEEDS_SEEK,
    Progress,
    allow_missing_option,
    claim_target,
    device_options,
    emit_json,
    force_option,
    json_option,
    key_option,
    mapping_of,
    refuse_stdout,
    source_size,
)
from ckptool.cli._hints import hint_for, hint_payload, report_hint
from ckptool.ops.extract import default_output, extract_state_dict


@click.command("extract-state-dict")
@click.argument("src", type=click.Path(dir_okay=True))  # a folder gets the reader's advice
@click.option("-o", "--output", "dst", type=click.Path(),
              help="Output file: *.safetensors for safetensors, *.pt / .pth / .bin for torch's format (any case), "
                   "or a folder (OUT/) holding model.safetensors (docs/outputs.md). Default: SRC's stem + "
                   ".state_dict.pth.")
@key_option("Dotted path of the module in the file when it is not the top level (e.g. model).")
@click.option("--unwrap", "unwrap_keys", is_flag=True,
              help="Remove wrapper prefixes from the keys (module. of DataParallel/DDP, _orig_mod. of "
                   "torch.compile, a shared attribute prefix such as model., ...; see `ckptool unwrap`).")
@device_options
@allow_missing_option
@click.option("--trust", is_flag=True,
              help="Load SRC with torch.load(weights_only=False), which imports its classes and RUNS ITS CODE, and "
                   "call the module's own state_dict(). Only for files from a source you trust.")
@force_option
@json_option("extract-state-dict")
def extract_cmd(src: str, dst: str | None, key: str | None, unwrap_keys: bool, to: str | None, maps: tuple[str, ...],
                allow_missing: bool, trust: bool, force: bool, as_json: bool) -> None:
    """Write the state_dict of a torch.save(model) file SRC, without the model's class and without running it.

    The pickled module tree is walked as nn.Module.state_dict() would walk it: parameters and persistent
    buffers of each module, then its submodules, detached, with _metadata; the classes are never imported and
    nothing from the file runs. Tensor bytes are copied, not decoded (.pth), or read with torch (.safetensors);
    --to / --map re-tag the storages of a .pth output in the same pass.
    Modules whose state_dict needs their own code (quantized or lazy modules, state_dict hooks) are refused:
    --trust loads the file with torch.load(weights_only=False) instead, which runs its code. A torch.export
    archive (.pt2) gives its program's state_dict (--key constants: its constants), read without running it.

    \b
    Examples:
      ckptool extract-state-dict model.pth -o model.sd.pth
      ckptool extract-state-dict dp_model.pth -o model.safetensors --unwrap
      ckptool extract-state-dict ckpt.pth --key model --to cpu
    """
    refuse_stdout(dst, f"{ZIP_NEEDS_SEEK}, and a safetensors output is written and checked as a file")
    out = claim_target(dst if dst is not None else default_output(src), force=force)
    with Progress("extract", source_size(src)) as bar:
        res = extract_state_dict(src, out, key=key, unwrap=unwrap_keys, to=to, mapping=mapping_of(maps),
                                 allow_missing=allow_missing, trust=trust, progress=bar)
    if as_json:
        emit_json("extract-state-dict", {
            "src": res.src, "dst": res.dst, "format": res.format, "keys": res.keys, "module": res.module,
            "path": res.path, "storages": res.storages, "bytes_written": res.bytes_written, "removed": res.removed,
            "trusted": res.trusted, **hint_payload(hint_for(res.dst, state_dict="", to=to, maps=maps))})
        return
    click.echo(res)
    report_hint(res.dst, state_dict="", to=to, maps=maps)
