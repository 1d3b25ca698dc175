"""Every ``Load it with:`` hint a writing command prints runs when pasted (issue 47), for real ``transformers``
models built from tiny configs (no hub download): GPT-2 (its ``lm_head.weight`` tied to ``transformer.wte.weight``
and left out by ``save_pretrained``) and Llama with an untied and a tied head; safetensors and torch outputs, file
and folder. After the hint runs, the model holds every tensor of the output, and a tied head is its embedding."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import transformers

import ckptool

LORA = Path(__file__).resolve().parents[1] / "fixtures" / "lora"


def _llama(folder: Path, tied: bool) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      tie_word_embeddings=tied)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def _model(folder: Path) -> Any:
    """A freshly initialised model of the class ``folder``'s config.json names (other weights than the output's)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(1)
    return getattr(transformers, config.architectures[0])(config)


def _outputs(tmp: Path, folder: Path) -> dict[str, list[str]]:
    weights = str(folder / "model.safetensors")
    return {
        "convert file safetensors": ["convert", str(folder), "-o", str(tmp / "c.safetensors")],
        "convert file torch": ["convert", str(folder), "-o", str(tmp / "c.pt")],
        "convert folder safetensors": ["convert", str(folder), "-o", f"{tmp / 'cdir'}/"],
        "convert folder torch": ["convert", str(folder), "-o", f"{tmp / 'cdir2'}/", "--format", "torch"],
        "average file safetensors": ["average", weights, weights, "-o", str(tmp / "a.safetensors")],
        "average file torch": ["average", weights, weights, "-o", str(tmp / "a.pt")],
    }


def _hint(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.startswith("Load it with: ")]
    assert len(lines) == 1, output
    return lines[0].removeprefix("Load it with: ")


def _check(code: str, folder: Path, written: dict[str, torch.Tensor]) -> None:
    names = {"torch": torch, "transformers": transformers, "safetensors": safetensors, "ckptool": ckptool}
    if code.startswith("transformers."):  # from_pretrained returns the model
        model = eval(code, names)
    elif not code.startswith(("model.", "safetensors.torch.load_model(model", "ckptool.load_into(model")):
        got = eval(code, names)  # the hint returns the state_dict itself
        assert {k for k, v in got.items() if torch.is_tensor(v)} == set(written)
        assert all(torch.equal(got[k], v) for k, v in written.items())
        return
    else:
        model = _model(folder)
        exec(code, {**names, "model": model})
    state = model.state_dict()
    for k, v in written.items():
        assert torch.equal(state[k], v), k
    if getattr(model.config, "tie_word_embeddings", False):
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def _written(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor the output at ``path`` holds (a file, or a folder's weights file)."""
    if path.is_dir():
        path = next(path / n for n in ("model.safetensors", "pytorch_model.bin") if (path / n).exists())
    if path.suffix == ".safetensors":
        return safetensors.torch.load_file(path)
    return {k: v for k, v in torch.load(path, weights_only=True).items() if torch.is_tensor(v)}


@pytest.mark.parametrize("kind", ["gpt2", "llama-untied", "llama-tied"])
def test_every_hint_runs(kind: str, tmp_path: Path, run_cli: Any) -> None:
    folder = tmp_path / kind
    if kind == "gpt2":
        shutil.copytree(LORA / "gpt2-tiny", folder)
    else:
        _llama(folder, tied=kind == "llama-tied")
    assert ("lm_head.weight" in safetensors.torch.load_file(folder / "model.safetensors")) == (kind == "llama-untied")
    cases = _outputs(tmp_path, folder)
    if kind == "gpt2":
        shutil.copytree(LORA / "gpt2-tiny-lora", tmp_path / "lora")
        for name, dst in (("merge-lora file safetensors", str(tmp_path / "m.safetensors")),
                          ("merge-lora file torch", str(tmp_path / "m.pt")),
                          ("merge-lora folder", f"{tmp_path / 'mdir'}/")):
            cases[name] = ["merge-lora", str(folder), str(tmp_path / "lora"), "-o", dst]
    for name, argv in cases.items():
        res = run_cli(*argv)
        assert res.exit_code == 0, (name, res.output)
        code = _hint(res.output)
        _check(code, folder, _written(Path(argv[argv.index("-o") + 1])))
        if kind != "llama-untied" and name.endswith("file torch") and not name.startswith("convert"):
            assert "strict=False" in code and "lm_head.weight is tied" in res.output, name
        if kind != "llama-untied" and name.endswith("file safetensors") and not name.startswith("convert"):
            assert code.startswith("safetensors.torch.load_model(model, "), name
    assert os.listdir(tmp_path / "mdir" if kind == "gpt2" else tmp_path / "cdir")
