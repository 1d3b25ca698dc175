"""Key surgery and averaging: ``rename`` (keys by regex rules), ``filter`` (keys kept / dropped by globs) and
``average`` (the weighted mean of checkpoints). Thin Click commands over :mod:`ckptool.ops.surgery.edit` and
:mod:`ckptool.ops.surgery.average`; none imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ckptool.cli._common import (
    ZIP_NEEDS_SEEK,
    Progress,
    claim_output,
    claim_target,
    device_options,
    emit_json,
    json_option,
    key_option,
    mapping_of,
    max_expand_option,
    refuse_stdout,
    renamed_state_dict,
    report_kept,
    retagged_list,
    set_output_options,
    source_size,
    write_payload,
)
from ckptool.cli._hints import folder_of, hint_for, hint_payload, renamed_keys, report_hint
from ckptool.errors import UsageError
from ckptool.ops.merge.methods import METHODS
from ckptool.ops.rewrite.sets import set_payload
from ckptool.ops.surgery.average import average
from ckptool.ops.surgery.edit import FilterResult, RuleResult, filter_keys, load_rules, rename, surgery_output

F = TypeVar("F", bound=Callable[..., Any])

_EPILOG = ("Tensor records are copied, not decoded (torch is not imported). The output is written to a temporary "
           "file, fsynced and renamed into place; SRC is left untouched unless --in-place is given, and nothing is "
           "written when the command fails. A sharded set (*.index.json or its folder) is written as a set with its "
           "index (-o a folder); a torch.distributed.checkpoint folder as a new DCP folder (-o a new or empty "
           "folder). See docs/commands/surgery.md.")

_KEY_HELP = ("Dotted path of the state_dict to change (state_dict, model_state_dict, ema). Default: every "
             "state_dict found (optimizer state never).")


def _allow_unused(what: str) -> Callable[[F], F]:
    return click.option("--allow-unused", "--allow-missing", "allow_unused", is_flag=True,
                        help=f"Write the output even when a {what} matches no key, or a --map source no storage "
                             "(default: exit with an error, write nothing).")


def _dry_run(what: str) -> Callable[[F], F]:
    return click.option("--dry-run", is_flag=True, help=f"Print what would be {what}; write nothing.")


def _target(src: str, dst: str | None, in_place: bool, force: bool, dry_run: bool, tag: str) -> str | None:
    """The output path (claimed), or None for a dry run."""
    refuse_stdout(dst, ZIP_NEEDS_SEEK)
    out = surgery_output(src, dst, in_place, tag, force=force or dry_run)  # a dry run checks --in-place too
    if dry_run:
        return None
    return claim_output(out, force=force, in_place=in_place, given=dst)


# ------------------------------------------------------------------------------------------------ rename
def _report_rename(res: RuleResult) -> None:
    """One line per state_dict (with ``--dry-run``, then its ``old -> new`` keys), then one line per rule."""
    for ch in res.changes:
        what = "would rename" if res.dry_run else "renamed"
        click.echo(f"state_dict {ch.label}: {what} {ch.renamed} of {ch.keys} keys" + (":" if res.dry_run else ""))
        if res.dry_run:
            for path, old, new in res.renames:
                if path == ch.path:
                    click.echo(f"  {old} -> {new}")
    for i, use in enumerate(res.rules, 1):
        click.echo(f"Rule {i} {use.rule}: matched {use.matched} key{'s' if use.matched != 1 else ''}")


@click.command("rename", epilog=_EPILOG)
@click.argument("src", type=click.Path(dir_okay=True))  # a folder gets the reader's advice
@click.option("--rule", "rules", metavar="REGEX=REPLACEMENT", multiple=True,
              help="re.sub(REGEX, REPLACEMENT, key) on every key (repeatable, applied in order; split at the last "
                   "`=`; \\1 and \\g<name> name groups).")
@click.option("--rules", "rules_file", metavar="FILE", type=click.Path(dir_okay=False),
              help="A JSON, YAML or TOML file holding a list of [REGEX, REPLACEMENT] pairs (TOML: rules = [...]); "
                   "applied before the --rule ones.")
@key_option(_KEY_HELP)
@device_options
@_allow_unused("rule")
@_dry_run("renamed (old -> new)")
@set_output_options
@json_option("rename")
def rename_cmd(src: str, rules: tuple[str, ...], rules_file: str | None, key: str | None, to: str | None,
               maps: tuple[str, ...], allow_unused: bool, dry_run: bool, dst: str | None, in_place: bool, force: bool,
               as_json: bool) -> None:
    """Rename state_dict keys by regex rules (REGEX=REPLACEMENT on the whole key, in order).

    The general form of the prefix commands: --rule '^module\\.=' is strip-dataparallel, --rule
    '^=module.' is add-prefix module. The state_dict's _metadata is renamed with the keys and tied
    tensors stay tied; optimizer state and other entries stay as they are. Exits with an error when two
    keys would become one (listed) or a rule matches no key (see --allow-unused). Without -o the result
    is written next to SRC as <stem>.renamed<ext> (a sharded set, DCP folder or model folder: the
    folder <folder>.renamed).

    \b
    Examples:
      ckptool rename model.pth --rule '^features\\.=backbone.' --dry-run
      ckptool rename last.ckpt --key state_dict --rule '^model\\.=' -o bare.ckpt
      ckptool rename vit.safetensors --rules rules.yaml -o renamed.safetensors
      ckptool rename llama/ --rule '^model\\.=' -o llama_bare/     # a sharded set
    """
    all_rules: list[Any] = [*(load_rules(rules_file) if rules_file else []), *rules]
    if not all_rules:
        raise UsageError("no rule given: pass --rule REGEX=REPLACEMENT (repeatable) or --rules FILE")
    out = _target(src, dst, in_place, force, dry_run, "renamed")
    with Progress("rename", source_size(src)) as bar:
        res = rename(src, out, rules=all_rules, key=key, in_place=in_place, allow_unused=allow_unused,
                     dry_run=dry_run, to=to, mapping=mapping_of(maps), progress=bar)
    sd = renamed_state_dict(res)
    if as_json:
        payload = {**write_payload(res, res), "rules": [vars(u) for u in res.rules], "dry_run": res.dry_run,
                   "renames": [{"path": p, "old": o, "new": n} for p, o, n in res.renames], **set_payload(res)}
        _emit(res, "rename", payload, sd, to, maps)
        return
    _report_rename(res)
    _report_output(res, sd, to, maps)


def _emit(res: RuleResult | FilterResult, command: str, payload: dict[str, Any], sd: str | None, to: str | None,
          maps: tuple[str, ...]) -> None:
    """Print ``payload`` as the command's JSON, with the load hint of what was written (none after a dry run)."""
    if not res.dry_run:
        payload.update(hint_payload(hint_for(res.dst, state_dict=sd, to=to, maps=maps, renamed=renamed_keys(res))))
    emit_json(command, payload)


def _report_output(res: RuleResult | FilterResult, sd: str | None, to: str | None, maps: tuple[str, ...]) -> None:
    """The closing lines of rename and filter: the dry-run line, or ``Wrote ...`` and the load hint."""
    if res.dry_run:
        click.echo("Dry run: nothing was written")
        return
    click.echo(res)
    report_kept(res)
    report_hint(res.dst, state_dict=sd, to=to, maps=maps, renamed=renamed_keys(res))


# ------------------------------------------------------------------------------------------------ filter
def _filter_state_dict(res: FilterResult) -> str | None:
    """The dotted path of the state_dict to load into a model for the load hint (``""``: the file itself)."""
    if res.extracted:
        return ""
    changed = [c.path for c in res.changes if c.dropped]
    return changed[0] if len(changed) == 1 else None


def _report_filter(res: FilterResult) -> None:
    for ch in res.changes:
        what = "extracted state_dict" if res.extracted else "state_dict"
        verb = "would drop" if res.dry_run else "dropped"
        click.echo(f"{what} {ch.label}: kept {ch.kept} of {ch.keys} keys; {verb} {len(ch.dropped)}"
                   + (":" if ch.dropped else ""))
        for k in ch.dropped:
            click.echo(f"  {k}")
    for kind, glob, n in res.globs:
        click.echo(f"--{kind} {glob}: matched {n} key{'s' if n != 1 else ''}")


@click.command("filter", epilog=_EPILOG)
@click.argument("src", type=click.Path(dir_okay=True))  # a folder gets the reader's advice
@click.option("--keep", "keep", metavar="GLOB", multiple=True,
              help="Keep only keys matching GLOB (repeatable; fnmatch on the whole key, * also matches dots).")
@click.option("--drop", "drop", metavar="GLOB", multiple=True,
              help="Drop keys matching GLOB (repeatable), also among those --keep keeps.")
@key_option("Dotted path of one state_dict (state_dict, state_dict_ema): the output is that state_dict alone. "
            "Default: every state_dict found is filtered and the rest of the checkpoint kept.")
@device_options
@_allow_unused("glob")
@_dry_run("dropped")
@set_output_options
@json_option("filter")
def filter_cmd(src: str, keep: tuple[str, ...], drop: tuple[str, ...], key: str | None, to: str | None,
               maps: tuple[str, ...], allow_unused: bool, dry_run: bool, dst: str | None, in_place: bool, force: bool,
               as_json: bool) -> None:
    """Keep or drop state_dict keys by glob, and list what was dropped.

    A key stays when it matches a --keep glob (or none is given) and no --drop glob. The dropped
    tensors' bytes leave the file; _metadata is kept. With --key the output is that state_dict alone
    (extracted from a training checkpoint). Exits with an error when a glob matches no key (see
    --allow-unused) or every key would go. Without -o the result is written next to SRC as
    <stem>.filtered<ext> (a sharded set, DCP folder or model folder: the folder <folder>.filtered; a shard left
    empty is not written).

    \b
    Examples:
      ckptool filter model.pth --drop 'classifier.*' -o backbone.pth
      ckptool filter train.pth --key state_dict_ema --keep 'encoder.*' -o encoder_ema.pth
      ckptool filter dcp_ckpt/ --key model --drop 'head.*' -o backbone_dcp/   # a DCP folder
    """
    out = _target(src, dst, in_place, force, dry_run, "filtered")
    with Progress("filter", source_size(src)) as bar:
        res = filter_keys(src, out, keep=list(keep), drop=list(drop), key=key, in_place=in_place,
                          allow_unused=allow_unused, dry_run=dry_run, to=to, mapping=mapping_of(maps), progress=bar)
    sd = _filter_state_dict(res)
    if as_json:
        payload: dict[str, Any] = {
            "src": res.src, "dst": res.dst, "format_in": res.format_in, "storages": res.storages,
            "bytes_written": res.bytes_written, "retagged": retagged_list(res.retagged), "key": res.key,
            "extracted": res.extracted, "dry_run": res.dry_run,
            "changes": [{"path": c.path, "keys": c.keys, "kept": c.kept, "dropped": c.dropped} for c in res.changes],
            "globs": [{"kind": k, "glob": g, "matched": n} for k, g, n in res.globs], **set_payload(res)}
        _emit(res, "filter", payload, sd, to, maps)
        return
    _report_filter(res)
    _report_output(res, sd, to, maps)


# ------------------------------------------------------------------------------------------------ average
def _parse_weights(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise UsageError(f"--weights {text!r}: give one number per input, separated by commas (2,1,1)") from None


@click.command("average")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(dir_okay=True), metavar="A B [C ...]")
@click.option("-o", "--output", "dst", required=True, type=click.Path(),
              help="Output file: .safetensors for safetensors, .pt / .pth / .bin for torch's zip format (any "
                   "case), or a folder (OUT/) holding model.safetensors (docs/outputs.md).")
@click.option("--weights", metavar="W1,W2,...",
              help="One positive weight per input, divided by their sum (default: equal weights).")
@key_option("Dotted path of the state_dict to average in torch inputs (state_dict_ema, model_ema). Default: the "
            "one `ckptool convert` would choose.")
@click.option("--method", default="linear", show_default=True, type=click.Choice(METHODS),
              help="linear: the weighted mean; task-arithmetic, ties, dare-ties, dare-linear: the inputs' "
                   "differences from --base merged as mergekit defines them; slerp: two inputs, by --t.")
@click.option("--base", type=click.Path(dir_okay=True), help="The base model (task-arithmetic, ties, DARE).")
@click.option("--density", type=float, help="ties / DARE: the fraction of each difference kept (default 1).")
@click.option("--t", "t", type=float, help="slerp: 0 gives the first input, 1 the second (default 0.5).")
@click.option("--seed", type=int, help="dare-ties / dare-linear: the seed of the random draws (default 0).")
@click.option("--force", is_flag=True, help="Replace the output if it exists (default: refuse, write nothing).")
@max_expand_option
@json_option("average")
def average_cmd(inputs: tuple[str, ...], dst: str, weights: str | None, key: str | None, method: str,
                base: str | None, density: float | None, t: float | None, seed: int | None, force: bool,
                max_expand: float | None, as_json: bool) -> None:
    """Average the state_dicts of two or more checkpoints (any mix of torch and safetensors files).

    Floating tensors are averaged in float64 and cast back to their dtypes; integer and bool
    tensors (num_batches_tracked) are taken from the first input and listed. Every input must have
    the same keys, shapes and dtypes (the first difference is named). Tensors are read and averaged a
    chunk at a time, so memory stays small whatever the checkpoints' size. The output is a plain
    state_dict; tensors tied in every input stay tied. --method picks one of mergekit's merge
    methods instead (one key's tensors in memory at a time; see docs/commands/merge.md).

    \b
    Examples:
      ckptool average ep8.pth ep9.pth ep10.pth -o avg.pth
      ckptool average a.safetensors b.pth --weights 3,1 -o soup.safetensors
      ckptool average run1.pth run2.pth --key state_dict_ema -o ema_avg.pth
      ckptool average ft1.pt ft2.pt --method ties --base base.pt --density 0.5 -o ties.pt
    """
    refuse_stdout(dst, ZIP_NEEDS_SEEK)
    out = claim_target(dst, force=force)
    with Progress("average", source_size(inputs[0])) as bar:
        res = average(list(inputs), out, weights=_parse_weights(weights), key=key, progress=bar, method=method,
                      base=base, density=density, t=t, seed=seed, max_expand=max_expand)
    if as_json:
        emit_json("average", {**vars(res), **hint_payload(hint_for(res.dst, state_dict="",
                                                                    source_folder=folder_of(inputs[0])))})
        return
    click.echo(res)
    report_hint(res.dst, state_dict="", source_folder=folder_of(inputs[0]))  # the output is a plain state_dict
