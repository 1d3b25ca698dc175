"""``ckptool merge-lora``: a PEFT LoRA adapter merged into its base checkpoint, streamed, without PEFT. A thin Click
command over :func:`ckptool.ops.merge.merge_lora` (torch is imported when the first weight is merged)."""

from __future__ import annotations

import os

import click

from ckptool.cli._common import Progress, claim_set, emit_json, json_option, key_option, refuse_stdout
from ckptool.cli._hints import folder_of, hint_for, hint_payload, report_hint
from ckptool.ops.merge import merge_lora


@click.command("merge-lora")
@click.argument("base", type=click.Path(dir_okay=True))
@click.argument("adapter", type=click.Path(file_okay=False))
@click.option("-o", "--output", "dst", required=True, type=click.Path(),
              help="OUT.safetensors, OUT.pt / .pth / .bin (torch zip), or a folder (created): model.safetensors "
                   "plus the base folder's config and tokenizer files, as save_pretrained writes it.")
@click.option("--max-shard-size", metavar="SIZE",
              help="Write shards of at most SIZE (5GB, 500MiB) plus their index (a folder output).")
@key_option("Dotted path of the state_dict in a torch BASE that holds several (state_dict, model). Default: the "
            "one `ckptool convert` would choose.")
@click.option("--force", is_flag=True, help="Replace the output (the file, or the set of that name in the folder) if "
              "it exists (default: refuse, write nothing).")
@json_option("merge-lora")
def merge_lora_cmd(base: str, adapter: str, dst: str, max_shard_size: str | None, key: str | None, force: bool,
                   as_json: bool) -> None:
    """Merge the LoRA adapter folder ADAPTER (PEFT's adapter_config.json + adapter_model.safetensors) into BASE.

    Every weight the adapter targets becomes W + scaling * (B @ A) (transposed for fan_in_fan_out and
    embeddings; scaling = lora_alpha / r, or / sqrt(r) with use_rslora; rank_pattern and alpha_pattern
    honoured), computed in float32 and cast back to W's dtype: PEFT's merge_and_unload(), bit for bit.
    modules_to_save tensors replace the base's; every other tensor is copied. BASE is any checkpoint
    ckptool reads (a transformers folder, a sharded set, .pt, .safetensors, DCP). One weight is in
    memory at a time. DoRA and other adapter types are refused with the reason.

    \b
    Examples:
      ckptool merge-lora ./llama-base ./my-lora -o ./llama-merged
      ckptool merge-lora model.safetensors ./my-lora -o merged.safetensors
    """
    refuse_stdout(dst, "merge-lora writes files, not a stream")
    out = claim_set(dst, force=force, source_is_folder=os.path.isdir(base))
    with Progress("merge-lora", None) as bar:
        res = merge_lora(base, adapter, out, key=key, max_shard_size=max_shard_size, progress=bar)
    # the hint of what was written: a folder's index, or its one file (the folder may hold other sets)
    written = os.path.join(res.dst, os.path.basename(res.files[-1])) if res.files and os.path.isdir(res.dst) \
        else res.dst
    if as_json:
        emit_json("merge-lora", {**vars(res), **hint_payload(hint_for(written, state_dict="",
                                                                       source_folder=folder_of(base)))})
        return
    click.echo(res)
    report_hint(written, state_dict=None if res.kept else "", source_folder=folder_of(base))
