"""The files two commands could read two ways (issue 46), built with torch, ``zipfile`` and ``safetensors``:
each maker writes one case under a folder and returns its path. :mod:`tests.test_agreement` checks that
``inspect``, ``scan``, ``report``, ``diff X X`` and ``sanitize --dry-run`` give each one format, kind, tensor count
and verdict."""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch


def _torch_zip(sd: dict[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def _rezip(data: bytes, add: dict[str, bytes] | None = None, drop: tuple[str, ...] = ()) -> bytes:
    """The zip ``data`` with members ``drop`` left out and ``add`` appended (stored, not compressed)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if info.filename not in drop:
                dst.writestr(info, src.read(info.filename))
        for name, body in (add or {}).items():
            dst.writestr(name, body)
    return out.getvalue()


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"fc.weight": torch.randn(4, 3, generator=g), "fc.bias": torch.randn(4, generator=g)}


def torch_zip_with_code(root: Path) -> Path:
    """A torch zip that carries a ``code/`` folder beside ``data.pkl`` (no ``constants.pkl``): torch.load reads it
    as a state_dict; TorchScript archives carry ``constants.pkl`` and ``code/__torch__/*.py``."""
    data = _torch_zip(_sd())
    top = zipfile.ZipFile(io.BytesIO(data)).namelist()[0].split("/")[0]
    p = root / "zip_with_code.pt"
    p.write_bytes(_rezip(data, {f"{top}/code/__torch__/helper.py": b"def f(x):\n    return x\n"}))
    return p


def second_pickle_cut_short(root: Path) -> Path:
    """A torch zip with a second pickle member (``extra.pkl``) cut short in the middle."""
    data = _torch_zip(_sd())
    top = zipfile.ZipFile(io.BytesIO(data)).namelist()[0].split("/")[0]
    import pickle

    body = pickle.dumps({"step": 3, "note": "x" * 64}, protocol=2)
    p = root / "second_pickle_cut.pt"
    p.write_bytes(_rezip(data, {f"{top}/extra.pkl": body[: len(body) // 2]}))
    return p


def safetensors_shards_named_bin(root: Path) -> Path:
    """A sharded set whose shards are safetensors files named ``pytorch_model-0000N-of-00002.bin``, with a
    ``pytorch_model.bin.index.json``."""
    from safetensors.torch import save_file

    folder = root / "st_named_bin"
    folder.mkdir()
    sd = _sd()
    names = {"fc.weight": "pytorch_model-00001-of-00002.bin", "fc.bias": "pytorch_model-00002-of-00002.bin"}
    for key, shard in names.items():
        save_file({key: sd[key]}, str(folder / shard))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return folder


def torch_package(root: Path) -> Path:
    """A torch.package archive of a state_dict."""
    from torch.package import PackageExporter

    p = root / "package.pt"
    with PackageExporter(str(p)) as exp:
        exp.save_pickle("model", "weights.pkl", _sd())
    return p


def _safetensors_set(folder: Path) -> dict[str, str]:
    from safetensors.torch import save_file

    folder.mkdir()
    sd = _sd()
    names = {"fc.weight": "model-00001-of-00002.safetensors", "fc.bias": "model-00002-of-00002.safetensors"}
    for key, shard in names.items():
        save_file({key: sd[key]}, str(folder / shard))
    return names


def index_with_url_shard(root: Path) -> Path:
    """A safetensors index whose second shard name is a URL."""
    folder = root / "url_shard"
    names = _safetensors_set(folder)
    names["fc.bias"] = "https://example.invalid/model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return folder


def shard_symlink_dev_zero(root: Path) -> Path:
    """A set whose second shard is a symlink to ``/dev/zero``."""
    folder = root / "dev_zero_shard"
    names = _safetensors_set(folder)
    os.remove(folder / names["fc.bias"])
    os.symlink("/dev/zero", folder / names["fc.bias"])
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return folder


def shard_leaves_folder(root: Path) -> Path:
    """A set whose second shard is a symlink to a file outside the folder."""
    folder = root / "outside_shard"
    names = _safetensors_set(folder)
    outside = root / "outside.safetensors"
    os.replace(folder / names["fc.bias"], outside)
    os.symlink(outside, folder / names["fc.bias"])
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return folder


def peft_adapter(root: Path) -> Path:
    """A PEFT LoRA adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    folder = root / "adapter"
    folder.mkdir()
    g = torch.Generator().manual_seed(1)
    save_file({"base_model.model.fc.lora_A.weight": torch.randn(2, 3, generator=g),
               "base_model.model.fc.lora_B.weight": torch.randn(4, 2, generator=g)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["fc"], "fan_in_fan_out": False,
        "base_model_name_or_path": "none", "task_type": None}))
    return folder


def model_folder_with_remote_code(root: Path) -> Path:
    """A Hugging Face model folder whose ``config.json`` ``auto_map`` names a module that calls ``os.system``:
    ``scan FOLDER`` rates it dangerous (transformers runs it under ``trust_remote_code=True``), so ``inspect`` and
    ``report`` of the folder say so too, not safe from its weights alone."""
    from safetensors.torch import save_file

    folder = root / "remote-code"
    folder.mkdir()
    save_file(_sd(), str(folder / "model.safetensors"))
    config = {"model_type": "toy", "auto_map": {"AutoModel": "modeling_toy.Toy"}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_toy.py").write_text("import os\nos.system('true')\n\n\nclass Toy:\n    pass\n")
    return folder


def model_folder_with_training_args(root: Path) -> Path:
    """A model folder holding ``pytorch_model.bin`` and a ``training_args.bin`` that pickles an
    ``argparse.Namespace`` (as transformers' Trainer pickles its ``TrainingArguments``): ``scan FOLDER`` says
    needs-trust, and so do ``inspect`` and ``report`` of the folder."""
    import argparse

    folder = root / "trained"
    folder.mkdir()
    torch.save(_sd(), folder / "pytorch_model.bin")
    torch.save(argparse.Namespace(lr=0.1, epochs=3), folder / "training_args.bin")
    return folder


def folder_with_one_checkpoint(root: Path) -> Path:
    """A run folder holding one checkpoint file two levels down (``run/weights/last.ckpt``) and a text file: read
    as that file by every command, as ``scan`` of the folder reads it (inspect refused the folder before)."""
    folder = root / "outputs"
    (folder / "run" / "weights").mkdir(parents=True)
    (folder / "notes.txt").write_text("lr 0.1\n")
    torch.save({"model": _sd(), "epoch": 3}, folder / "run" / "weights" / "last.ckpt")
    return folder


def set_index_given(root: Path) -> Path:
    """A sharded safetensors set given by its ``*.index.json``: sanitize's dry run says what it is before refusing
    it, as inspect reads it."""
    folder = root / "indexed"
    names = _safetensors_set(folder)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return index


#: every case, by name
CASES: dict[str, Callable[[Path], Path]] = {f.__name__: f for f in (
    torch_zip_with_code, second_pickle_cut_short, safetensors_shards_named_bin, torch_package,
    index_with_url_shard, shard_symlink_dev_zero, shard_leaves_folder, peft_adapter,
    model_folder_with_remote_code, model_folder_with_training_args, folder_with_one_checkpoint, set_index_given)}


def index_shard_outside(root: Path) -> Path:
    """A safetensors index whose second shard name leaves the folder (``../outside.safetensors``)."""
    folder = root / "dotdot_shard"
    names = _safetensors_set(folder)
    os.replace(folder / names["fc.bias"], root / "outside2.safetensors")
    names["fc.bias"] = "../outside2.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return folder


CASES["index_shard_outside"] = index_shard_outside


def duplicate_data_pkl(root: Path) -> Path:
    """A torch zip holding a second ``data.pkl`` (a benign pickle of other values): a zip-confusion, since one
    reader may load the first member and another the last. inspect refused it and scan called it safe (a note)."""
    import pickle
    import warnings

    data = _torch_zip(_sd())
    top = zipfile.ZipFile(io.BytesIO(data)).namelist()[0].split("/")[0]
    p = root / "duplicate_data_pkl.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name: on purpose
        p.write_bytes(_rezip(data, {f"{top}/data.pkl": pickle.dumps({"step": 3}, protocol=2)}))
    return p


def deeply_nested(root: Path) -> Path:
    """A plain pickle of 6,000 nested lists (allowed globals only): inspect refused it (deeper than its walk of the
    graph goes) and scan called it safe."""
    p = root / "deeply_nested.pt"
    p.write_bytes(b"\x80\x02" + b"]" * 6000 + b"a" * 5999 + b".")
    return p


def deeply_nested_zip(root: Path) -> Path:
    """A torch zip whose ``data.pkl`` holds the nesting of :func:`deeply_nested` beside its tensors' records."""
    data = _torch_zip(_sd())
    top = zipfile.ZipFile(io.BytesIO(data)).namelist()[0].split("/")[0]
    deep = b"\x80\x02" + b"]" * 6000 + b"a" * 5999 + b"."
    p = root / "deeply_nested_zip.pt"
    p.write_bytes(_rezip(data, {f"{top}/data.pkl": deep}, drop=(f"{top}/data.pkl",)))
    return p


CASES["duplicate_data_pkl"] = duplicate_data_pkl
CASES["deeply_nested"] = deeply_nested
CASES["deeply_nested_zip"] = deeply_nested_zip


def tied_folder_and_dcp(root: Path) -> tuple[Path, Path]:
    """A transformers-style model folder (``model.safetensors`` by ``safetensors.torch.save_model`` of a module
    with tied weights: the alias is recorded in ``__metadata__``) and the DCP save of the same module."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_model

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(0)
    model = Tied()
    folder = root / "tied_model"
    folder.mkdir()
    save_model(model, str(folder / "model.safetensors"))
    dcp.save(model.state_dict(), checkpoint_id=str(root / "tied_dcp"))
    return folder, root / "tied_dcp"
