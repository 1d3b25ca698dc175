"""The merges in bounded memory (issue 39): TIES' and DARE's arithmetic against mergekit's own functions (the ``k``
largest magnitudes found by selection, with mergekit's sort deciding ties across the cut; deltas combined a slice at
a time), and the C heap handed back after each merged tensor.

The references are mergekit 0.1.5's ``sparsify.magnitude`` and ``GeneralizedTaskArithmeticMerge.merge_group``
(``get_mask``), transcribed below operation for operation (LGPL-3.0, https://github.com/arcee-ai/mergekit); where
mergekit is installed (``$CKPTOOL_MERGEKIT``, the path of its ``mergekit-yaml``), its ``sparsify.magnitude`` itself
is also run, in its own virtual environment, on the same tensors. Everything is compared bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptool.torch_ops import merge_methods
from ckptool.torch_ops.merge import _malloc_trim
from ckptool.torch_ops.merge_methods import magnitude_mask_, merge_tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _mergekit_magnitude(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """mergekit 0.1.5 ``sparsify.magnitude`` (``rescale_norm=None``), as written there."""
    if density >= 1:
        return tensor
    if density <= 0 or tensor.numel() == 0:
        return torch.zeros_like(tensor)
    k = max(1, int(density * tensor.numel()))
    mask = torch.zeros(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    w = tensor.abs().reshape(-1)
    if w.device.type == "cpu":
        w = w.float()
    topk = torch.argsort(w, descending=True)[:k]
    mask[topk] = 1
    return tensor * mask.reshape_as(tensor)


def _mergekit_merge_group(base: torch.Tensor, xs: list[torch.Tensor], weights: list[float], method: str,
                          density: float, lam: float, generator: torch.Generator) -> torch.Tensor:
    """mergekit 0.1.5 ``GeneralizedTaskArithmeticMerge.merge_group`` with ``get_mask(method="sum")`` and
    ``sparsify.bernoulli`` (L1 rescale), as written there (the random draws from ``generator``)."""
    deltas = base.new_empty((len(xs), *base.shape))
    for index, x in enumerate(xs):
        delta = x - base
        if method == "ties":
            delta = _mergekit_magnitude(delta, density)
        elif method.startswith("dare") and density < 1:
            work = delta.dtype if delta.dtype == torch.bfloat16 else torch.float32
            mask = torch.bernoulli(torch.full_like(input=delta, fill_value=density, dtype=work), generator=generator)
            t = delta.to(work)
            masked = t * mask
            before, after = t.abs().sum(), masked.abs().sum()
            delta = (masked if before < 1e-7 or after < 1e-7 else masked * (before / after)).to(delta.dtype)
        deltas[index] = delta
    w = torch.tensor(weights, dtype=deltas.dtype)
    while deltas.dim() > w.dim():
        w.unsqueeze_(-1)
    deltas.mul_(w)
    if method in ("ties", "dare-ties"):
        sign = deltas.sign().to(base.dtype)
        majority = (deltas.sum(dim=0) >= 0).to(base.dtype) * 2 - 1
        mask = sign == majority
        mixed = (deltas * mask).sum(dim=0)
        divisor = (w * mask).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = deltas.sum(dim=0)
        divisor = w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if method == "ties":
        mixed /= divisor
    if lam != 1:
        mixed *= lam
    return (base + mixed).to(base.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _ours(t: torch.Tensor, density: float) -> torch.Tensor:
    out = t.clone()
    magnitude_mask_(out, density)
    return out


def _tied(dtype: torch.dtype, n: int = 5000, seed: int = 0) -> torch.Tensor:
    """Deltas drawn from a few magnitudes (0, 1/8, 1/4, 1/2, 1 with both signs and both zeros): the cut of any
    density falls inside a run of equal magnitudes."""
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor([0.0, -0.0, 0.125, -0.125, 0.25, -0.25, 0.5, -0.5, 1.0, -1.0], dtype=torch.float64)
    return values[torch.randint(0, len(values), (n,), generator=g)].to(dtype).reshape(50, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.05, 0.3, 0.5, 0.77, 0.999])
def test_magnitude_ties_across_the_cut_keep_mergekits_elements(dtype: torch.dtype, density: float) -> None:
    t = _tied(dtype)
    want = _mergekit_magnitude(t, density)
    assert torch.equal(_bits(_ours(t, density)), _bits(want))
    k = max(1, int(density * t.numel()))
    cut = t.abs().float().reshape(-1).sort(descending=True).values[k - 1]
    if cut > 0:  # every magnitude >= the cut would keep more than k: the tie rule is what this test holds
        assert int((t.abs() >= cut).sum()) > k


@pytest.mark.parametrize("dtype", DTYPES)
def test_magnitude_without_ties_and_at_zero(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    t = torch.randn(300, 7, generator=g, dtype=torch.float64).to(dtype)
    for density in (0.01, 0.5, 0.9):
        assert torch.equal(_bits(_ours(t, density)), _bits(_mergekit_magnitude(t, density)))
    z = t.clone()
    z[:200] = 0  # most of the delta zero (+0 and -0): the cut is 0, tied across it
    z[:100] *= -1
    assert torch.equal(_bits(_ours(z, 0.5)), _bits(_mergekit_magnitude(z, 0.5)))
    nan = t.clone().float().to(dtype) if dtype != torch.float64 else t.clone()
    nan[3, 2] = float("nan")
    assert torch.equal(_bits(_ours(nan, 0.4)), _bits(_mergekit_magnitude(nan, 0.4)))


def test_magnitude_float64_below_float32s_range_ties_at_zero() -> None:
    """mergekit ranks float64 magnitudes as float32: values below float32's range tie at 0 but are not 0."""
    g = torch.Generator().manual_seed(2)
    t = torch.randn(1000, generator=g, dtype=torch.float64) * 1e-50
    t[:10] = 1.0
    assert torch.equal(_bits(_ours(t, 0.5)), _bits(_mergekit_magnitude(t, 0.5)))


@pytest.mark.parametrize("method", ["task-arithmetic", "ties", "dare-ties", "dare-linear"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_methods_in_slices_equal_mergekits_merge_group(monkeypatch: pytest.MonkeyPatch, method: str,
                                                       dtype: torch.dtype) -> None:
    """Slices of 64 elements (tensors of 1,200: several slices, the last one longer) give mergekit's bits."""
    monkeypatch.setattr(merge_methods, "CHUNK_ELEMENTS", 64)
    g = torch.Generator().manual_seed(3)
    base = (torch.randn(40, 30, generator=g) * 0.02).to(dtype)
    xs = [(base.float() + torch.randn(40, 30, generator=g) * 0.01).to(dtype) for _ in range(3)]
    xs.append(base.clone())  # a delta of zeros
    xs[0][:5] = _tied(dtype, 150).reshape(5, 30) * 0.01 + base[:5]  # ties across the cut
    weights, density = [0.7, 0.4, -0.3, 1.0], 0.5
    for lam in (1.0, 0.8):
        want = _mergekit_merge_group(base, xs, weights, method, density, lam, torch.Generator().manual_seed(5))
        got = merge_tensor(method, base, xs, weights, density=density, lam=lam,
                           generator=torch.Generator().manual_seed(5))
        assert torch.equal(_bits(got), _bits(want)), (method, dtype, lam)


_MERGEKIT_MAGNITUDE = """
import sys, torch
from mergekit.sparsify import magnitude
cases = torch.load(sys.argv[1])
torch.save([magnitude(t, density=d) for t, d in cases], sys.argv[2])
"""


def test_magnitude_equals_mergekits_own_function(tmp_path: Path) -> None:
    """mergekit's ``sparsify.magnitude`` itself, run by the python beside ``$CKPTOOL_MERGEKIT``."""
    exe = os.environ.get("CKPTOOL_MERGEKIT") or shutil.which("mergekit-yaml") or ""
    py = os.path.join(os.path.dirname(exe), "python")
    if os.environ.get("CKPTOOL_MERGEKIT") and not os.path.exists(py):  # asked for, and missing: no skip
        pytest.fail(f"no python beside CKPTOOL_MERGEKIT={exe}")
    if not exe or not os.path.exists(py):
        pytest.skip("mergekit-yaml not found (set CKPTOOL_MERGEKIT to its path)")
    g = torch.Generator().manual_seed(4)
    cases = [(_tied(dt, seed=i), d) for i, dt in enumerate(DTYPES) for d in (0.3, 0.5)]
    cases += [((torch.randn(64, 64, generator=g) * 0.02).to(dt), 0.5) for dt in DTYPES]
    torch.save(cases, tmp_path / "in.pt")
    r = subprocess.run([py, "-c", _MERGEKIT_MAGNITUDE, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = torch.load(tmp_path / "out.pt")
    for (t, d), want in zip(cases, theirs, strict=True):
        assert torch.equal(_bits(_ours(t, d)), _bits(want)), (t.dtype, d)


_HEAP = """
import sys
from ckptool.torch_ops.merge import release_freed_memory
def anon():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon")) // 1024
big = bytearray(30 << 20)  # freed: glibc raises its mmap threshold to 30 MiB
del big
blocks = [bytearray(8 << 20) for _ in range(24)]  # 192 MiB from the heap now
for b in blocks:
    b[::4096] = b"x" * len(b[::4096])
keep = bytearray(64)  # allocated last: the freed blocks are not at the heap's top
held = anon()
del blocks
freed = anon()
release_freed_memory()
print(held, freed, anon())
"""


def test_release_freed_memory_returns_the_heap() -> None:
    """Blocks under glibc's raised mmap threshold stay in the process when freed, until the heap is trimmed."""
    if _malloc_trim() is None or not os.path.exists("/proc/self/status"):
        pytest.skip("no glibc malloc_trim here")
    out = subprocess.run([sys.executable, "-c", _HEAP], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    held, freed, trimmed = map(int, out.stdout.split())
    assert freed > held - 64  # free() kept most of the 192 MiB
    assert trimmed < freed - 128  # malloc_trim gave it back
