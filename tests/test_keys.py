"""ckptool.model.keys: key reconciliation and the one ``_metadata`` renaming rule."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from ckptool.model.keys import (
    OPTIMIZER_NAMES,
    SCHEDULER_NAMES,
    STATE_DICT_NAMES,
    mapping_key_function,
    metadata_key_mapping,
    reconcile,
    rename_metadata_items,
    unwrap_key,
)

BARE = ["conv.weight", "conv.bias", "bn.running_mean", "fc.weight"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(2, 2)


# ------------------------------------------------------------------------------------------------ reconcile
@pytest.mark.parametrize(("ckpt_prefix", "model_prefix", "removed", "added"), [
    ("module.", "", ["module."], []),  # DataParallel checkpoint into a bare model
    ("", "module.", [], ["module."]),  # bare checkpoint into a DataParallel model
    ("_orig_mod.module.", "", ["_orig_mod.module."], []),  # compiled DDP into bare
    ("model.", "", ["model."], []),  # Lightning's attribute into the inner model
    ("module._orig_mod.", "_orig_mod.", ["module."], []),
])
def test_reconcile_finds_the_prefix_change(ckpt_prefix: str, model_prefix: str, removed: list[str],
                                           added: list[str]) -> None:
    rec = reconcile([ckpt_prefix + k for k in BARE], [model_prefix + k for k in BARE])
    assert rec.mapping == {ckpt_prefix + k: model_prefix + k for k in BARE}
    assert rec.matched == len(BARE) and rec.changed
    assert rec.removed == removed and rec.added == added


def test_reconcile_keeps_the_identity_unless_a_renaming_matches_more() -> None:
    rec = reconcile(BARE, BARE)
    assert not rec.changed and rec.matched == len(BARE)
    # a head that differs is left for load_state_dict to report, the rest is matched
    rec = reconcile(["module." + k for k in BARE] + ["module.head.weight"], BARE)
    assert rec.matched == len(BARE) and rec.mapping["module.head.weight"] == "module.head.weight"
    rec = reconcile(["a.weight"], ["b.weight"])
    assert not rec.changed and rec.matched == 0


def test_reconcile_never_maps_two_keys_onto_one() -> None:
    rec = reconcile(["module.fc.weight", "fc.weight"], ["fc.weight"])
    assert len(set(rec.mapping.values())) == 2


def test_name_lists() -> None:
    assert STATE_DICT_NAMES[:2] == ("state_dict", "model_state_dict") and "ema" in STATE_DICT_NAMES
    assert "optimizer_state_dict" in OPTIMIZER_NAMES and "lr_scheduler" in SCHEDULER_NAMES
    assert not set(STATE_DICT_NAMES) & set(OPTIMIZER_NAMES)


# ------------------------------------------------------------------------------------------------ _metadata
def _strip(prefix: str):  # type: ignore[no-untyped-def]
    return lambda k: k[len(prefix):] if k.startswith(prefix) and len(k) > len(prefix) else k


def test_metadata_of_a_dataparallel_state_dict_matches_torch() -> None:
    sd = nn.DataParallel(Net()).state_dict()
    meta = sd._metadata  # type: ignore[attr-defined]
    assert list(meta) == ["", "module", "module.conv", "module.relu", "module.fc"]
    mapping = metadata_key_mapping(meta, _strip("module."))
    assert mapping == {"": "", "module": "", "module.conv": "conv", "module.relu": "relu", "module.fc": "fc"}
    ours = OrderedDict(rename_metadata_items(meta.items(), _strip("module.")))
    ref = OrderedDict(sd)
    ref._metadata = OrderedDict(meta)  # type: ignore[attr-defined]
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(ref, "module.")
    assert ours == ref._metadata  # type: ignore[attr-defined]  # later entry wins, in the first one's place
    assert list(ours) == ["", "conv", "relu", "fc"] and ours[""] is meta["module"]


def test_wrapper_levels_inside_a_stripped_prefix_collapse() -> None:
    paths = ["", "_orig_mod", "_orig_mod.module", "_orig_mod.module.conv", "_orig_mod.module.fc"]
    mapping = metadata_key_mapping(paths, _strip("_orig_mod.module."))
    # torch's consume_prefix_in_state_dict_if_present keeps "_orig_mod", which then names no module
    assert mapping == {"": "", "_orig_mod": "", "_orig_mod.module": "", "_orig_mod.module.conv": "conv",
                       "_orig_mod.module.fc": "fc"}
    items = rename_metadata_items([(p, {"version": i}) for i, p in enumerate(paths)], _strip("_orig_mod.module."))
    assert items == [("", {"version": 2}), ("conv", {"version": 3}), ("fc", {"version": 4})]


def test_metadata_rules_for_add_unwrap_and_any_key_function() -> None:
    add = metadata_key_mapping(["", "fc"], lambda k: "module." + k)
    assert add == {"": "module", "fc": "module.fc"}
    unwrapped = metadata_key_mapping(["", "fc", "fc._checkpoint_wrapped_module"], lambda k: unwrap_key(k)[0])
    assert unwrapped == {"": "", "fc": "fc", "fc._checkpoint_wrapped_module": "fc"}
    assert metadata_key_mapping(["", "a", "a.b"], str.upper) == {"": "", "a": "A", "a.b": "A.B"}
    # a key function that drops the probe keeps the path
    assert metadata_key_mapping(["x"], lambda k: "const") == {"x": "x"}


def test_non_string_metadata_keys_are_kept_in_place_unhashed() -> None:
    deep: object = ()
    for _ in range(100_000):
        deep = (deep,)
    items = rename_metadata_items([("module", 1), (deep, 2), ("", 3)], _strip("module."))
    assert items[0] == ("", 3) and items[1][0] is deep and len(items) == 2


def test_path_function_from_a_plain_key_mapping() -> None:
    mapping = {"module.conv.weight": "conv.weight", "module.fc.weight": "fc.weight"}
    key_fn = mapping_key_function(mapping)
    assert key_fn("module.conv.weight") == "conv.weight"
    assert key_fn("module.relu.x") == "relu.x"  # a module without tensors moves with its parent
    meta = ["", "module", "module.conv", "module.relu", "module.fc"]
    assert [m for m, _ in rename_metadata_items([(m, None) for m in meta], key_fn)] == ["", "conv", "relu", "fc"]
    # adding a prefix places the root too
    add = mapping_key_function({"fc.weight": "module.fc.weight"})
    assert metadata_key_mapping(["", "fc"], add) == {"": "module", "fc": "module.fc"}
    # a renamed last component says nothing about the modules; unknown keys are kept
    upper = mapping_key_function({"fc.weight": "fc.WEIGHT"})
    assert upper("fc.bias") == "fc.bias" and metadata_key_mapping(["fc"], upper) == {"fc": "fc"}
    # compiled DDP: the same collapse as with the key function
    cd = mapping_key_function({"_orig_mod.module.fc.weight": "fc.weight"})
    assert metadata_key_mapping(["", "_orig_mod", "_orig_mod.module", "_orig_mod.module.fc"], cd) == {
        "": "", "_orig_mod": "", "_orig_mod.module": "", "_orig_mod.module.fc": "fc"}
