"""`ckptool merge-lora` (issue 39) against PEFT itself: adapters made by ``peft`` on tiny transformers models, merged
by PEFT (``merge_and_unload()`` + ``save_pretrained``) and by ckptool, compared bit for bit.

GPT-2 (``Conv1D``, ``fan_in_fan_out``) and Llama (``q_proj`` / ``v_proj``) bases in float32, float16 and bfloat16;
``use_rslora``, ``rank_pattern`` / ``alpha_pattern``, ``modules_to_save``, embeddings; small merge blocks (the
delta computed a few rows at a time gives PEFT's bits); other base formats (a ``.pt`` file, a sharded set); the
refusals. Skipped where ``peft`` is not installed (the ``merge`` extra).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import make_lora

import ckptool
from ckptool.errors import InputNotFoundError, UnsupportedError, UsageError
from ckptool.torch_ops import merge as merge_math


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose dtype, shape or bytes differ (both sides must hold the same keys)."""
    assert sorted(a) == sorted(b)
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(_bits(a[k]), _bits(b[k]))]


def _case(tmp: Path, kind: str, dtype: str, **options: Any) -> tuple[Path, Path, Path]:
    base, adapter = make_lora.make(tmp, kind, dtype, **options)
    ref = make_lora.peft_merged(base, adapter, tmp / "ref", dtype)
    return base, adapter, ref


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_merge_lora_equals_peft_bit_for_bit(tmp_path: Path, kind: str, dtype: str) -> None:
    base, adapter, ref = _case(tmp_path, kind, dtype)
    res = ckptool.merge_lora(base, adapter, tmp_path / "out")
    ours = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    theirs = safetensors_torch.load_file(ref / "model.safetensors")
    assert _same_bits(ours, theirs) == []
    before = safetensors_torch.load_file(base / "model.safetensors")
    changed = [k for k in before if not torch.equal(_bits(before[k]), _bits(ours[k]))]
    assert sorted(changed) == sorted(res.merged) and len(changed) == (6 if kind == "gpt2" else 4)
    assert res.kept == ["config.json", "generation_config.json"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # loads without PEFT
    assert model.dtype == getattr(torch, dtype)


@pytest.mark.parametrize("options", [
    {"use_rslora": True, "r": 8, "lora_alpha": 4},
    {"rank_pattern": {"v_proj": 2, r"layers\.1\.self_attn\.q_proj": 6}, "alpha_pattern": {"q_proj": 3}},
    {"modules_to_save": ["lm_head"]},
    {"target_modules": ["q_proj", "embed_tokens"]},
])
def test_merge_lora_options_equal_peft(tmp_path: Path, options: dict[str, Any]) -> None:
    base, adapter, ref = _case(tmp_path, "llama", "float32", **options)
    res = ckptool.merge_lora(base, adapter, tmp_path / "out.safetensors")
    assert _same_bits(safetensors_torch.load_file(tmp_path / "out.safetensors"),
                      safetensors_torch.load_file(ref / "model.safetensors")) == []
    if "rank_pattern" in options:
        assert set(res.merged.values()) == {3 / 4, 3 / 6, 8 / 2}  # alpha / r: layer 0 q, layer 1 q, every v
    if "modules_to_save" in options:
        assert res.copied == ["lm_head.weight"]
    if "use_rslora" in options:
        assert set(res.merged.values()) == {4 / 8 ** 0.5}


def test_small_blocks_give_the_same_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delta computed 64 rows at a time (row blocks of B; column blocks of A for Conv1D) is PEFT's: models 256
    wide, so that every weight is several blocks."""
    monkeypatch.setattr(merge_math, "BLOCK_ELEMENTS", 64 * 256)
    for kind in ("gpt2", "llama"):
        base, adapter = make_lora.make(tmp_path / kind, kind, "float32", hidden=256, r=16)
        ref = make_lora.peft_merged(base, adapter, tmp_path / kind / "ref", "float32")
        ckptool.merge_lora(base, adapter, tmp_path / f"{kind}.safetensors")
        assert _same_bits(safetensors_torch.load_file(tmp_path / f"{kind}.safetensors"),
                          safetensors_torch.load_file(ref / "model.safetensors")) == []


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("shape,r", [((300, 700), 16), ((1000, 64), 64), ((130, 2000), 8)])
def test_blocks_equal_the_whole_product(monkeypatch: pytest.MonkeyPatch, transpose: bool,
                                        shape: tuple[int, int], r: int) -> None:
    """add_lora_delta in blocks of 16 rows and more (remainder folded) equals ``W + (B @ A)[.T] * s`` whole, with
    ``W`` whole or passed a block of rows at a time."""
    g = torch.Generator().manual_seed(sum(shape) + r)
    n_out, n_in = shape[::-1] if transpose else shape
    w, a, b = torch.randn(shape, generator=g), torch.randn(r, n_in, generator=g), torch.randn(n_out, r, generator=g)
    delta = b @ a
    want = w + (delta.t() if transpose else delta) * 0.37
    for block in (16, 64, 100):
        monkeypatch.setattr(merge_math, "BLOCK_ELEMENTS", block * shape[1])
        monkeypatch.setattr(merge_math, "MIN_BLOCK_ROWS", 16)
        buf = bytearray(w.numpy().tobytes())
        merge_math.add_lora_delta(buf, "float32", shape, a.numpy().tobytes(), "float32", (r, n_in),
                                  b.numpy().tobytes(), "float32", (n_out, r), 0.37, transpose)
        got = torch.frombuffer(buf, dtype=torch.float32).view(shape)
        assert torch.equal(_bits(got), _bits(want)), block
        parts = []  # W streamed a block of rows at a time (merge-lora's reads), the same bits
        for i, j in merge_math.lora_blocks(shape):
            part = bytearray(w[i:j].numpy().tobytes())
            merge_math.add_lora_delta(part, "float32", shape, a.numpy().tobytes(), "float32", (r, n_in),
                                      b.numpy().tobytes(), "float32", (n_out, r), 0.37, transpose, (i, j))
            parts.append(part)
        assert bytes(b"".join(parts)) == bytes(buf), block


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_adapter_equals_peft(tmp_path: Path, dtype: str) -> None:
    """An adapter saved in the half dtype (``autocast_adapter_dtype=False``): PEFT rounds the delta to that dtype
    before adding it (two roundings); ckptool does the same, bit for bit. The one-rounding sum differs (so this test
    fails if the delta's rounding is left out)."""
    base, adapter = make_lora.make(tmp_path, "llama", dtype, autocast_adapter_dtype=False)
    ref = make_lora.peft_merged(base, adapter, tmp_path / "ref", dtype, autocast_adapter_dtype=False)
    res = ckptool.merge_lora(base, adapter, tmp_path / "out.safetensors")
    ours = safetensors_torch.load_file(tmp_path / "out.safetensors")
    theirs = safetensors_torch.load_file(ref / "model.safetensors")
    assert _same_bits(ours, theirs) == []
    lora = safetensors_torch.load_file(adapter / "adapter_model.safetensors")
    w = safetensors_torch.load_file(base / "model.safetensors")
    k = next(iter(res.merged))
    a, b = (lora[f"base_model.model.{k[:-len('.weight')]}.lora_{x}.weight"].float() for x in "AB")
    once = (w[k].float() + (b @ a) * res.merged[k]).to(w[k].dtype)
    assert not torch.equal(_bits(once), _bits(ours[k]))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("adapter_dtype", ["float32", "half"])
def test_half_precision_with_an_uneven_scaling_equals_peft(tmp_path: Path, kind: str, dtype: str,
                                                           adapter_dtype: str) -> None:
    """A scaling that is not a power of two (rsLoRA's ``alpha / sqrt(r)`` = 3 / sqrt(8)) in a half-precision model,
    with a float32 adapter and one saved in the half dtype: every rounding step of PEFT's order of operations
    (``B @ A``, times scaling, to the delta's dtype, added to ``W``, to ``W``'s dtype) shows in the bits; with a
    power-of-two scaling (the defaults' 2.0) scaling before or after a rounding gives the same bits, so the other
    tests cannot tell the order apart."""
    autocast = adapter_dtype == "float32"
    options = {"use_rslora": True, "r": 8, "lora_alpha": 3}
    base, adapter = make_lora.make(tmp_path, kind, dtype, autocast_adapter_dtype=autocast, **options)
    ref = make_lora.peft_merged(base, adapter, tmp_path / "ref", dtype, autocast_adapter_dtype=autocast)
    res = ckptool.merge_lora(base, adapter, tmp_path / "out.safetensors")
    assert set(res.merged.values()) == {3 / 8 ** 0.5}
    assert _same_bits(safetensors_torch.load_file(tmp_path / "out.safetensors"),
                      safetensors_torch.load_file(ref / "model.safetensors")) == []


def test_other_base_formats(tmp_path: Path) -> None:
    """A torch zip ``.pt`` base with a ``transformer.``-less key set (GPT2Model inside), a sharded set, and a
    ``.pt`` output: the same merged tensors."""
    base, adapter, ref = _case(tmp_path, "gpt2", "float32")
    want = safetensors_torch.load_file(ref / "model.safetensors")
    sd = safetensors_torch.load_file(base / "model.safetensors")
    torch.save({k[len("transformer."):]: v for k, v in sd.items() if k.startswith("transformer.")},
               tmp_path / "bare.pt")
    res = ckptool.merge_lora(tmp_path / "bare.pt", adapter, tmp_path / "bare_out.pt")
    got = torch.load(tmp_path / "bare_out.pt", weights_only=True)
    assert all(torch.equal(got[k], want["transformer." + k]) for k in got)
    assert res.renamed and all(not b.startswith("transformer.") for b in res.renamed.values())
    ckptool.convert(base / "model.safetensors", tmp_path / "sharded", max_shard_size="20KB")
    shutil.copy(base / "config.json", tmp_path / "sharded")
    res = ckptool.merge_lora(tmp_path / "sharded", adapter, tmp_path / "from_shards", max_shard_size="20KB")
    assert len(res.files) > 2 and "config.json" in res.kept
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "from_shards").state_dict()
    assert all(torch.equal(merged[k], want[k]) for k in want)


def _edit_config(adapter: Path, **changes: Any) -> None:
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_refusals(tmp_path: Path) -> None:
    base, adapter = make_lora.make(tmp_path, "llama", "float32")
    with pytest.raises(UnsupportedError, match="use_dora is set: DoRA"):
        dora = tmp_path / "dora"
        shutil.copytree(adapter, dora)
        _edit_config(dora, use_dora=True)
        ckptool.merge_lora(base, dora, tmp_path / "x.safetensors")
    ia3 = tmp_path / "ia3"
    shutil.copytree(adapter, ia3)
    _edit_config(ia3, peft_type="IA3")
    with pytest.raises(UnsupportedError, match="IA3 adapter; merge-lora merges LoRA adapters only"):
        ckptool.merge_lora(base, ia3, tmp_path / "x.safetensors")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    make_lora.tiny_model("gpt2").save_pretrained(wrong)
    with pytest.raises(UnsupportedError, match=r"q_proj\.weight.*which .*wrong has no key for"):
        ckptool.merge_lora(wrong, adapter, tmp_path / "x.safetensors")
    with pytest.raises(InputNotFoundError, match=r"no adapter_config\.json"):
        ckptool.merge_lora(base, base, tmp_path / "x.safetensors")
    with pytest.raises(UsageError, match="is the input"):
        ckptool.merge_lora(base / "model.safetensors", adapter, base / "model.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base", "dora", "ia3", "wrong"]


def test_cli(tmp_path: Path, run_cli: Any) -> None:
    base, adapter, ref = _case(tmp_path, "gpt2", "float16")
    r = run_cli("merge-lora", base, adapter, "-o", tmp_path / "merged")
    assert r.exit_code == 0, r.output
    assert "Merged 6 LoRA weights" in r.output and "Load it with:" in r.output
    assert _same_bits(safetensors_torch.load_file(tmp_path / "merged" / "model.safetensors"),
                      safetensors_torch.load_file(ref / "model.safetensors")) == []
    r = run_cli("merge-lora", base, tmp_path, "-o", tmp_path / "y.safetensors")
    assert r.exit_code != 0 and r.output.count("Error:") == 1
