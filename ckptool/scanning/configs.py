"""Configs that instantiate code: the Hydra ``_target_`` entries of a YAML or JSON config that ships beside the
weights (a NeMo ``.nemo`` archive's ``model_config.yaml``, a NeMo 2 folder's ``context/model.yaml``), which
``hydra.utils.instantiate`` imports and calls when the model is restored (CVE-2025-23304).

:func:`parse_config` reads the text with bounds (size, nesting depth, YAML aliases: a "billion laughs" file is
refused) through PyYAML's ``SafeLoader`` (which builds only plain values: no Python tag is honoured) or ``json``;
:func:`hydra_targets` lists every ``_target_`` with its key path and how Hydra uses it (``_partial_``, ``_call_``).
Each target is rated by :func:`ckptool.model.allowlist.rate_target`. Nothing is imported or called.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from ckptool.errors import CorruptCheckpointError

__all__ = ["CONFIG_SUFFIXES", "HF_CONFIG_NAMES", "MAX_ALIASES", "MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH",
           "MAX_CONFIG_NODES", "TARGET_MARK", "hydra_targets", "is_code_config", "is_config_name", "is_nemo_config",
           "is_target_where", "parse_config", "target_where"]

#: the member or file names read as configs
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
#: configs larger than this are not parsed (a NeMo model config is a few kilobytes)
MAX_CONFIG_BYTES = 16 << 20
#: the most YAML aliases (``*name``) one config may use: each can stand for a whole subtree, so a few nested ones
#: make an exponentially large document (a YAML bomb)
MAX_ALIASES = 1000
#: containers nested deeper than this are refused
MAX_CONFIG_DEPTH = 200
#: the most mappings and lists :func:`hydra_targets` walks in one config
MAX_CONFIG_NODES = 1_000_000


def is_config_name(name: str) -> bool:
    """True for a file or member name that ends like a YAML or JSON config (any case)."""
    return name.lower().endswith(CONFIG_SUFFIXES)


def _bounded_loader() -> type:
    """PyYAML's ``SafeLoader`` counting the aliases it composes (over :data:`MAX_ALIASES`: refused)."""
    import yaml  # noqa: PLC0415 (a scan that meets no config does not import PyYAML)

    class BoundedLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types
        aliases = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_ALIASES:
                    raise CorruptCheckpointError(
                        f"the YAML uses more than {MAX_ALIASES} aliases (a YAML bomb?); not parsed")
            return super().compose_node(parent, index)

    return BoundedLoader


def parse_config(data: bytes, name: str) -> Any:
    """The value of the YAML or JSON config ``data`` (``name`` says which: ``.json`` is JSON, anything else YAML):
    plain dicts, lists, strings and numbers (PyYAML's ``SafeLoader``: no Python tag is honoured).

    Raises:
        CorruptCheckpointError: over :data:`MAX_CONFIG_BYTES`, more than :data:`MAX_ALIASES` aliases, nested too
            deeply, or not valid YAML/JSON (the message says which).
    """
    if len(data) > MAX_CONFIG_BYTES:
        raise CorruptCheckpointError(f"{name}: {len(data)} bytes, over the {MAX_CONFIG_BYTES >> 20} MiB read for a "
                                     "config; not parsed")
    try:
        if name.lower().endswith(".json"):
            return json.loads(data)
        import yaml  # noqa: PLC0415

        return yaml.load(data, Loader=_bounded_loader())
    except RecursionError:
        raise CorruptCheckpointError(f"{name}: nested too deeply to parse") from None
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{name}: {e}") from None
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise CorruptCheckpointError(f"{name}: not valid JSON ({e})") from None
    except Exception as e:  # yaml.YAMLError and its subclasses (the module is imported lazily)
        if type(e).__module__.startswith("yaml"):
            raise CorruptCheckpointError(f"{name}: not valid YAML ({str(e).splitlines()[0] if str(e) else e})") \
                from None
        raise


def hydra_targets(value: Any) -> Iterator[tuple[str, str, str]]:
    """``(target, key_path, use)`` for every mapping of the parsed config ``value`` with a string ``_target_``:
    ``key_path`` the dotted keys to it (``model.encoder._target_``), ``use`` what ``hydra.utils.instantiate`` does
    with it: ``called`` (the default), ``partial`` (``_partial_: true``: a ``functools.partial`` of it, called
    later) or ``located`` (``_call_: false``: imported, not called). Shared subtrees (YAML aliases) are walked once.

    Raises:
        CorruptCheckpointError: nested deeper than :data:`MAX_CONFIG_DEPTH`, or more than :data:`MAX_CONFIG_NODES`
            containers.
    """
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    seen: set[int] = set()
    while stack:
        obj, path, depth = stack.pop()
        if not isinstance(obj, (dict, list)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if depth > MAX_CONFIG_DEPTH:
            raise CorruptCheckpointError(f"the config nests deeper than {MAX_CONFIG_DEPTH} levels")
        if len(seen) > MAX_CONFIG_NODES:
            raise CorruptCheckpointError(f"the config holds more than {MAX_CONFIG_NODES} mappings and lists")
        if isinstance(obj, dict):
            target = obj.get("_target_")
            if isinstance(target, str):
                use = "partial" if obj.get("_partial_") is True else "located" if obj.get("_call_") is False \
                    else "called"
                yield target, _join(path, "_target_"), use
            children = [(_join(path, str(k)), v) for k, v in obj.items()]
        else:
            children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        stack.extend((v, p, depth + 1) for p, v in reversed(children))


#: separates a config's label from the key path of a target in the ``where`` of its finding
#: (``model_config.yaml at model.decoder._target_``)
TARGET_MARK = " at "


def target_where(label: str, key_path: str) -> str:
    """The ``where`` of a Hydra target found at ``key_path`` of the config ``label``."""
    return f"{label}{TARGET_MARK}{key_path}"


def is_target_where(where: str) -> bool:
    """True for a ``where`` made by :func:`target_where` (a config's name, then a key path ending ``_target_``)."""
    label, mark, path = where.rpartition(TARGET_MARK)
    return bool(mark) and is_config_name(label) and path.endswith("_target_")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


#: the Hugging Face configs whose ``auto_map`` names code (``AutoConfig``/``AutoModel*``, ``AutoTokenizer``,
#: ``AutoProcessor``, ``AutoImageProcessor``, ``AutoFeatureExtractor``)
HF_CONFIG_NAMES = frozenset({"config.json", "tokenizer_config.json", "processor_config.json",
                             "preprocessor_config.json", "feature_extractor_config.json"})


def is_nemo_config(path: str) -> bool:
    """True for a NeMo config whose ``_target_`` entries Hydra instantiates: ``model_config.yaml`` (a ``.nemo``
    archive, unpacked), ``context/model.yaml`` and ``context/io.json`` (a NeMo 2 checkpoint folder)."""
    name = os.path.basename(path)
    parent = os.path.basename(os.path.dirname(path))
    return name == "model_config.yaml" or (parent == "context" and name in ("model.yaml", "io.json"))


def is_code_config(path: str) -> bool:
    """True for a file of a folder the scan reads for the code it makes a loader run: a Hugging Face config
    (:data:`HF_CONFIG_NAMES`) that holds ``"auto_map"``, or a NeMo config (:func:`is_nemo_config`) that holds
    ``_target_``; read only when the name matches, at most :data:`MAX_CONFIG_BYTES`."""
    name = os.path.basename(path)
    if name in HF_CONFIG_NAMES:
        marker = b'"auto_map"'
    elif is_nemo_config(path):
        marker = b"_target_"
    else:
        return False
    try:
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            return True  # read (and refused with a note) by the scan itself
        with open(path, "rb") as f:
            return marker in f.read()
    except OSError:
        return False
