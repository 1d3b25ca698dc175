"""Copy-free rewrites on a filesystem with reflinks (issue 14): records cloned with FICLONERANGE, laid out at
offsets congruent with the input's modulo the block size, and a silent fallback to copying elsewhere.

The reflink filesystem is a loop-mounted XFS (``reflink=1``) or btrfs image made by the ``reflink_dir`` fixture;
where the machine cannot make one (not root, no mkfs.xfs/mkfs.btrfs, mounting refused) those tests skip with the
reason. The fallback tests run anywhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptool
from ckptool import _fileio
from ckptool._fileio import clone_block, clone_range, copy_range
from ckptool.formats import torchzip

MiB = 1 << 20


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def reflink_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder on a freshly made, loop-mounted filesystem with reflinks; unmounted and removed at the end."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a loop image needs root")
    base = tmp_path_factory.mktemp("reflink")
    img, mnt = base / "fs.img", base / "mnt"
    mnt.mkdir()
    reasons = []
    for mkfs, size, args in (("mkfs.xfs", 300, ("-q", "-m", "reflink=1")), ("mkfs.btrfs", 128, ("-q",))):
        if shutil.which(mkfs) is None:
            reasons.append(f"{mkfs} not installed")
            continue
        with open(img, "wb") as f:
            f.truncate(size * MiB)
        made = _run(mkfs, *args, str(img))
        mounted = _run("mount", "-o", "loop", str(img), str(mnt)) if made.returncode == 0 else made
        if mounted.returncode == 0:
            break
        reasons.append(f"{mkfs}: {(mounted.stderr or mounted.stdout).strip()[:200]}")
        img.unlink()
    else:
        pytest.skip("no reflink filesystem could be mounted: " + "; ".join(reasons))
    try:
        yield mnt
    finally:
        _run("umount", str(mnt))
        with contextlib.suppress(OSError):
            img.unlink()


def _save(path: Path) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    sd = {f"module.layer{i}.weight": torch.randn(300 + i, 1111, generator=g) for i in range(6)}  # ~1.3 MiB each
    sd["module.small"] = torch.arange(7)
    sd["module.tied"] = sd["module.layer0.weight"][1:5]  # a view: storage sharing must survive
    torch.save(sd, path)
    return sd


def _data_offsets(path: Path) -> dict[str, int]:
    """Record name -> offset of its data in the zip (local header + name + extra)."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for zi in z.infolist():
            f.seek(zi.header_offset + 26)
            n, m = struct.unpack("<HH", f.read(4))
            out[zi.filename.split("/", 1)[1]] = zi.header_offset + 30 + n + m
    return out


def _used(folder: Path) -> int:
    os.sync()
    st = os.statvfs(folder)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _check_loads(out: Path, sd: dict[str, Any], strip: str = "") -> None:
    """``out`` loads with plain torch, with and without mmap, to ``sd`` (keys less ``strip``), views kept."""
    import torch

    want = {k.removeprefix(strip): v for k, v in sd.items()}
    for mmap in (False, True):
        got = torch.load(out, weights_only=True, mmap=mmap, map_location="cpu")
        assert set(got) == set(want)
        assert all(torch.equal(got[k], v) for k, v in want.items())
        lead = "" if strip else "module."
        tied, base = got[lead + "tied"], got[lead + "layer0.weight"]
        assert tied.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_remap_clones_records(reflink_dir: Path) -> None:
    src, out = reflink_dir / "a.pt", reflink_dir / "b.pt"
    sd = _save(src)
    before = _used(reflink_dir)
    ckptool.remap(src, out, to="cuda:0")
    grown = _used(reflink_dir) - before
    assert grown < 256 << 10, f"the output took {grown} new bytes: records were copied, not cloned"
    # records over SMALL_RECORD sit at the input's offsets modulo the block size, and stay 64-byte aligned
    block = os.statvfs(reflink_dir).f_bsize
    a, b = _data_offsets(src), _data_offsets(out)
    with zipfile.ZipFile(src) as z:
        big = [n for n in a if z.getinfo(f"a/{n}").file_size > torchzip.SMALL_RECORD]
    assert len(big) == 6
    for n in big:
        assert (b[n] - a[n]) % block == 0 and b[n] % torchzip.ALIGNMENT == 0
    if shutil.which("filefrag"):
        assert "shared" in _run("filefrag", "-v", str(out)).stdout
    _check_loads(out, sd)
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None  # every CRC matches
    os.unlink(src)  # the clone keeps its data when the source goes
    import torch

    assert all(torch.equal(torch.load(out, weights_only=True, map_location="cpu")[k], v)
               for k, v in sd.items())


def test_prefix_and_convert_clone(reflink_dir: Path) -> None:
    src = reflink_dir / "p.pt"
    sd = _save(src)
    before = _used(reflink_dir)
    ckptool.strip_prefix(src, "module.", reflink_dir / "q.pt")
    ckptool.convert(src, reflink_dir / "r.pt")
    assert _used(reflink_dir) - before < 512 << 10
    _check_loads(reflink_dir / "q.pt", sd, strip="module.")
    _check_loads(reflink_dir / "r.pt", sd)


def test_clone_failing_after_probe_copies(reflink_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe succeeds but a clone fails (EXDEV, EINVAL...): the block-aligned layout is kept, bytes are copied."""
    src, out = reflink_dir / "c.pt", reflink_dir / "d.pt"
    sd = _save(src)
    real = clone_range
    calls = []

    def first_only(sfd: int, dfd: int, offset: int, pos: int, size: int) -> bool:
        calls.append(size)
        return real(sfd, dfd, offset, pos, size) if len(calls) == 1 else False  # 1st call: clone_block's probe

    monkeypatch.setattr(_fileio, "clone_range", first_only)
    # copy_file_range clones aligned ranges by itself on XFS/btrfs (the kernel tries remap_file_range first):
    # switch it off too, so that the bytes really go through user space
    monkeypatch.setattr(os, "copy_file_range", None)
    before = _used(reflink_dir)
    ckptool.remap(src, out, to="cpu")
    assert len(calls) > 1 and _used(reflink_dir) - before > 6 * MiB  # really copied
    _check_loads(out, sd)


def test_fallback_off_reflink_is_byte_identical(tmp_path: Path) -> None:
    """Where clones are impossible (here: the test folder's filesystem, or across filesystems), the output is the
    64-byte aligned layout, byte for byte the same as with cloning switched off."""
    src = tmp_path / "a.pt"
    sd = _save(src)
    ckptool.remap(src, tmp_path / "b.pt", to="cuda:0")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torchzip, "clone_block", lambda src, dst: 0)
        ckptool.remap(src, tmp_path / "c.pt", to="cuda:0")
    assert (tmp_path / "b.pt").read_bytes() == (tmp_path / "c.pt").read_bytes()
    _check_loads(tmp_path / "b.pt", sd)


def test_across_filesystems_is_byte_identical(reflink_dir: Path, tmp_path: Path) -> None:
    src = reflink_dir / "x.pt"
    _save(src)
    shutil.copyfile(src, tmp_path / "x.pt")
    ckptool.remap(src, tmp_path / "from_reflink.pt", to="cpu")  # EXDEV: copied
    ckptool.remap(tmp_path / "x.pt", tmp_path / "from_here.pt", to="cpu")
    assert (tmp_path / "from_reflink.pt").read_bytes() == (tmp_path / "from_here.pt").read_bytes()


@pytest.mark.torchfree
def test_clone_range_unsupported_returns_false(tmp_path: Path) -> None:
    """On a filesystem without reflinks (or between files on two filesystems) clone_range reports False and
    changes nothing, so copy_range copies; clone_block says 0."""
    a, b = tmp_path / "a", tmp_path / "b"
    data = os.urandom(3 * 65536 + 5)
    a.write_bytes(data)
    with open(a, "rb") as fa, open(b, "w+b") as fb:
        block = clone_block(fa, fb)
        if block:
            pytest.skip(f"{tmp_path} supports reflinks (block {block}): nothing to fall back from")
        assert not clone_range(fa.fileno(), fb.fileno(), 0, 0, 65536)
        assert os.fstat(fb.fileno()).st_size == 0
        fb.write(b"x" * 100)
        copy_range(fa, fb, 100, len(data) - 100, block=4096)  # congruent offsets, but no clone: copied
    assert b.read_bytes() == b"x" * 100 + data[100:]


@pytest.mark.torchfree
def test_copy_range_clones_whole_blocks(reflink_dir: Path) -> None:
    """Congruent offsets: the partial blocks at either end are copied, the whole blocks between are cloned."""
    a, b = reflink_dir / "ra", reflink_dir / "rb"
    data = os.urandom(40 * 4096 + 123)
    a.write_bytes(data)
    with open(a, "rb") as fa, open(b, "w+b") as fb:
        block = clone_block(fa, fb)
        assert block and os.fstat(fb.fileno()).st_size == 0  # the probe left nothing behind
        fb.write(b"h" * (block + 100))
        copy_range(fa, fb, 100, len(data) - 100, block=block)
        assert fb.tell() == block + len(data)
    assert b.read_bytes() == b"h" * (block + 100) + data[100:]


def test_safetensors_prefix_clones(reflink_dir: Path) -> None:
    """strip-prefix of a safetensors file: the header is padded so that the data block is cloned."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = reflink_dir / "s.safetensors", reflink_dir / "t.safetensors"
    sd = {f"module.w{i}": torch.randn(512, 1024) for i in range(4)}
    save_file(sd, str(src))
    before = _used(reflink_dir)
    ckptool.strip_prefix(src, "module.", out)
    assert _used(reflink_dir) - before < 256 << 10
    got = load_file(str(out))
    assert set(got) == {k.removeprefix("module.") for k in sd}
    assert all(torch.equal(got[k.removeprefix("module.")], v) for k, v in sd.items())
    with open(src, "rb") as a, open(out, "rb") as b:
        na, nb = (struct.unpack("<Q", x.read(8))[0] for x in (a, b))
    assert (nb - na) % os.statvfs(reflink_dir).f_bsize == 0 and nb % 8 == 0
