"""Remote checkpoints (issue 15): every path argument may be an fsspec URL.

Two local servers on 127.0.0.1 only (``remote_servers.py``): moto's S3 server and an HTTP server that honours
``Range`` and counts the body bytes it sends (the transfer is measured at the server, not only by ckptool's own
counter); a path under ``/drop/`` answers large ranges with a few bytes and then closes the connection (a network
failure mid-stream). ``memory://`` is fsspec's in-process filesystem.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

pytest.importorskip("fsspec")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("aiohttp")

import fsspec
from remote_servers import MB, Files
from remote_servers import url as server_url

import ckptool

REAL = Path(__file__).resolve().parent.parent / "fixtures" / "real" / "lpips-v0.1-alex.pth"


def _url(server: Files, name: str, drop: bool = False) -> str:
    return server_url(server, name, "drop" if drop else "")


@pytest.fixture(scope="session")
def big(http: Files) -> str:
    """A 200 MB torch zip checkpoint (four large tensors and a few small ones) served over HTTP; its file name."""
    sd = {f"layer{i}.weight": torch.zeros(12_500_000) for i in range(4)}
    sd.update({f"layer{i}.bias": torch.arange(10.0) for i in range(4)})
    torch.save(sd, http.root / "big.pth")
    assert (http.root / "big.pth").stat().st_size > 200_000_000
    return "big.pth"


def _sd_bytes(obj: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in obj.items()}


def _load_url(url: str) -> Any:
    with fsspec.open(url, "rb") as f:
        return torch.load(f, weights_only=True, map_location="cpu")


# ------------------------------------------------------------------------------------------------ inspect / scan
def test_inspect_200mb_over_http_reads_under_1mb(http: Files, big: str, run_cli: Any) -> None:
    url = _url(http, big)
    before = http.sent
    info = ckptool.inspect(url)
    sent = http.sent - before
    assert info.size > 200_000_000 and len(info.tensors) == 8
    assert sent < MB, f"inspect transferred {sent} bytes"
    assert info.bytes_read is not None and 0 < info.bytes_read <= sent
    r = run_cli("inspect", url)
    assert r.exit_code == 0
    assert re.search(r"^Read: +[\d.]+ KiB over the network", r.output, re.M), r.output
    d = json.loads(run_cli("inspect", url, "--json").output)
    assert 0 < d["bytes_read"] < MB


def test_inspect_s3_reports_bytes_read(s3: Any, run_cli: Any) -> None:
    sd = {"w": torch.randn(2_000_000), "b": torch.randn(4)}
    buf = io.BytesIO()
    torch.save(sd, buf)
    s3.pipe("ckpt/model.pth", buf.getvalue())
    r = run_cli("inspect", "s3://ckpt/model.pth")
    assert r.exit_code == 0, r.output
    m = re.search(r"^Read: +([\d.]+) KiB", r.output, re.M)
    assert m and float(m.group(1)) < 1024
    assert "w" in r.output and "2000000" in r.output


def test_scan_url_reads_ranges(http: Files, big: str, run_cli: Any) -> None:
    before = http.sent
    res = ckptool.scan_file(_url(http, big))
    assert res.verdict == "safe" and res.format == "torch-zip"
    assert http.sent - before < MB and res.bytes_read is not None and res.bytes_read < MB
    r = run_cli("scan", _url(http, big))
    assert r.exit_code == 0 and "over the network" in r.output
    d = json.loads(run_cli("scan", _url(http, big), "--json").output)
    assert d["files"][0]["bytes_read"] < MB


def test_missing_url_is_a_usage_error(s3: Any, run_cli: Any) -> None:
    r = run_cli("inspect", "s3://ckpt/nothing-here.pth")
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[0].startswith("Error: s3://ckpt/nothing-here.pth: no such file")


# ------------------------------------------------------------------------------------------------ rewrites
def test_remap_s3_to_s3_is_bit_exact(s3: Any, tmp_path: Path, run_cli: Any) -> None:
    s3.put(str(REAL), "ckpt/lpips.pth")
    r = run_cli("remap", "s3://ckpt/lpips.pth", "--to", "cpu", "-o", "s3://ckpt/lpips.cpu.pth")
    assert r.exit_code == 0, r.output
    code = r.output.split("Load it with: ", 1)[1].strip()
    assert code.startswith("torch.load(fsspec.open('s3://ckpt/lpips.cpu.pth', 'rb').open()")
    out = eval(code, {"torch": torch, "fsspec": fsspec})  # what the closing line says works
    want = torch.load(REAL, map_location="cpu", weights_only=True)
    assert _sd_bytes(out) == _sd_bytes(want)
    assert all(v.device.type == "cpu" for v in out.values())
    # the same bytes as a local remap, record by record (storages copied, not decoded)
    local = tmp_path / "lpips.cpu.pth"
    assert run_cli("remap", REAL, "--to", "cpu", "-o", local).exit_code == 0
    with fsspec.open("s3://ckpt/lpips.cpu.pth", "rb") as f:
        assert _records(f.read()) == _records(local.read_bytes())


def _records(data: bytes) -> dict[str, bytes]:
    import zipfile

    z = zipfile.ZipFile(io.BytesIO(data))
    return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}


def test_prefix_command_and_convert_from_and_to_urls(s3: Any, tmp_path: Path, run_cli: Any) -> None:
    sd = {"module.fc.weight": torch.randn(64, 32), "module.fc.bias": torch.randn(64)}
    buf = io.BytesIO()
    torch.save(sd, buf)
    s3.pipe("ckpt/dp.pth", buf.getvalue())
    r = run_cli("strip-dataparallel", "s3://ckpt/dp.pth", "-o", "s3://ckpt/bare.pth")
    assert r.exit_code == 0, r.output
    assert set(_load_url("s3://ckpt/bare.pth")) == {"fc.weight", "fc.bias"}
    # convert: a URL to a local file and to another URL
    local = tmp_path / "bare.safetensors"
    r = run_cli("convert", "s3://ckpt/bare.pth", "-o", local)
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    assert _sd_bytes(load_file(local)) == _sd_bytes({k.removeprefix("module."): v for k, v in sd.items()})
    r = run_cli("convert", "s3://ckpt/bare.pth", "-o", "s3://ckpt/bare.safetensors")
    assert r.exit_code == 0, r.output
    code = r.output.split("Load it with: ", 1)[1].strip()
    import safetensors.torch

    assert _sd_bytes(eval(code, {"safetensors": safetensors, "fsspec": fsspec})) == _sd_bytes(load_file(local))
    # an existing remote output is refused without --force
    r = run_cli("convert", "s3://ckpt/bare.pth", "-o", "s3://ckpt/bare.safetensors")
    assert r.exit_code == 2 and "exists" in r.output


def test_memory_urls(run_cli: Any) -> None:
    fs = fsspec.filesystem("memory")
    buf = io.BytesIO()
    sd = {"a": torch.randn(100), "b": torch.randn(3, 3)}
    torch.save(sd, buf)
    fs.pipe("/t/m.pth", buf.getvalue())
    info = ckptool.inspect("memory://t/m.pth")
    assert {t.key for t in info.tensors} == {"a", "b"} and info.bytes_read
    res = ckptool.remap("memory://t/m.pth", "memory://t/m2.pth", to="cpu")
    assert res.dst == "memory://t/m2.pth"
    assert _sd_bytes(_load_url("memory://t/m2.pth")) == _sd_bytes(sd)
    r = run_cli("diff", "memory://t/m.pth", "memory://t/m2.pth")
    assert r.exit_code == 0 and "identical" in r.output


def test_legacy_file_over_http(http: Files, run_cli: Any) -> None:
    sd = {"w": torch.randn(5, 5)}
    torch.save(sd, http.root / "legacy.pth", _use_new_zipfile_serialization=False)
    info = ckptool.inspect(_url(http, "legacy.pth"))
    assert info.format == "torch-legacy" and [t.key for t in info.tensors] == ["w"]
    assert ckptool.scan_file(_url(http, "legacy.pth")).verdict == "safe"


def test_sharded_index_over_http(http: Files, tmp_path: Path, run_cli: Any) -> None:
    from safetensors.torch import save_file

    parts = [{"a.weight": torch.randn(4, 4)}, {"b.weight": torch.randn(3)}]
    wm = {}
    for i, part in enumerate(parts):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(part, str(http.root / name))
        wm.update(dict.fromkeys(part, name))
    (http.root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    index = _url(http, "model.safetensors.index.json")
    info = ckptool.inspect(index)
    assert info.format == "sharded-safetensors" and {t.key for t in info.tensors} == {"a.weight", "b.weight"}
    assert info.bytes_read
    out = tmp_path / "merged.pth"
    r = run_cli("convert", index, "-o", out)
    assert r.exit_code == 0, r.output
    assert _sd_bytes(torch.load(out, weights_only=True)) == _sd_bytes({**parts[0], **parts[1]})
    assert ckptool.diff(index, str(out)).identical


def test_load_into_from_url(s3: Any, http: Files) -> None:
    model = torch.nn.Linear(8, 4)
    want = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save({"module." + k: v for k, v in want.items()}, buf)
    s3.pipe("ckpt/linear.pth", buf.getvalue())
    ckptool.load_into(model, "s3://ckpt/linear.pth")
    assert _sd_bytes(model.state_dict()) == _sd_bytes(want)
    from safetensors.torch import save_file

    save_file(want, str(http.root / "linear.safetensors"))
    model2 = torch.nn.Linear(8, 4)
    ckptool.load_into(model2, _url(http, "linear.safetensors"))
    assert _sd_bytes(model2.state_dict()) == _sd_bytes(want)


# ------------------------------------------------------------------------------------------------ failures
def test_network_failure_mid_stream_leaves_nothing(s3: Any, http: Files, big: str, run_cli: Any) -> None:
    url = _url(http, big, drop=True)
    r = run_cli("remap", url, "--to", "cpu", "-o", "s3://ckpt/partial.pth")
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: reading {url} failed at byte "), r.output
    assert not s3.exists("ckpt/partial.pth")
    assert not [n for n in s3.ls("ckpt") if "partial" in n]
    assert not s3.list_multipart_uploads("ckpt")


def test_failed_upload_is_discarded(tmp_path: Path) -> None:
    """A destination that fails mid-upload: one RemoteError, the upload discarded, nothing at the URL."""
    from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

    discarded: list[str] = []

    class _Flaky(MemoryFile):
        def write(self, data: Any) -> int:
            if self.tell() + len(data) > 1000:
                raise ConnectionResetError("connection reset by peer")
            return super().write(data)

        def discard(self) -> None:
            discarded.append(self.path)

    class FlakyFS(MemoryFileSystem):
        protocol = "flakymem"
        store: ClassVar[dict[str, Any]] = {}
        pseudo_dirs: ClassVar[list[str]] = [""]

        def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
            if mode == "wb":
                return _Flaky(self, self._strip_protocol(path))
            return super()._open(path, mode, **kw)

    fsspec.register_implementation("flakymem", FlakyFS, clobber=True)
    src = tmp_path / "m.pth"
    torch.save({"a": torch.randn(1000)}, src)
    with pytest.raises(ckptool.RemoteError, match=r"^writing flakymem://out/m\.pth failed \(ConnectionResetError"):
        ckptool.remap(str(src), "flakymem://out/m.pth", to="cpu")
    assert discarded and not FlakyFS().exists("/out/m.pth")
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(".m.pth.ckptool-")]


def test_local_paths_do_not_import_fsspec(tmp_path: Path) -> None:
    p = tmp_path / "m.pth"
    torch.save({"a": torch.randn(3)}, p)
    code = (f"import sys, ckptool; ckptool.inspect({str(p)!r}); ckptool.scan_file({str(p)!r}); "
            "assert 'fsspec' not in sys.modules, 'fsspec imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def test_in_place_rewrite_of_a_url_and_folder_outputs_refused(run_cli: Any) -> None:
    fs = fsspec.filesystem("memory")
    buf = io.BytesIO()
    torch.save({"module.w": torch.randn(4)}, buf)
    fs.pipe("/ip/m.pth", buf.getvalue())
    r = run_cli("strip-dataparallel", "memory://ip/m.pth", "--in-place")
    assert r.exit_code == 0, r.output
    assert list(_load_url("memory://ip/m.pth")) == ["w"]
    r = run_cli("convert", "memory://ip/m.pth", "--max-shard-size", "1KB", "-o", "memory://ip/shards")
    assert r.exit_code == 2 and "an output URL takes one file" in r.output
    assert not fs.exists("/ip/shards")


def test_missing_fsspec_names_the_extra(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['fsspec'] = None; sys.modules['fsspec.core'] = None; "
            "sys.argv = ['ckptool', 'inspect', 's3://bucket/model.pth']; from ckptool.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    want = "Error: s3://bucket/model.pth needs fsspec, which is not installed"
    assert len(lines) == 1 and lines[0].startswith(want), r.stderr
    assert "pip install 'ckptool[remote]'" in lines[0]
