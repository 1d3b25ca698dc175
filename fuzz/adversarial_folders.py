"""Adversarial folders: checkpoint folders whose loader reads files outside the folder (issue "No code from a
checkpoint runs in any command", folders), and a folder that holds no checkpoint at all.

DeepSpeed (``engine.load_checkpoint``, ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``) reads the tag in
``latest`` and opens ``os.path.join(folder, tag)``: a tag ``../elsewhere`` or a tag folder that is a symbolic link
leads it out of the folder. ``transformers`` opens ``os.path.join(folder, shard)`` for each shard an
``*.index.json`` names: ``../x.bin``, an absolute path or a name through a symlinked subfolder lead it out too. A
walk of the folder that enters no symlink and reads no ``latest`` / ``weight_map`` sees none of those files. Each
case puts the marker payload (:func:`adversarial.marker_pickle`) only in the files outside the folder; the input is
``<case folder>/ckpt``.

The loaders are modelled (deepspeed is not a dependency; transformers loads shards with ``weights_only=True`` since
4.37, older releases and custom loaders do not): each snippet joins paths as the real loader does and calls
``torch.load(..., weights_only=False)``.

As a script it writes the cases into a folder: ``python fuzz/adversarial_folders.py OUTDIR``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from adversarial import Case, marker_pickle  # noqa: E402

TAG = "global_step1"
MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
SHARD = "pytorch_model-00001-of-00001.bin"
INDEX = "pytorch_model.bin.index.json"

#: DeepSpeed's loader: the tag in ``latest``, joined to the folder, every model / optimizer state file in it
DEEPSPEED_LOADER = (
    "import glob, os, torch\n"
    "tag = open(os.path.join(PATH, 'latest')).read().strip()\n"
    "d = os.path.join(PATH, tag)\n"
    "files = glob.glob(os.path.join(d, '*_model_states.pt')) + glob.glob(os.path.join(d, '*_optim_states.pt'))\n"
    "for f in sorted(files):\n"
    "    torch.load(f, weights_only=False)\n"
)
#: transformers' sharded loading: every shard of the index, joined to the folder
SHARDED_LOADER = (
    "import json, os, torch\n"
    f"idx = json.load(open(os.path.join(PATH, {INDEX!r})))\n"
    "for shard in dict.fromkeys(idx['weight_map'].values()):\n"
    "    torch.load(os.path.join(PATH, shard), weights_only=False)\n"
)


def _tag_folder(folder: Path) -> Path:
    """A DeepSpeed tag folder whose model and optimizer state files carry the payload."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MODEL).write_bytes(marker_pickle())
    (folder / OPTIM).write_bytes(marker_pickle())
    return folder


def _ckpt(base: Path) -> Path:
    ckpt = base / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    return ckpt


def make_latest_outside(base: Path) -> Path:
    """``latest`` names ``../outside/global_step1``."""
    _tag_folder(base / "outside" / TAG)
    ckpt = _ckpt(base)
    (ckpt / "latest").write_text(f"../outside/{TAG}\n")
    return ckpt


def make_latest_absolute(base: Path) -> Path:
    """``latest`` names the absolute path of a tag folder elsewhere."""
    tag = _tag_folder(base / "elsewhere" / TAG)
    ckpt = _ckpt(base)
    (ckpt / "latest").write_text(f"{tag.resolve()}\n")
    return ckpt


def make_tag_symlink(base: Path) -> Path:
    """``latest`` names ``global_step1``, a symbolic link to a tag folder outside."""
    tag = _tag_folder(base / "outside" / TAG)
    ckpt = _ckpt(base)
    (ckpt / "latest").write_text(f"{TAG}\n")
    os.symlink(os.path.relpath(tag, ckpt), ckpt / TAG)
    return ckpt


def _index(ckpt: Path, shard: str) -> None:
    doc = {"metadata": {"total_size": 16}, "weight_map": {"w": shard}}
    (ckpt / INDEX).write_text(json.dumps(doc, indent=2))


def make_shard_dotdot(base: Path) -> Path:
    """The index names ``../outside/<shard>``."""
    (base / "outside").mkdir(parents=True, exist_ok=True)
    (base / "outside" / SHARD).write_bytes(marker_pickle())
    ckpt = _ckpt(base)
    _index(ckpt, f"../outside/{SHARD}")
    return ckpt


def make_shard_absolute(base: Path) -> Path:
    """The index names the absolute path of a shard elsewhere."""
    (base / "elsewhere").mkdir(parents=True, exist_ok=True)
    shard = base / "elsewhere" / SHARD
    shard.write_bytes(marker_pickle())
    ckpt = _ckpt(base)
    _index(ckpt, str(shard.resolve()))
    return ckpt


def make_shard_symlinked_subfolder(base: Path) -> Path:
    """The index names ``sub/<shard>``, where ``sub`` is a symbolic link to a folder outside."""
    (base / "outside").mkdir(parents=True, exist_ok=True)
    (base / "outside" / SHARD).write_bytes(marker_pickle())
    ckpt = _ckpt(base)
    os.symlink(os.path.join("..", "outside"), ckpt / "sub")
    _index(ckpt, f"sub/{SHARD}")
    return ckpt


def make_empty_folder(base: Path) -> Path:
    """A folder with no checkpoint in it (a README and an empty subfolder): a scan of it must not pass."""
    ckpt = _ckpt(base)
    (ckpt / "README.md").write_text("weights not downloaded yet\n")
    (ckpt / "sub").mkdir(exist_ok=True)
    return ckpt


CASES: list[Case] = [
    Case("folder-deepspeed-latest-dotdot", "deepspeed latest outside the folder", make_latest_outside,
         loader=DEEPSPEED_LOADER),
    Case("folder-deepspeed-latest-absolute", "deepspeed latest outside the folder", make_latest_absolute,
         loader=DEEPSPEED_LOADER),
    Case("folder-deepspeed-tag-symlink", "deepspeed tag folder is a symlink", make_tag_symlink,
         loader=DEEPSPEED_LOADER),
    Case("folder-sharded-dotdot", "sharded index names a shard outside", make_shard_dotdot, loader=SHARDED_LOADER),
    Case("folder-sharded-absolute", "sharded index names a shard outside", make_shard_absolute,
         loader=SHARDED_LOADER),
    Case("folder-sharded-symlinked-subfolder", "sharded shard in a symlinked subfolder",
         make_shard_symlinked_subfolder, loader=SHARDED_LOADER),
    Case("folder-empty", "folder with no checkpoint", make_empty_folder, verdict="refused",
         reason="a scan that finds nothing must not pass a CI gate"),
]


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for case in CASES:
        folder = out / case.name
        folder.mkdir(parents=True, exist_ok=True)
        print(f"{case.verdict:12} {case.klass:40} {case.make(folder)}")
