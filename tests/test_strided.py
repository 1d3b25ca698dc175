"""formats/strided.gather: the bytes of a strided view in row-major order, without torch, equal torch's
``as_strided(...).contiguous()``; and `convert` of a non-contiguous view to safetensors without torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptool.formats.strided import gather

torch = pytest.importorskip("torch")

CASES = [
    ((3, 4), (1, 3), 0),        # a transpose
    ((2, 3, 4), (12, 1, 3), 0),  # inner dims swapped
    ((4,), (3,), 2),            # every third element, offset 2
    ((2, 2), (0, 1), 1),        # expanded (stride 0)
    ((3, 1, 2), (1, 7, 3), 0),
    ((), (), 5),                # 0-d
    ((0, 3), (3, 1), 0),        # empty
    ((5, 2), (2, 1), 1),        # contiguous with an offset
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8, torch.complex128,
                                   torch.bool])
@pytest.mark.parametrize(("shape", "stride", "offset"), CASES)
def test_gather_equals_torch(dtype: object, shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> None:
    storage = (torch.arange(40) % 7).to(dtype)  # type: ignore[attr-defined]
    view = storage.as_strided(shape, stride, offset)
    raw = storage.numpy().tobytes()
    got = b"".join(gather(raw, storage.element_size(), offset, shape, stride, chunk=storage.element_size() * 3))
    assert got == view.contiguous().numpy().tobytes()


def test_non_contiguous_view_converts_to_safetensors_without_torch(generated: dict[str, Path], tmp_path: Path) -> None:
    """shared_cuda0.pt holds views of one storage; its safetensors output used to need torch for the gather."""
    from safetensors.torch import load_file
    from test_torch_free import _blocker, run_without_torch

    block = _blocker(tmp_path / "block")
    out = tmp_path / "shared.safetensors"
    res = run_without_torch(["convert", str(generated["shared_cuda0.pt"]), "-o", str(out)], block, tmp_path)
    assert res.returncode == 0, res.stderr
    got = load_file(out)
    ref = torch.load(generated["shared_cuda0.pt"], map_location="cpu", weights_only=True)
    for k, v in got.items():
        assert torch.equal(v, ref[k].contiguous()), k
