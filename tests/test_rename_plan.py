"""ckptool.model.rename_plan and rename_memory: renaming plans checked before anything is written."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from ckptool.errors import KeyCollisionError, PrefixNotFoundError, UnsupportedError, UsageError
from ckptool.model.rename_memory import rename_mapping, rename_state_dict
from ckptool.model.rename_plan import RenamePlan, Step, build_plan, plan_keys


def test_build_plan_orders_the_steps_and_normalises_prefixes() -> None:
    plan = build_plan(add_prefix="model", unwrap=True, strip_dataparallel=True, strip_prefixes=["a", "b."])
    assert plan == RenamePlan((Step("strip", ("a.", "b.")), Step("strip", ("module.",)), Step("unwrap"),
                               Step("add", ("model.",))))
    assert build_plan(strip_prefixes="x").steps == (Step("strip", ("x.",)),)
    with pytest.raises(UsageError, match="nothing to rename"):
        build_plan()
    for bad in ("", ".a", "a..b"):
        with pytest.raises(UsageError, match="invalid prefix"):
            build_plan(strip_prefixes=[bad])


def test_step_rules() -> None:
    strip = Step("strip", ("model.", "module."))
    assert strip.apply("model.module.fc.weight") == ("fc.weight", ["model.", "module."], [])
    assert strip.apply("module.fc.weight") == ("fc.weight", ["module."], [])  # each prefix at most once, in order
    assert strip.apply("module.model.fc.w") == ("model.fc.w", ["module."], [])
    assert strip.apply("module.") == ("module.", [], [])  # never reduced to nothing
    assert strip.apply("model.x")[0] == "x" and Step("strip", ("model.",)).apply("model")[0] == "model"
    assert Step("add", ("module.",)).apply("fc.w") == ("module.fc.w", [], ["module."])
    unwrap = Step("unwrap")
    assert unwrap.apply("_orig_mod.module.a._checkpoint_wrapped_module.w") == (
        "a.w", ["_orig_mod.", "module.", "_checkpoint_wrapped_module."], [])


def test_whole_components_only() -> None:
    plan = build_plan(strip_dataparallel=True)
    assert plan.rename("mlp_module.fc.weight") == "mlp_module.fc.weight"
    assert plan.rename("module.mlp_module.fc.weight") == "mlp_module.fc.weight"
    assert build_plan(unwrap=True).rename("net.module_list.0.w") == "net.module_list.0.w"
    assert build_plan(strip_prefixes=["mod"]).rename("module.w") == "module.w"


def test_plan_keys_summary_and_checks() -> None:
    plan = build_plan(strip_dataparallel=True)
    targets = [("", ["module.a.w", "module.b.w", "mlp_module.c"], False), ("ema", ["module.a.w"], False)]
    mappings, summary = plan_keys(targets, plan, allow_missing=False, where="t.pt")
    assert mappings[0] == {"module.a.w": "a.w", "module.b.w": "b.w", "mlp_module.c": "mlp_module.c"}
    assert summary.renamed == 3 and summary.removed == {"module.": 3} and summary.state_dicts == ["", "ema"]
    assert [c.renamed for c in summary.changes] == [2, 1]

    with pytest.raises(KeyCollisionError) as e:
        plan_keys([("", ["module.w", "w"], False)], plan, allow_missing=False, where="t.pt")
    assert e.value.collisions == {"w": ["module.w", "w"]}
    with pytest.raises(PrefixNotFoundError, match=r"no key of the top-level state_dict starts with 'module\.'"):
        plan_keys([("", ["a.w"], False)], plan, allow_missing=False, where="t.pt")
    _m, summary = plan_keys([("", ["a.w"], False)], plan, allow_missing=True, where="t.pt")
    assert summary.unchanged == [""] and summary.renamed == 0
    with pytest.raises(PrefixNotFoundError, match="wrapper component"):
        plan_keys([("", ["a.w"], False)], build_plan(unwrap=True), allow_missing=False, where="t.pt")
    with pytest.raises(UnsupportedError, match="FSDP flat parameters"):
        plan_keys([("", ["module._flat_param"], False)], plan, allow_missing=True, where="t.pt")


def test_plan_renames_metadata_with_the_one_rule() -> None:
    plan = build_plan(strip_prefixes=["_orig_mod.module."])
    meta = [("", 1), ("_orig_mod", 2), ("_orig_mod.module", 3), ("_orig_mod.module.fc", 4)]
    assert plan.rename_metadata(meta) == [("", 3), ("fc", 4)]
    assert build_plan(add_prefix="module.").rename_metadata([("", 1), ("fc", 2)]) == [("module", 1), ("module.fc", 2)]


# ------------------------------------------------------------------------------------------------ in memory
def _sd(*keys: str) -> OrderedDict[str, torch.Tensor]:
    sd = OrderedDict((k, torch.ones(1)) for k in keys)
    sd._metadata = OrderedDict([("", {"version": 1}), ("module", {"version": 2})])  # type: ignore[attr-defined]
    return sd


def test_rename_mapping_selects_state_dicts_and_copies_only_the_way_to_them() -> None:
    sd = _sd("module.a", "module.b")
    opt = {"state": {0: {"exp_avg": torch.ones(1)}}, "param_groups": [{"params": [0]}]}
    ckpt = {"epoch": 3, "models": [sd, {"module.c": sd["module.a"]}], "optimizer": opt}
    out = rename_mapping(ckpt, build_plan(strip_dataparallel=True))
    assert list(out["models"][0]) == ["a", "b"] and list(out["models"][1]) == ["c"]
    assert out["models"][0]["a"] is sd["module.a"] and out["models"][1]["c"] is sd["module.a"]
    assert out["models"][0]._metadata == OrderedDict([("", {"version": 2})])
    assert out["optimizer"] is opt and out["epoch"] == 3  # not a model state_dict: untouched, not copied
    assert list(ckpt["models"][0]) == ["module.a", "module.b"]  # the input is not mutated

    one = rename_mapping(ckpt, build_plan(strip_dataparallel=True), key="models.1")
    assert list(one["models"][1]) == ["c"] and one["models"][0] is sd
    with pytest.raises(UsageError, match=r"no entry 'models\.5'"):
        rename_mapping(ckpt, build_plan(strip_dataparallel=True), key="models.5")
    with pytest.raises(UsageError, match="not a state_dict"):
        rename_mapping(ckpt, build_plan(strip_dataparallel=True), key="epoch")
    with pytest.raises(UnsupportedError, match="no state_dict found"):
        rename_mapping({"epoch": 1}, build_plan(strip_dataparallel=True))


def test_rename_state_dict_with_any_key_function() -> None:
    sd = _sd("module.a")
    out = rename_state_dict(sd, str.upper)
    assert list(out) == ["MODULE.A"] and list(out._metadata) == ["", "MODULE"]
    with pytest.raises(KeyCollisionError):
        rename_state_dict(_sd("a", "b"), lambda k: "same")
