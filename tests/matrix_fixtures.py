"""Small fixtures of every format in :data:`ckptool.ops.matrix.FORMATS`, for ``tests/test_matrix.py``.

Each holds the state_dict of :class:`Net` (``fc.weight`` 3x4, ``fc.bias`` 3), written by torch's own writers
(``torch.save`` zip and legacy, ``torch.jit.save``, ``torch.package.PackageExporter``, ``safetensors.torch.save_file``,
``torch.distributed.checkpoint.save``, ``torch.export.save``), or by ``ckptool convert --max-shard-size`` for the
sharded sets; the DeepSpeed folder is the committed ``fixtures/deepspeed-zero/zero2-1rank``. This file is also the
``--model`` of ``ckptool verify`` (``tests/matrix_fixtures.py:build_model``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED = ROOT / "fixtures" / "deepspeed-zero" / "zero2-1rank"
MEGATRON = ROOT / "fixtures" / "megatron-ckpts"
#: the folder formats whose fixtures are committed: name -> (folder, the file of its reference tensors)
COMMITTED = {
    "deepspeed": (DEEPSPEED, DEEPSPEED.parent / "zero2-1rank.oracle.pt"),
    "megatron-legacy": (MEGATRON / "legacy-gpt", MEGATRON / "legacy-gpt.full.pt"),
    "megatron-dist": (MEGATRON / "dist-gpt", MEGATRON / "dist-gpt.reference.pt"),
}


class Net(nn.Module):
    """One Linear(4, 3): the model of every fixture but the DeepSpeed one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def build_model() -> nn.Module:
    """A fresh :class:`Net` (the ``--model`` of ``ckptool verify`` on every fixture but DeepSpeed's)."""
    return Net()


def build_deepspeed_model() -> nn.Module:
    """The model that wrote :data:`DEEPSPEED` (``fixtures/make_deepspeed.py``, hidden size 5)."""
    import make_deepspeed

    model: nn.Module = make_deepspeed._model(5)
    return model


def _module_of(reference: Path) -> nn.Module:
    """A module whose state_dict has the names, shapes and dtypes of the tensors in ``reference`` (zeros)."""
    model = nn.Module()
    for name, t in torch.load(reference, weights_only=True).items():
        *path, leaf = name.split(".")
        m = model
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(torch.zeros_like(t), requires_grad=False))
    return model


def build_megatron_legacy_model() -> nn.Module:
    """A module with the names and shapes of the Megatron legacy fixture's consolidated model."""
    return _module_of(COMMITTED["megatron-legacy"][1])


def build_megatron_dist_model() -> nn.Module:
    """A module with the names and shapes of the Megatron torch_dist fixture's tensors."""
    return _module_of(COMMITTED["megatron-dist"][1])


#: format -> the ``--model`` factory of ``ckptool verify`` (others: :func:`build_model`)
MODELS = {"deepspeed": "build_deepspeed_model", "megatron-legacy": "build_megatron_legacy_model",
          "megatron-dist": "build_megatron_dist_model"}


def _dcp_save(state: dict[str, Any], folder: Path, tmp: Path) -> None:
    """``dcp.save`` inside a gloo process group of world size 1 (as tests/test_convert.py does)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    try:
        dcp.save(state, checkpoint_id=str(folder))
    finally:
        dist.destroy_process_group()


def build(out: Path, convert: Any) -> dict[str, Path]:
    """Write one fixture per format under ``out``; ``convert(*args)`` runs ``ckptool convert`` (for the sharded
    sets). Returns ``{format name: path}``."""
    from safetensors.torch import save_file
    from torch.package import PackageExporter

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    net = Net()
    sd = net.state_dict()
    p: dict[str, Path] = {}
    p["torch-zip"] = out / "zip.pt"
    torch.save(sd, p["torch-zip"])
    p["torch-legacy"] = out / "legacy.pt"
    torch.save(sd, p["torch-legacy"], _use_new_zipfile_serialization=False)
    p["torchscript"] = out / "script.pt"
    torch.jit.save(torch.jit.script(net), str(p["torchscript"]))
    p["torch-package"] = out / "package.pt"
    with PackageExporter(str(p["torch-package"])) as exp:
        exp.save_pickle("model", "state_dict.pkl", {k: v.clone() for k, v in sd.items()})
    p["safetensors"] = out / "model.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(p["safetensors"]))
    for name, suffix in (("sharded-safetensors", "safetensors"), ("sharded-bin", "bin")):
        folder = out / name
        folder.mkdir()
        convert("convert", p["torch-zip"], "-o", folder / f"model.{suffix}", "--max-shard-size", "40B")
        p[name] = next(folder.glob("*.index.json"))
    p["dcp"] = out / "dcp"
    _dcp_save({"model": {k: v.clone() for k, v in sd.items()}}, p["dcp"], out)
    p["torch-export"] = out / "model.pt2"
    torch.export.save(torch.export.export(net, (torch.randn(2, 4),)), str(p["torch-export"]))
    for name, (folder, _ref) in COMMITTED.items():
        p[name] = out / name
        shutil.copytree(folder, p[name])
    return p
