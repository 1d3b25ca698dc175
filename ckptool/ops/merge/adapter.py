"""A PEFT LoRA adapter folder read as data: its ``adapter_config.json``, what ckptool can merge exactly (and the
refusals of what it cannot), and its tensors grouped by the base weight they change. No torch.

A folder written by PEFT's ``save_pretrained`` holds ``adapter_config.json`` and ``adapter_model.safetensors``
(``adapter_model.bin`` with ``safe_serialization=False``). Its keys are those of
``peft.get_peft_model_state_dict``: ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` (a linear or
``Conv1D`` layer), ``base_model.model.<module>.lora_embedding_A`` / ``_B`` (an embedding), and for
``modules_to_save`` the module's own tensors under their base names (``base_model.model.score.weight``); with
``save_embedding_layers`` (PEFT sets it when an embedding is targeted) the embedding's own weight as
``<module>.base_layer.weight``, which replaces the base's before the merge, as loading the adapter does.

The scaling of a module is PEFT's (``peft/tuners/lora/layer.py``, ``LoraLayer.update_layer``): ``lora_alpha / r``,
or ``lora_alpha / sqrt(r)`` with ``use_rslora``, where ``r`` and ``lora_alpha`` come from ``rank_pattern`` /
``alpha_pattern`` when a pattern key matches the module name (``peft.utils.other.get_pattern_key``: the first key
``k`` for which ``re.match(rf"(.*\\.)?({k})$", name)``; matched here by RE2, in time linear in the name, and a
key RE2 does not take is refused), else from ``r`` / ``lora_alpha``. Every field the merge uses is checked for type,
range and finiteness before any work (:func:`read_adapter_config`).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import re2  # google-re2: pattern keys matched in time linear in the module name, as rename rules are

from ckptool.errors import InputNotFoundError, UnsupportedError, UsageError
from ckptool.formats.tensors import Tensor

__all__ = ["ADAPTER_PREFIX", "Adapter", "LoraPair", "read_adapter_config", "weights_file"]

#: the prefix PEFT puts before every key of an adapter (``PeftModel`` -> ``LoraModel`` -> the base model)
ADAPTER_PREFIX = "base_model.model."
#: adapter weight files, in the order PEFT's ``load_peft_weights`` looks for them
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
#: LoraConfig options that change what merging means; a truthy value is refused with the reason
_REFUSED_OPTIONS = {
    "use_dora": "DoRA rescales each merged column by a magnitude vector (weight-decomposed LoRA)",
    "lora_bias": "the adapter trains a bias of its own (lora_bias=True)",
    "use_bdlora": "BD-LoRA's block-diagonal factors",
    "arrow_config": "Arrow routes between several adapters per token",
    "alora_invocation_tokens": "activated LoRA applies only after its invocation tokens, so it has no merged form",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA's sampled factors",
    "mica": "MiCA",
    "kasa_config": "KaSA",
    "use_qalora": "QA-LoRA pools the input groups of a quantized layer",
    "trainable_token_indices": "trainable token deltas",
    "layer_replication": "layer replication changes the model's layers",
    "target_parameters": "LoRA on bare parameters (target_parameters)",
    "megatron_config": "Megatron parallel layers",
}
_MERGE_FIX = "merge it with PEFT (`PeftModel.merge_and_unload()`) instead"


@dataclass
class LoraPair:
    """One base weight's adapter: ``module`` (its name in the adapter, without ``base_model.model.``), the tensors
    ``a`` (``(r, in)``) and ``b`` (``(out, r)``), whether the delta is ``transposed`` (``fan_in_fan_out`` or an
    embedding), and its ``scaling``."""

    module: str
    a: Tensor
    b: Tensor
    transposed: bool
    scaling: float = 1.0

    @property
    def target(self) -> str:
        """The base weight's name as the adapter sees it: ``<module>.weight``."""
        return f"{self.module}.weight"


@dataclass
class Adapter:
    """An adapter folder: ``path``, its ``config`` (``adapter_config.json``), its weights ``file``, the
    ``pairs`` to merge and the ``copies``: ``modules_to_save`` tensors that replace base tensors (name without the
    prefix -> tensor)."""

    path: str
    config: dict[str, Any]
    file: str
    pairs: list[LoraPair] = field(default_factory=list)
    copies: dict[str, Tensor] = field(default_factory=dict)


def read_adapter_config(folder: str) -> dict[str, Any]:
    """``adapter_config.json`` of ``folder``, checked to be a LoRA adapter that merges exactly.

    Raises:
        InputNotFoundError: no such folder, or no ``adapter_config.json`` in it.
        UsageError: the file is larger than :data:`MAX_CONFIG_BYTES`, not a JSON object (``NaN`` / ``Infinity``
            refused), or a field the merge uses has the wrong type or range (:func:`_check_config`).
        UnsupportedError: another PEFT type (LoHa, IA3, prompt tuning...) or a LoRA variant (DoRA, lora_bias, ...)
            that ``W + scaling * B @ A`` does not describe, with the reason.
    """
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path):
        raise InputNotFoundError(f"{folder} holds no adapter_config.json; ADAPTER is the folder PEFT's "
                                 "save_pretrained writes (adapter_config.json + adapter_model.safetensors)")
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise UsageError(f"{path} is larger than {MAX_CONFIG_BYTES} bytes; an adapter_config.json is a few "
                             "hundred: refused before parsing")
        config = json.loads(text.decode("utf-8"), parse_constant=_no_constant)
    except (OSError, ValueError, RecursionError) as e:
        raise UsageError(f"{path} is not readable JSON ({str(e)[:200]})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path} holds a {type(config).__name__}, not a JSON object")
    _check_config(config, path)
    kind = config.get("peft_type")
    if kind != "LORA":
        raise UnsupportedError(f"{folder} is a {kind} adapter; merge-lora merges LoRA adapters only; "
                               f"{_MERGE_FIX}")
    for option, why in _REFUSED_OPTIONS.items():
        if config.get(option):
            raise UnsupportedError(f"{folder}: {option} is set: {why}; merge-lora merges plain LoRA "
                                   f"(W + scaling * B @ A) only; {_MERGE_FIX}")
    if config.get("use_rslora") and (config.get("rank_pattern") or config.get("alpha_pattern")):
        raise UnsupportedError(f"{folder}: use_rslora with rank_pattern / alpha_pattern, which PEFT itself rejects")
    return config


#: the largest adapter_config.json read (bytes)
MAX_CONFIG_BYTES = 1 << 20
#: the largest rank taken (``r``, a ``rank_pattern`` value)
MAX_RANK = 1 << 20
#: the largest ``lora_alpha`` (in absolute value) taken
MAX_ALPHA = 1e9
#: the most ``rank_pattern`` / ``alpha_pattern`` keys, and the longest key
MAX_PATTERNS, MAX_PATTERN_LENGTH = 100_000, 4096

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _rank(value: Any, what: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANK:
        raise UsageError(f"{path}: {what} is {str(value)[:40]!r}; a rank is an integer from 1 to {MAX_RANK}")
    return value


def _alpha(value: Any, what: str, path: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or (isinstance(value, int) and abs(value) > MAX_ALPHA) or not math.isfinite(float(value)) \
            or abs(float(value)) > MAX_ALPHA:
        raise UsageError(f"{path}: {what} is {str(value)[:40]!r}; lora_alpha is a finite number of at most "
                         f"{MAX_ALPHA:g} in absolute value")
    return float(value)


def _patterns(config: dict[str, Any], name: str, check: Any, path: str) -> dict[str, Any]:
    """``config[name]`` (``rank_pattern`` / ``alpha_pattern``) checked: a JSON object (or null / missing) of at most
    :data:`MAX_PATTERNS` keys, each a regular expression RE2 takes, each value checked by ``check``."""
    raw = config.get(name)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: {name} is a {type(raw).__name__}; it is a JSON object of module-name patterns")
    if len(raw) > MAX_PATTERNS:
        raise UsageError(f"{path}: {name} has {len(raw)} keys, more than {MAX_PATTERNS}")
    for key, value in raw.items():
        if len(key) > MAX_PATTERN_LENGTH:
            raise UsageError(f"{path}: a {name} key is {len(key)} characters long, more than {MAX_PATTERN_LENGTH}")
        try:
            re2.compile(rf"(.*\.)?({key})$", _RE2_OPTIONS)
        except re2.error as e:
            why = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
            raise UsageError(f"{path}: the {name} key {key[:80]!r} is no regular expression RE2 takes ({why}); "
                             "patterns are matched in time linear in the module name") from None
        check(value, f"{name}[{key[:80]!r}]", path)
    return raw


def _check_config(config: dict[str, Any], path: str) -> None:
    """The fields of ``adapter_config.json`` the merge uses, checked for type and range before any work: ``r``
    (an integer from 1 to :data:`MAX_RANK`), ``lora_alpha`` (a finite number), ``use_rslora`` and
    ``fan_in_fan_out`` (booleans), ``rank_pattern`` / ``alpha_pattern`` (:func:`_patterns`).

    Raises:
        UsageError: a field of the wrong type or out of range, named with its value.
    """
    _rank(config.get("r", 8), "r", path)
    _alpha(config.get("lora_alpha", 8), "lora_alpha", path)
    for flag in ("use_rslora", "fan_in_fan_out"):
        if config.get(flag) is not None and not isinstance(config[flag], bool):
            raise UsageError(f"{path}: {flag} is {str(config[flag])[:40]!r}; it is true or false")
    _patterns(config, "rank_pattern", _rank, path)
    _patterns(config, "alpha_pattern", _alpha, path)


def weights_file(folder: str) -> str:
    """The adapter's weights file in ``folder`` (:data:`WEIGHT_FILES`, safetensors first).

    Raises:
        InputNotFoundError: neither file is there.
    """
    for name in WEIGHT_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    raise InputNotFoundError(f"{folder} holds adapter_config.json but no {' or '.join(WEIGHT_FILES)}")


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """``peft.utils.other.get_pattern_key`` then ``.get``: the value of the first pattern key matching ``name``."""
    for key in patterns:
        if re2.match(rf"(.*\.)?({key})$", name, _RE2_OPTIONS):
            return patterns[key]
    return patterns.get(name, default)


def scaling_of(config: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling of ``module`` (its name in the model, without the adapter prefix) of rank ``rank`` (the
    rows of its ``lora_A``); see the module docstring.

    Raises:
        UnsupportedError: ``rank`` is not the ``r`` the config gives that module (a config that does not describe
            the weights).
    """
    r = int(_pattern_value(dict(config.get("rank_pattern") or {}), module, config.get("r", 8)))
    alpha = _pattern_value(dict(config.get("alpha_pattern") or {}), module, config.get("lora_alpha", 8))
    if r != rank:
        raise UnsupportedError(f"{module}: lora_A has {rank} rows but adapter_config.json gives r={r} for it; the "
                               "config does not describe these weights")
    scaling = float(alpha / math.sqrt(r)) if config.get("use_rslora") else float(alpha / r)
    if not math.isfinite(scaling):
        raise UsageError(f"{module}: the scaling lora_alpha / r = {alpha} / {r} is not finite")
    return scaling


_LORA = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)$")


def group_tensors(config: dict[str, Any], tensors: list[Tensor], where: str) -> tuple[list[LoraPair],
                                                                                       dict[str, Tensor]]:
    """The adapter's tensors as :class:`LoraPair` objects (A with B, per module, in file order) and the copies
    (``modules_to_save`` tensors), names without :data:`ADAPTER_PREFIX`.

    Raises:
        UnsupportedError: an A without its B (or the reverse); a factor that is not 2-D (LoRA on convolutions);
            a ``lora_*`` tensor of another kind.
    """
    found: dict[str, dict[str, Tensor]] = {}
    copies: dict[str, Tensor] = {}
    for t in tensors:
        name = t.name[len(ADAPTER_PREFIX):] if t.name.startswith(ADAPTER_PREFIX) else t.name
        m = _LORA.match(name)
        if m is None:
            if ".lora_" in name or name.startswith("lora_"):
                raise UnsupportedError(f"{where}: {t.name!r} is a LoRA tensor merge-lora does not know; "
                                       f"{_MERGE_FIX}")
            copies[name.replace(".base_layer.", ".")] = t  # save_embedding_layers: the layer's own weight
            continue
        found.setdefault(m["module"], {})[m["part"][:-len(".weight")] if m["part"].endswith("weight")
                                           else m["part"]] = t
    pairs = []
    fan_in_fan_out = bool(config.get("fan_in_fan_out"))
    for module, parts in found.items():
        emb = "lora_embedding_A" in parts or "lora_embedding_B" in parts
        a = parts.get("lora_embedding_A" if emb else "lora_A")
        b = parts.get("lora_embedding_B" if emb else "lora_B")
        if a is None or b is None or len(parts) != 2:
            raise UnsupportedError(f"{where}: {module} has {sorted(parts)}; a LoRA module needs its A and B")
        if len(a.shape) != 2 or len(b.shape) != 2:
            raise UnsupportedError(f"{where}: {module}'s LoRA factors are {list(a.shape)} and {list(b.shape)}: "
                                   f"LoRA on a convolution; merge-lora merges linear and embedding layers; "
                                   f"{_MERGE_FIX}")
        pairs.append(LoraPair(module, a, b, emb or fan_in_fan_out, scaling_of(config, module, a.shape[0])))
    return pairs, copies
