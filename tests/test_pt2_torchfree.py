"""``.pt2`` archives without torch: an archive laid out as ``torch.export.save`` writes it (``ckptool/formats/pt2.py``
describes the layout; ``tests/test_pt2.py`` checks the same against torch's own files) is made here with
``zipfile``, then inspected, converted to safetensors and scanned with torch absent (``torchfree``)."""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest

from ckptool.formats import detect
from ckptool.formats.safetensors import read_header
from ckptool.ops.convert import convert
from ckptool.ops.inspect.entry import inspect
from ckptool.scanning.entry import scan_file

pytestmark = pytest.mark.torchfree

WEIGHT = struct.pack("<6f", 1.0, -2.0, 3.5, 0.25, -0.0, 7.0)  # float32, 2x3
BIAS = struct.pack("<2d", 0.5, -1.5)  # float64, the base of a view at offset 1
PAYLOAD = b"cos\nsystem\n(S'echo pwned'\ntR."  # protocol 0: no PROTO header


def _meta(dtype: int, sizes: list[int], strides: list[int], offset: int = 0, param: bool = True) -> dict[str, Any]:
    return {"dtype": dtype, "sizes": [{"as_int": s} for s in sizes], "requires_grad": param,
            "device": {"type": "cpu", "index": None}, "strides": [{"as_int": s} for s in strides],
            "storage_offset": {"as_int": offset}, "layout": 7}


def make_pt2(path: Path, sample: bytes = pickle.dumps(((), {}), protocol=2)) -> Path:
    weights = {"lin.weight": {"path_name": "weight_0", "is_param": True, "use_pickle": False,
                              "tensor_meta": _meta(7, [2, 3], [3, 1])},
               "lin.bias": {"path_name": "weight_1", "is_param": True, "use_pickle": False,
                            "tensor_meta": _meta(8, [1], [1], offset=1)}}
    values = {"x": _meta(7, [4, 3], [3, 1], param=False), "out": _meta(7, [4, 2], [2, 1], param=False)}
    program = {"schema_version": {"major": 8, "minor": 20}, "torch_version": "2.13.0+cpu",
               "graph_module": {"graph": {"tensor_values": values},
                                "signature": {"input_specs": [
                                    {"parameter": {"arg": {"name": "p_lin_weight"}, "parameter_name": "lin.weight"}},
                                    {"parameter": {"arg": {"name": "p_lin_bias"}, "parameter_name": "lin.bias"}},
                                    {"user_input": {"arg": {"as_tensor": {"name": "x"}}}}],
                                    "output_specs": [{"user_output": {"arg": {"as_tensor": {"name": "out"}}}}]}}}
    members = {"archive_format": b"pt2", "archive_version": b"0", "byteorder": b"little", ".data/version": b"6\n",
               "models/model.json": json.dumps(program).encode(),
               "data/weights/model_weights_config.json": json.dumps({"config": weights}).encode(),
               "data/weights/weight_0": WEIGHT, "data/weights/weight_1": BIAS,
               "data/constants/model_constants_config.json": b'{"config": {}}',
               "data/sample_inputs/model.pt": sample}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(f"model/{name}", data)
    return path


def test_inspect_and_convert_without_torch(tmp_path: Path) -> None:
    path = make_pt2(tmp_path / "m.pt2")
    assert detect.detect_format(str(path)) == "torch-export"
    info = inspect(path)
    rows = {t.key: (t.shape, t.dtype, t.nbytes, t.storage_offset) for t in info.tensors}
    assert rows == {"lin.weight": ([2, 3], "float32", 24, 0), "lin.bias": ([1], "float64", 8, 1)}
    (prog,) = info.programs
    assert [(e["kind"], e["name"]) for e in prog["inputs"]][-1] == ("user_input", "x")
    assert prog["outputs"] == [{"kind": "user_output", "name": "out", "dtype": "float32", "shape": [4, 2]}]
    out = tmp_path / "w.safetensors"
    res = convert(path, out)
    assert res.verified
    header = read_header(str(out))
    raw = out.read_bytes()[header.data_start:]
    w0, w1 = header.entries["lin.weight"]["data_offsets"]
    b0, b1 = header.entries["lin.bias"]["data_offsets"]
    assert raw[w0:w1] == WEIGHT and raw[b0:b1] == BIAS[8:]  # the bias is a view at element 1 of its storage


def test_scan_reads_the_members_torch_export_load_unpickles(tmp_path: Path) -> None:
    assert scan_file(make_pt2(tmp_path / "ok.pt2")).verdict == "safe"
    res = scan_file(make_pt2(tmp_path / "bad.pt2", sample=PAYLOAD))
    assert (res.format, res.verdict) == ("torch-export", "dangerous")
    assert [g.name for g in res.globals if g.status == "dangerous"] == ["os.system"]
