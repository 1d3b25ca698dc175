"""What ``ckptool inspect`` advises about a checkpoint it described: the safety line (``ckptool scan``'s verdict,
in scan's words), how the format is loaded, and what its globals mean for that loader. The CLI prints these lines;
the knowledge of each format comes from its registry entry (:attr:`ckptool.readers.Format.loaded_by`), never from
its name.

The levels are scan's three (:data:`ckptool.model.allowlist.LEVELS`: ``safe``, ``needs-trust``, ``dangerous``),
written as scan writes them (:func:`ckptool.model.allowlist.level_word`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ckptool.model.allowlist import DANGEROUS, SAFE, level_word
from ckptool.ops.inspect.info import CheckpointInfo
from ckptool.readers import FORMATS
from ckptool.scanning.results import PickleFinding, ScanResult

__all__ = ["DCP_LOAD", "DEEPSPEED_LOAD", "EXPORT_LOAD", "MCORE_LOAD", "MEGATRON_LOAD", "PACKAGE_IMPORTER",
           "PICKLE_LOAD", "TORCH_JIT_LOAD",
           "TORCH_LOAD", "advice_lines", "hidden_level", "loaded_by", "metadata_lines",
           "security_lines"]

Lines = Callable[[CheckpointInfo], list[str]]

#: values of :attr:`ckptool.readers.Format.loaded_by` that change what ``inspect`` says
TORCH_LOAD, TORCH_JIT_LOAD, PICKLE_LOAD = "torch.load", "torch.jit.load", "pickle.load"
PACKAGE_IMPORTER, EXPORT_LOAD = "torch.package.PackageImporter", "torch.export.load"
DEEPSPEED_LOAD, DCP_LOAD = "DeepSpeedEngine.load_checkpoint", "torch.distributed.checkpoint.load"
MEGATRON_LOAD, MCORE_LOAD = "Megatron-LM load_checkpoint", "megatron.core.dist_checkpointing.load"


def hidden_level(sc: ScanResult, p: PickleFinding) -> str:
    """The level of a pickle ``torch.load`` does not read today (:func:`level_word`), and why it could not be read
    to its end when it could not (the first 80 characters; a dangerous pickle's level alone)."""
    level = sc.pickle_level(p)
    shown = level_word(level)
    return shown if not p.error or level == DANGEROUS else f"{shown}; unreadable: {p.error[:80]}"


def loaded_by(info: CheckpointInfo) -> str:
    """The call that loads ``info``'s format (:attr:`ckptool.readers.Format.loaded_by`; ``torch.load`` for a
    format the registry does not name)."""
    spec = FORMATS.get(info.format)
    return spec.loaded_by if spec is not None else TORCH_LOAD


# ------------------------------------------------------------------------------------------------ safety
def _dangerous_lines(info: CheckpointInfo, sc: ScanResult) -> list[str]:
    """The one line of a dangerous file: the code that ships in it, a hidden pickle, or the globals a load runs."""
    bad = [g for g in sc.globals if g.status == DANGEROUS]
    code = [c for c in sc.code if c.level == DANGEROUS]
    if not bad and code:  # code that ships in the file (scan's shipped_code), not a global
        return [(f"DANGEROUS: {code[0].member}: {code[0].reason}"
                 + (f" (and {len(code) - 1} more)" if len(code) > 1 else "")
                 + f". Do not load it; see `ckptool scan {sc.path}`.")]
    where = sorted({w for g in bad for w in g.where})
    names = ", ".join(g.name for g in bad[:3])
    if all(p.hidden for p in sc.pickles if any(g.name in p.globals for g in bad)):
        return [(f"DANGEROUS: {', '.join(where[:3])}, a pickle torch.load does not read today, names {names}: "
                 "another loader, an unpacking tool or a later torch would run it. Do not use this file; see "
                 f"`ckptool scan {sc.path}`.")]
    return [(f"DANGEROUS: loading this file can run {names}, named in {', '.join(where[:3])}. Do not load it; "
             f"see `ckptool scan {sc.path}`.")]


def _needs_trust_lines(info: CheckpointInfo, sc: ScanResult) -> list[str]:
    """The line of a file that needs trust for a reason the globals table does not show (a known library file, a
    hidden pickle), else none."""
    if sc.recognised is not None:
        return [f"Needs trust: {sc.recognised[1]}."]
    if all(g.level == SAFE for g in info.globals) and any(sc.pickle_level(p) != SAFE for p in sc.hidden):
        return [(f"Needs trust: a pickle torch.load does not read today names globals outside the weights_only "
                 f"allowlist; see `ckptool scan {sc.path}`.")]
    return []


def security_lines(info: CheckpointInfo) -> list[str]:
    """The verdict of ``ckptool scan`` (the same analysis, :attr:`CheckpointInfo.scan`) as the lines ``inspect``
    prints when it is not plain safe: what is dangerous and where, that part of the file could not be read, or why
    it needs trust."""
    sc = info.scan
    if sc is None or sc.verdict == SAFE:
        return []
    if sc.verdict == DANGEROUS:
        return _dangerous_lines(info, sc)
    if sc.verdict == "error":
        return [(f"Part of this file could not be read to its end, so ckptool cannot vouch for it; see "
                 f"`ckptool scan {sc.path}`.")]
    if sc.verdict == "incomplete":
        return [f"This file is cut short ({sc.cut_short[0]}): torch.load cannot load it whole; re-download it."]
    return _needs_trust_lines(info, sc)


# ------------------------------------------------------------------------------------------------ loading
def _gpu_usage(info: CheckpointInfo) -> list[str]:
    """torch.load of a file saved on GPUs: the remap that makes it load anywhere."""
    gpu = sorted(d for d in info.devices if d not in ("cpu", "meta"))
    if not gpu:
        return []
    alt = f" (or --map {gpu[-1]}=cuda:0 for one GPU)" if gpu[-1] not in ("cuda:0", "cuda") else ""
    return [(f"Saved on {', '.join(gpu)}: a plain torch.load needs that device. "
            f"Run `ckptool remap {info.path} --to cpu`{alt} to load it anywhere.")]


def _deepspeed_usage(info: CheckpointInfo) -> list[str]:
    if not info.metadata:
        return _gpu_usage(info)
    return [(f"DeepSpeed ZeRO checkpoint: the tensors above are its consolidated state_dict. Consolidate it "
            f"(no deepspeed needed) with: {info.metadata['consolidate']}")]


def _megatron_usage(info: CheckpointInfo) -> list[str]:
    return [(f"Megatron checkpoint: the tensors above are its consolidated model (Megatron's names; see "
             "docs/megatron.md). Consolidate it (no Megatron, no GPU) with: "
             f"{(info.metadata or {}).get('consolidate')}")]


#: ``Format.loaded_by`` -> how to load such a checkpoint (the first advice line); others: :func:`_gpu_usage`
_USAGE: dict[str, Lines] = {
    MEGATRON_LOAD: _megatron_usage,
    MCORE_LOAD: _megatron_usage,
    TORCH_JIT_LOAD: lambda _info: ["TorchScript archive: load it with torch.jit.load(path, map_location='cpu')."],
    DEEPSPEED_LOAD: _deepspeed_usage,
    PACKAGE_IMPORTER: lambda _info: [
        ("torch.package archive: torch.load does not read it; torch.package.PackageImporter(path)"
        ".load_pickle(package, resource) loads a pickle and runs the modules it ships (listed above).")],
    EXPORT_LOAD: lambda info: [
        (f"torch.export archive: `ckptool convert {info.path} -o weights.pth` (or .safetensors) writes its "
        "state_dict (--key constants: its constants); torch.export.load(path) loads the program.")],
}


def _torch_load_globals(info: CheckpointInfo) -> list[str]:
    """torch.load(weights_only=True) of the file: the globals or the opcode it refuses."""
    unsafe = info.unsafe_globals
    if unsafe:
        return [(f"{len(unsafe)} global(s) are outside the weights_only allowlist: torch.load(weights_only=True) "
                "refuses this file; load with weights_only=False only if you trust its source.")]
    if info.weights_only_refusal is not None:
        return [(f"torch.load(weights_only=True) refuses this file: its pickle uses {info.weights_only_refusal}, "
                "which torch's weights_only unpickler does not read; load with weights_only=False only if you "
                "trust its source.")]
    return []


def _deepspeed_globals(info: CheckpointInfo) -> list[str]:
    unsafe = info.unsafe_globals
    return [(f"{len(unsafe)} global(s) name deepspeed classes: torch.load(weights_only=True) refuses these files; "
            "ckptool reads them without importing anything.")] if unsafe else []


def _megatron_globals(info: CheckpointInfo) -> list[str]:
    unsafe = info.unsafe_globals
    return [(f"{len(unsafe)} global(s) are outside the weights_only allowlist ({', '.join(unsafe[:3])}): Megatron "
            "loads these files with weights_only=False; ckptool reads them without importing anything.")
            ] if unsafe else []


def _export_globals(info: CheckpointInfo) -> list[str]:
    unsafe = info.unsafe_globals
    return [(f"{len(unsafe)} global(s) are outside the weights_only allowlist: torch.export.load unpickles these "
            "members without that allowlist; run `ckptool scan` and load it only if you trust its source.")
            ] if unsafe else []


def _dcp_globals(info: CheckpointInfo) -> list[str]:
    """DCP's ``.metadata`` is read with ``pickle.load``: the globals scan does not call safe there."""
    trust = [g.name for g in info.globals if g.level != SAFE]
    return [(f"{len(trust)} global(s) of .metadata are not safe there ({', '.join(trust[:3])}): "
            "torch.distributed.checkpoint unpickles .metadata without an allowlist; load it only if you trust its "
            "source.")] if trust else []


#: ``Format.loaded_by`` -> what the globals mean for that loader; others: :func:`_torch_load_globals`
_GLOBALS: dict[str, Lines] = {
    TORCH_JIT_LOAD: lambda _info: [],
    PACKAGE_IMPORTER: lambda _info: [],
    DEEPSPEED_LOAD: _deepspeed_globals,
    MEGATRON_LOAD: _megatron_globals,
    MCORE_LOAD: _megatron_globals,
    EXPORT_LOAD: _export_globals,
    DCP_LOAD: _dcp_globals,
}


def advice_lines(info: CheckpointInfo) -> list[str]:
    """What to do next, as ``inspect`` prints it after the tables: how to load the format (or the remap a GPU save
    needs), then what its globals mean for its loader (:func:`loaded_by`)."""
    loader = loaded_by(info)
    return _USAGE.get(loader, _gpu_usage)(info) + _GLOBALS.get(loader, _torch_load_globals)(info)


def _zero_facts(info: CheckpointInfo) -> list[str]:
    """A DeepSpeed folder's ZeRO facts (a Megatron folder's facts), one a line (the consolidation command is
    advice: :func:`advice_lines`)."""
    return [f"  {k.replace('_', ' ')}: {v}" for k, v in (info.metadata or {}).items() if k != "consolidate"]


#: ``Format.loaded_by`` -> its metadata lines; others: the metadata as JSON on one line
_METADATA: dict[str, Lines] = {DEEPSPEED_LOAD: _zero_facts, MEGATRON_LOAD: _zero_facts, MCORE_LOAD: _zero_facts}


def metadata_lines(info: CheckpointInfo) -> list[str]:
    """:attr:`CheckpointInfo.metadata` as ``inspect`` prints it: a DeepSpeed folder's facts one a line, else
    ``Metadata: {...}`` (JSON, cut at 200 characters); none without metadata."""
    if not info.metadata:
        return []
    shown = _METADATA.get(loaded_by(info))
    return shown(info) if shown is not None else [f"Metadata: {json.dumps(info.metadata)[:200]}"]
