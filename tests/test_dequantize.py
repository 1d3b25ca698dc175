"""``convert --dtype`` dequantizes fine-grained FP8 checkpoints (issue 48): the output equals transformers' own
dequantization bit for bit, and ``from_pretrained`` on the output folder gives the logits of the reference model
(transformers' ``FineGrainedFP8Config(dequantize=True)`` on CPU). The fixture is quantized with transformers' own
``Fp8Quantize``."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import ckptool
from ckptool.errors import UnsupportedError
from ckptool.ops.convert.dequant import without_key

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

SCALE = "weight_scale_inv"


def _hf(block: list[int]) -> types.SimpleNamespace:
    from transformers import FineGrainedFP8Config

    return types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block))


def _fp8_folder(folder: Path, block: list[int] | None = None) -> dict[str, torch.Tensor]:
    """A tiny Llama saved by transformers, its linear weights quantized to fine-grained FP8 by transformers'
    ``Fp8Quantize`` (what ``save_pretrained`` of an FP8-quantized model holds), ``quantization_config`` in config.json
    as ``FineGrainedFP8Config.to_dict()`` writes it. Returns the quantized state_dict."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    hf = _hf(block or [128, 128])
    sd: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k.endswith("proj.weight"):
            sd.update(Fp8Quantize(hf)._quantize_one(k, v))
        else:
            sd[k] = v.contiguous()
    model.save_pretrained(folder)
    os.remove(folder / "model.safetensors")
    st_torch.save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((folder / "config.json").read_text())
    conf["quantization_config"] = hf.quantization_config.to_dict()
    (folder / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    return sd


def _reference(sd: dict[str, torch.Tensor], dtype: torch.dtype, block: list[int]) -> dict[str, torch.Tensor]:
    """transformers' ``Fp8Dequantize`` of every quantized weight; the other tensors as they are, scales left out."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    deq = Fp8Dequantize(_hf(block))
    out = {}
    for k, v in sd.items():
        if k.endswith(SCALE):
            continue
        if v.dtype == torch.float8_e4m3fn:
            out[k] = deq._dequantize_one(v, sd[k.removesuffix("weight") + SCALE], dtype)
        else:
            out[k] = v.to(dtype) if v.is_floating_point() else v
    return out


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_fp8_folder_equals_transformers_dequantize_bit_for_bit(tmp_path: Path, dtype: str) -> None:
    sd = _fp8_folder(tmp_path / "fp8")
    res = ckptool.convert(tmp_path / "fp8", f"{tmp_path / 'out'}/", dtype=dtype, max_shard_size="1MB")
    assert res.shards > 1  # sharded in the output
    got = {}
    for name in sorted(os.listdir(tmp_path / "out")):
        if name.endswith(".safetensors"):
            got.update(st_torch.load_file(tmp_path / "out" / name))
    _bits_equal(got, _reference(sd, getattr(torch, dtype), [128, 128]))
    assert not any(k.endswith(SCALE) for k in got)
    assert res.cast.get(f"float8_e4m3fn->{dtype}") == 14
    if dtype != "float32":  # the float32 products are the values: no second rounding to report
        assert res.cast_values["model.layers.0.self_attn.q_proj.weight"].src == "float8_e4m3fn (fine-grained fp8)"
    src_conf = (tmp_path / "fp8" / "config.json").read_text()
    out_conf = (tmp_path / "out" / "config.json").read_text()
    assert out_conf == without_key(src_conf, "quantization_config")
    assert json.loads(out_conf) == {k: v for k, v in json.loads(src_conf).items() if k != "quantization_config"}


def test_from_pretrained_on_the_output_gives_the_reference_logits(tmp_path: Path, run_cli) -> None:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    _fp8_folder(tmp_path / "fp8")
    r = run_cli("convert", tmp_path / "fp8", "-o", f"{tmp_path / 'out'}/", "--dtype", "bfloat16",
                "--max-shard-size", "10GB")
    assert r.exit_code == 0, r.output
    assert "dequantized 14 fine-grained fp8 weight(s)" in r.output and "Cast report" in r.output
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16, quantization_config=(
        FineGrainedFP8Config(dequantize=True, weight_block_size=[128, 128])))
    assert type(ours.model.layers[0].mlp.up_proj) is torch.nn.Linear
    ids = torch.tensor([[1, 5, 9, 200, 42]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


def test_partial_blocks_and_experts_as_deepseek_stores_them(tmp_path: Path) -> None:
    """A weight whose sides are not multiples of the block (DeepSeek-V3: ceil(rows / 128) scale rows), and a 3-D
    expert stack (one scale grid per expert), against the block formula written out directly."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(200, 300, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) + 0.01
    e = (torch.randn(3, 256, 128, generator=g) * 10).clamp(-448, 448).to(torch.float8_e4m3fn)
    es = torch.rand(3, 2, 1, generator=g)
    st_torch.save_file({"a.weight": w, f"a.{SCALE}": s, "experts.weight": e, f"experts.{SCALE}": es,
                        "norm": torch.ones(4)}, tmp_path / "m.safetensors")
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "fp8", '
                                          '"weight_block_size": [128, 128]}}')
    res = ckptool.convert(tmp_path / "m.safetensors", tmp_path / "out.pt", dtype="bfloat16")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sorted(out) == ["a.weight", "experts.weight", "norm"]
    full = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.equal(out["a.weight"].view(torch.int16), (w.float() * full).to(torch.bfloat16).view(torch.int16))
    ref = (e.float() * es.repeat_interleave(128, 1)).to(torch.bfloat16)
    assert torch.equal(out["experts.weight"].view(torch.int16), ref.view(torch.int16))
    assert res.cast_total is not None and res.cast_total.elements == w.numel() + e.numel() + 4


@pytest.mark.parametrize(("quant", "words"), [
    ({"quant_method": "gptq", "bits": 4}, "gptq quantization is not dequantized"),
    ({"quant_method": "awq"}, "awq quantization is not dequantized"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes quantization is not dequantized"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}, "ue8m0"),
])
def test_other_schemes_are_named_and_refused(tmp_path: Path, run_cli, quant: dict[str, object], words: str) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    st_torch.save_file({"w": torch.ones(2, 2)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"quantization_config": quant}))
    r = run_cli("convert", folder, "-o", f"{tmp_path / 'out'}/", "--dtype", "bfloat16", "--max-shard-size", "1GB")
    assert r.exit_code == 1 and r.output.startswith("Error: ") and words in r.output, r.output
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_a_scale_grid_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    st_torch.save_file({"a.weight": torch.zeros(100, 100).to(torch.float8_e4m3fn), f"a.{SCALE}": torch.ones(3, 3)},
                       tmp_path / "m.safetensors")
    with pytest.raises(UnsupportedError, match=r"a\.weight: a weight of shape \[100, 100\] does not fit"):
        ckptool.convert(tmp_path / "m.safetensors", tmp_path / "o.safetensors", dtype="bfloat16")
    assert not (tmp_path / "o.safetensors").exists()


def test_without_dtype_nothing_is_dequantized(tmp_path: Path) -> None:
    w = torch.ones(128, 128).to(torch.float8_e4m3fn)
    st_torch.save_file({"a.weight": w, f"a.{SCALE}": torch.ones(1, 1)}, tmp_path / "m.safetensors")
    ckptool.convert(tmp_path / "m.safetensors", tmp_path / "o.safetensors")
    assert sorted(st_torch.load_file(tmp_path / "o.safetensors")) == ["a.weight", f"a.{SCALE}"]


@pytest.mark.parametrize(("text", "want"), [
    ('{\n  "a": 1,\n  "quantization_config": {"x": [1, 2]},\n  "z": 3\n}\n', '{\n  "a": 1,\n  "z": 3\n}\n'),
    ('{"a": 1, "quantization_config": {}}', '{"a": 1}'),
    ('{"quantization_config": 2}', "{}"),
    ('{"b": {"quantization_config": 1}}', None),
])
def test_without_key_keeps_every_other_byte(text: str, want: str | None) -> None:
    assert without_key(text, "quantization_config") == want


def test_without_a_config_the_block_is_the_scale_grid_as_transformers_derives_it(tmp_path: Path) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(2)
    w = (torch.randn(200, 300, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) + 0.01
    st_torch.save_file({"a.weight": w, f"a.{SCALE}": s}, tmp_path / "m.safetensors")
    ckptool.convert(tmp_path / "m.safetensors", tmp_path / "o.safetensors", dtype="float16")
    ref = Fp8Dequantize(None)._dequantize_one(w, s, torch.float16)  # blocks of 100 x 100
    _bits_equal(st_torch.load_file(tmp_path / "o.safetensors"), {"a.weight": ref})


def _ct_folder(folder: Path, strategy: str) -> None:
    """A tiny Llama quantized to FP8 and saved by compressed-tensors itself (``apply_quantization_config``, the
    scales set from each weight's absolute maximum as an observer would, ``ModelCompressor.compress_model``,
    ``save_pretrained`` + ``update_config``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    qcfg = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                              ignore=["lm_head"])
    apply_quantization_config(model, qcfg)
    for m in model.modules():
        if hasattr(m, "weight_scale"):
            w = m.weight.detach().float().abs()
            amax = w.amax(dim=1, keepdim=True) if strategy == "channel" else w.amax().reshape(1)
            m.weight_scale.data.copy_((amax / 448).to(m.weight_scale.dtype))
    comp = ModelCompressor.from_pretrained_model(model)
    comp.compress_model(model)
    model.save_pretrained(folder)
    comp.update_config(folder)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_equals_its_decompression_and_logits(tmp_path: Path, strategy: str) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    _ct_folder(tmp_path / "ct", strategy)
    assert json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "compressed-tensors")
    res = ckptool.convert(tmp_path / "ct", f"{tmp_path / 'out'}/", dtype="bfloat16", max_shard_size="10GB")
    assert any("dequantized 14 compressed-tensors fp8 weight(s)" in n for n in res.notes)
    # the reference: transformers loading the folder with compressed-tensors decompressing it (ModelCompressor)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.bfloat16,
                                               quantization_config=CompressedTensorsConfig(run_compressed=False))
    got = st_torch.load_file(tmp_path / "out" / "model.safetensors")
    want = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight" or k in got}
    _bits_equal(got, want)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


@pytest.mark.parametrize(("change", "words"), [
    ({"format": "pack-quantized"}, "format 'pack-quantized' (group_0) is not dequantized"),
    ({"weights": {"type": "int", "num_bits": 4, "symmetric": True, "strategy": "group"}}, "4-bit int weights"),
    ({"weights": {"type": "float", "num_bits": 8, "symmetric": True, "strategy": "block"}}, "strategy 'block'"),
])
def test_other_compressed_tensors_schemes_are_refused(tmp_path: Path, change: dict[str, object], words: str) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    st_torch.save_file({"w": torch.ones(2, 2)}, folder / "model.safetensors")
    group = {"format": "float-quantized", "weights": {"type": "float", "num_bits": 8, "symmetric": True,
                                                      "strategy": "channel"}, **change}
    (folder / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": group}}}))
    with pytest.raises(UnsupportedError, match=re.escape(words)):
        ckptool.convert(folder, f"{tmp_path / 'out'}/", dtype="bfloat16", max_shard_size="1GB")


def _mxfp4_folder(folder: Path) -> dict[str, torch.Tensor]:
    """A tiny gpt-oss saved by transformers, its expert stacks replaced by MXFP4 blocks and scales in the layout
    transformers' ``Mxfp4ReverseDeserialize`` writes (``X_blocks`` ``(experts, rows, groups, 16)`` uint8, ``X_scales``
    ``(experts, rows, groups)`` uint8), ``quant_method: mxfp4`` in config.json. Returns the blocks and scales."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                       vocab_size=128, layer_types=["full_attention", "sliding_attention"])
    model = GptOssForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    sd = st_torch.load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    packed = {}
    for k in list(sd):
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, cols, rows = sd.pop(k).shape  # dequantized: (experts, cols, rows); packed per row
            packed[k + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g,
                                                  dtype=torch.uint8)
            packed[k + "_scales"] = torch.randint(120, 128, (experts, rows, cols // 32), generator=g,
                                                  dtype=torch.uint8)
    sd.update(packed)
    st_torch.save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((folder / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": None}
    (folder / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    return packed


def test_mxfp4_experts_equal_transformers_dequantization_and_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = _mxfp4_folder(tmp_path / "mx")
    res = ckptool.convert(tmp_path / "mx", f"{tmp_path / 'out'}/", dtype="bfloat16", max_shard_size="10GB")
    assert any("dequantized 4 mxfp4 weight(s)" in n for n in res.notes), res.notes
    got = st_torch.load_file(tmp_path / "out" / "model.safetensors")
    assert not any(k.endswith(("_blocks", "_scales")) for k in got)
    for k in packed:
        if k.endswith("_blocks"):
            ref = convert_moe_packed_tensors(packed[k], packed[k.replace("_blocks", "_scales")], dtype=torch.bfloat16)
            _bits_equal({"w": got[k.removesuffix("_blocks")]}, {"w": ref})
    # transformers on a CPU dequantizes an MXFP4 model to bfloat16 as it loads it: the reference model
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path / "mx", dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref_model(ids).logits)


def test_inspect_names_the_quantization(tmp_path: Path, run_cli) -> None:
    _fp8_folder(tmp_path / "fp8")
    info = ckptool.inspect(tmp_path / "fp8")
    q = info.quantization
    assert q is not None and q["scheme"] == "fine-grained fp8" and q["quant_method"] == "fp8" and not q["refused"]
    assert len(q["weights"]) == 14 and q["bfloat16_bytes"] == 2 * sum(
        math.prod(w["shape"]) for w in q["weights"].values())
    assert q["weights"]["model.layers.0.mlp.down_proj.weight"] == {
        "weight": "model.layers.0.mlp.down_proj.weight", "scale": "model.layers.0.mlp.down_proj.weight_scale_inv",
        "extra": [], "block": [128, 128], "shape": [256, 384]}
    r = run_cli("inspect", tmp_path / "fp8")
    assert "Quant:    fine-grained fp8: 14 quantized weight(s) with their scales (blocks 128x128)" in r.output
    assert json.loads(run_cli("inspect", tmp_path / "fp8", "--json").output)["quantization"]["scheme"] == (
        "fine-grained fp8")
    ckptool.convert(tmp_path / "fp8", f"{tmp_path / 'out'}/", dtype="bfloat16", max_shard_size="10GB")
    assert ckptool.inspect(tmp_path / "out").quantization is None  # dequantized: nothing left to name
    _mxfp4_folder(tmp_path / "mx")
    mx = ckptool.inspect(tmp_path / "mx").quantization
    assert mx is not None and mx["scheme"] == "mxfp4" and mx["weights"]["model.layers.0.mlp.experts.down_proj"][
        "block"] == [1, 32]


def test_inspect_names_refused_schemes_with_the_reason(tmp_path: Path) -> None:
    st_torch.save_file({"w.qweight": torch.zeros(4, 4, dtype=torch.int32)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    q = ckptool.inspect(tmp_path / "model.safetensors").quantization
    assert q is not None and q["scheme"] == "gptq" and "GPTQ packs int4 weights" in q["refused"]
    assert "gptq: not dequantized by ckptool" in str(ckptool.inspect(tmp_path / "model.safetensors"))


def test_a_dequantized_weight_that_overflows_float16_is_refused_and_counted(tmp_path: Path) -> None:
    w = torch.tensor([[448.0, -448.0, 1.0, 0.0]] * 4).to(torch.float8_e4m3fn)
    s = torch.tensor([[1000.0]])  # 448 * 1000 > 65504: inf in float16
    st_torch.save_file({"a.weight": w, f"a.{SCALE}": s}, tmp_path / "m.safetensors")
    with pytest.raises(UnsupportedError, match=r"a\.weight \(float8_e4m3fn \(fine-grained fp8\)->float16: 8 to \+-inf"):
        ckptool.convert(tmp_path / "m.safetensors", tmp_path / "o.safetensors", dtype="float16")
    assert not (tmp_path / "o.safetensors").exists()
    res = ckptool.convert(tmp_path / "m.safetensors", tmp_path / "o.safetensors", dtype="float16",
                          allow_overflow=True)
    c = res.cast_values["a.weight"]
    assert (c.elements, c.overflow, c.underflow, c.max_abs_error) == (16, 8, 0, 0.0)
    assert torch.isinf(st_torch.load_file(tmp_path / "o.safetensors")["a.weight"]).sum() == 8


# ------------------------------------------------------------------------------------------------ diff, scan, report
def _quantized(kind: str, folder: Path) -> None:
    if kind == "fp8":
        _fp8_folder(folder)
    elif kind == "compressed-tensors":
        _ct_folder(folder, "channel")
    else:
        _mxfp4_folder(folder)


def _flip_byte(path: Path, key: str) -> None:
    """Flip the top exponent bit of tensor ``key``'s first element (bfloat16: its second byte) in the safetensors
    file ``path``."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8:8 + n])[key]["data_offsets"][0]
    data[8 + n + begin + 1] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["fp8", "compressed-tensors", "mxfp4"])
def test_diff_of_a_quantized_folder_against_its_dequantized_output(tmp_path: Path, run_cli, kind: str) -> None:
    _quantized(kind, tmp_path / "q")
    ckptool.convert(tmp_path / "q", f"{tmp_path / 'out'}/", dtype="bfloat16", max_shard_size="10GB")
    r = run_cli("diff", tmp_path / "q", tmp_path / "out", "--atol", "0", "--json")
    d = json.loads(r.output)
    assert r.exit_code == 0 and d["identical"], r.output
    assert d["only_a"] == [] and d["only_b"] == []  # the scales are the weights' and MXFP4's X_blocks is X
    assert any("dequantized" in n for n in d["notes"])
    weight = ("model.layers.0.mlp.experts.down_proj" if kind == "mxfp4"
              else "model.layers.0.mlp.down_proj.weight")
    # bit-exact, as for any dtype difference: the dtype change is reported, the values are not compared
    r = run_cli("diff", tmp_path / "q", tmp_path / "out")
    assert r.exit_code == 1 and "pass --rtol/--atol to compare its dequantized values" in r.output, r.output
    assert ("uint8 -> bfloat16" if kind == "mxfp4" else "float8_e4m3fn -> bfloat16") in r.output
    # bit-exact stays torch-free (the dequantized values are computed only with tolerances)
    code = (f"import sys, ckptool; r = ckptool.diff({str(tmp_path / 'q')!r}, {str(tmp_path / 'out')!r}); "
            "assert not r.identical and 'torch' not in sys.modules")
    root = str(Path(__file__).resolve().parents[1])
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": root})
    _flip_byte(tmp_path / "out" / "model.safetensors", weight)
    r = run_cli("diff", tmp_path / "q", tmp_path / "out", "--atol", "1e-3")
    assert r.exit_code == 1 and weight in r.output, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith(weight + " ")]
    assert lines and "differ" in lines[0]


@pytest.mark.parametrize("kind", ["fp8", "compressed-tensors", "mxfp4"])
def test_inspect_scan_and_report_agree_on_quantized_folders(tmp_path: Path, kind: str) -> None:
    import agreement
    from safetensors import safe_open

    _quantized(kind, tmp_path / "q")
    (tmp_path / "work").mkdir()
    assert agreement.disagreements(tmp_path / "q", tmp_path / "work") == []
    got = agreement.answers(tmp_path / "q", tmp_path / "work")
    assert {a.tensors for a in got.values() if a.ok and a.tensors is not None} == {
        len(safe_open(tmp_path / "q" / "model.safetensors", "pt").keys())}


def test_diff_of_a_weight_convert_refuses_compares_it_as_stored(tmp_path: Path) -> None:
    st_torch.save_file({"a.weight": torch.zeros(100, 100).to(torch.float8_e4m3fn), f"a.{SCALE}": torch.ones(3, 3)},
                       tmp_path / "m.safetensors")
    st_torch.save_file({"a.weight": torch.zeros(100, 100, dtype=torch.bfloat16)}, tmp_path / "o.safetensors")
    res = ckptool.diff(tmp_path / "m.safetensors", tmp_path / "o.safetensors", atol=0)
    assert not res.identical and res.only_a == [f"a.{SCALE}"]
    assert any(n.startswith("quantized weights compared as stored: ") and "does not fit" in n for n in res.notes)
