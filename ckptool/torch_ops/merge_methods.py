"""The arithmetic of ``ckptool average --method``: mergekit's merge methods on one tensor at a time, with torch.

Transcribed from mergekit 0.1.5 (``mergekit/merge_methods/generalized_task_arithmetic.py``, ``sparsify.py``,
``slerp.py``; LGPL-3.0, https://github.com/arcee-ai/mergekit), operation for operation and in the inputs' dtype as
mergekit computes, so that outputs agree with ``mergekit-yaml`` (held by ``tests/test_merge_methods.py``):

- ``task-arithmetic`` (https://arxiv.org/abs/2212.04089): ``base + lambda * sum_i w_i (x_i - base)``;
- ``ties`` (https://arxiv.org/abs/2306.01708): each delta ``x_i - base`` keeps its ``density`` fraction of largest
  magnitudes (``sparsify.magnitude``: ``k = max(1, int(density * numel))``), is weighted, the sign of each element
  is elected by the sign of the weighted deltas' sum, and the deltas that agree are summed and divided by the sum
  of their weights (``normalize``);
- ``dare-ties`` / ``dare-linear`` (https://arxiv.org/abs/2311.03099): each delta keeps each element with
  probability ``density`` (``torch.bernoulli``, from a generator seeded with ``seed``: one draw per input per
  tensor, in order) and is rescaled to its L1 norm before masking; then TIES' sign election (``dare-ties``) or a
  plain weighted sum (``dare-linear``), not normalised;
- ``slerp``: spherical interpolation from the first input (``t = 0``) to the second (``t = 1``) over the whole
  tensor, flattened, in float32 (float64 for float64 inputs), linear where the normalised vectors are nearly
  collinear (``|dot| > 0.9995``).

Memory (issue 39): mergekit stacks the deltas in a new tensor and ranks each delta's magnitudes with ``argsort``
(8-byte indices and a sorted copy); here each delta is computed in the buffer its input was read into (``x -= base``,
the same subtraction), sparsified there, and the sign election, sums and the final ``base + mixed`` run on a slice
of :data:`CHUNK_ELEMENTS` elements at a time, written into the base's buffer: every one of those operations is
element by element (the sums are over the inputs, not along the tensor), so a slice gives the whole tensor's bits.
TIES' ``k`` largest magnitudes are found by a selection (numpy's ``partition``, in place on one float32 copy of the
magnitudes) instead of a sort: the kept set is then every element whose magnitude is at least the ``k``-th largest.
That is the set mergekit's ``argsort(descending=True)[:k]`` keeps unless magnitudes equal to the ``k``-th largest
also lie outside the top ``k`` (a tie across the cut). There mergekit keeps the tied elements its unstable sort puts
first, an order no rule describes (torch sorts float32 with x86-simd-sort's quicksort where the CPU has AVX2 or
AVX-512, else ``std::sort``), so the same sort is run on the same float32 magnitudes (``torch.sort`` in place:
argsort's kernel, without its copy of the values), and the same elements are kept. Ties across the cut are rare
in float32 (one tensor in twelve of the 256 MiB benchmark) but the rule in bfloat16 and float16 (nine or ten tensors
in ten, of 4,096 elements and more, measured), where the merge then needs that sort's memory as mergekit does. Zero
magnitudes tied across the cut need no sort: an element of magnitude zero is ``+-0`` whether kept (``x * 1``) or
not (``x * 0``).
DARE's mask is drawn into one buffer and applied in place. Peak: the base, one delta per input and one float32
magnitude (or mask) buffer, plus a few slices, and 16 bytes an element more while a tie is sorted (the int64
indices, and as much again inside torch's AVX2 sort); :func:`merge_elements` returns the base's buffer.

Integer and bool tensors are not merged here (the caller takes them from the base).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ckptool.errors import UnsupportedError
from ckptool.torch_ops.merge import tensor_of

if TYPE_CHECKING:
    import torch

__all__ = ["CHUNK_ELEMENTS", "METHODS", "magnitude_mask_", "merge_elements", "merge_tensor", "new_generator"]

#: the methods of ``average --method`` besides ``linear``
METHODS = ("task-arithmetic", "ties", "dare-ties", "dare-linear", "slerp")
_SLERP_CHUNK = 1024 * 1024
#: elements of each input combined at a time after sparsification (the sign election and the sums); the last slice
#: of a tensor takes the remainder, so no slice is shorter than this unless the tensor is
CHUNK_ELEMENTS = 1 << 20


def magnitude_mask_(delta: torch.Tensor, density: float, scratch: torch.Tensor | None = None) -> None:
    """mergekit ``sparsify.magnitude`` without rescaling, in place: ``delta`` (any shape, contiguous; float16,
    bfloat16, float32 or float64) keeps the elements mergekit keeps (its ``density`` fraction of largest magnitudes,
    ranked as float32, ``k = max(1, int(density * numel))``), the others become ``delta * 0`` (``+-0``) as mergekit's
    ``tensor * mask`` makes them. ``scratch``: a float32 buffer of at least ``delta.numel()`` elements to use (else
    one is allocated). See the module docstring for how the kept set equals mergekit's, ties at the cut included."""
    import torch

    n = delta.numel()
    if density >= 1:
        return
    flat = delta.view(-1)
    if density <= 0 or n == 0:
        flat.mul_(0)
        return
    k = max(1, int(density * n))
    if k == n:
        return
    w = torch.empty(n, dtype=torch.float32) if scratch is None else scratch[:n]
    w.copy_(flat).abs_()  # mergekit: tensor.abs().reshape(-1).float(); rounding commutes with abs
    part = w.numpy()
    part.partition(n - k)  # part[n - k:]: the k largest; part[n - k]: the k-th largest
    cut = float(part[n - k])
    zero_is_exact = delta.dtype != torch.float64  # float64 -> float32 may round a nonzero magnitude to 0
    clean = bool(part[:n - k].max() < cut)  # nothing outside the top k equals the cut (False for a NaN cut)
    w.copy_(flat).abs_()
    if clean or (cut == 0 and zero_is_exact):
        w.ge_(cut)
    else:  # mergekit's own ranking decides the tie: argsort(w, descending=True), sorting w in place
        order = torch.empty(n, dtype=torch.int64)
        torch.sort(w, descending=True, out=(w, order))
        w.zero_().index_fill_(0, order[:k], 1)
        del order
    flat.mul_(w)


def _bernoulli_(delta: torch.Tensor, density: float, generator: torch.Generator) -> None:
    """mergekit ``sparsify.bernoulli`` with L1 rescaling (``rescale``, DARE's default), in place on ``delta``."""
    import torch

    if density >= 1:
        return
    work = delta.dtype if delta.dtype == torch.bfloat16 else torch.float32
    x = delta if delta.dtype == work else delta.to(work)
    before = x.abs().sum()
    mask = torch.full_like(x, fill_value=density, dtype=work)
    torch.bernoulli(mask, generator=generator, out=mask)
    x.mul_(mask)  # mergekit: masked = tensor * mask
    del mask
    after = x.abs().sum()
    if not (before < 1e-7 or after < 1e-7):
        x.mul_(before / after)
    if x is not delta:
        delta.copy_(x)  # .to(tensor.dtype)


def _combine(deltas: torch.Tensor, w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """mergekit ``merge_group`` after sparsification, on ``deltas`` stacked ``(n, elements)`` (weighted here, in
    place) and the weights ``w`` ``(n, 1)``: the mixed delta and its divisor."""
    deltas.mul_(w)
    if method in ("ties", "dare-ties"):
        sign = deltas.sign().to(deltas.dtype)  # get_mask(method="sum", mask_dtype=base.dtype)
        majority = (deltas.sum(dim=0) >= 0).to(deltas.dtype) * 2 - 1
        mask = sign == majority
        del sign, majority
        mixed = (deltas * mask).sum(dim=0)
        divisor = (w * mask).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = deltas.sum(dim=0)
        divisor = w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    return mixed, divisor


def _chunks(n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` slices of :data:`CHUNK_ELEMENTS` over ``n`` elements, the remainder in the last."""
    out, i = [], 0
    while i < n:
        j = n if n - (i + CHUNK_ELEMENTS) < CHUNK_ELEMENTS else i + CHUNK_ELEMENTS
        out.append((i, j))
        i = j
    return out


def _task_arithmetic_(base: torch.Tensor, xs: Iterable[torch.Tensor], weights: list[float], method: str,
                      density: float, lam: float, generator: torch.Generator) -> None:
    """mergekit ``GeneralizedTaskArithmeticMerge.merge_group`` for ``method`` (see the module docstring), in place:
    each of ``xs`` becomes its delta, ``base`` the result (all contiguous, of one dtype and shape)."""
    import torch

    b = base.view(-1)
    deltas: list[torch.Tensor] = []
    scratch = torch.empty(b.numel() if method == "ties" else 0, dtype=torch.float32)
    for x in xs:
        d = x.view(-1)
        d.sub_(b)  # delta = x - base
        if method == "ties":
            magnitude_mask_(d, density, scratch)
        elif method.startswith("dare"):
            _bernoulli_(d, density, generator)
        deltas.append(d)
    del scratch
    w = torch.tensor(weights, dtype=b.dtype).unsqueeze(-1)
    for s, e in _chunks(b.numel()):
        mixed, divisor = _combine(torch.stack([d[s:e] for d in deltas]), w, method)
        if method == "ties":  # mergekit's default normalize: True for ties only
            mixed /= divisor
        if lam != 1:
            mixed *= lam
        b[s:e] = (b[s:e] + mixed).to(b.dtype)


def _slerp(t: float, v0: torch.Tensor, v1: torch.Tensor, dot_threshold: float = 0.9995,
           eps: float = 1e-8) -> torch.Tensor:
    """mergekit ``slerp.slerp`` for one tensor (one output row: the whole tensor flattened)."""
    import torch

    dtype = torch.float64 if v0.dtype == torch.float64 else torch.float32
    a, b = v0.reshape(1, -1), v1.reshape(1, -1)
    tt = torch.tensor([t], dtype=dtype).reshape(-1, 1)
    if not a.shape[1]:
        return ((1 - tt) * a + tt * b).reshape(v0.shape).to(v0.dtype)
    chunks = range(0, a.shape[1], _SLERP_CHUNK)
    parts = [(torch.linalg.vector_norm(a[:, s:s + _SLERP_CHUNK].to(dtype), dim=1, keepdim=True),
              torch.linalg.vector_norm(b[:, s:s + _SLERP_CHUNK].to(dtype), dim=1, keepdim=True)) for s in chunks]
    norm_a = torch.linalg.vector_norm(torch.stack([p[0] for p in parts]), dim=0)
    norm_b = torch.linalg.vector_norm(torch.stack([p[1] for p in parts]), dim=0)
    norm_a = torch.where(norm_a > eps, norm_a, 1)
    norm_b = torch.where(norm_b > eps, norm_b, 1)
    dots = [((a[:, s:s + _SLERP_CHUNK].to(dtype) / norm_a) * (b[:, s:s + _SLERP_CHUNK].to(dtype) / norm_b))
            .sum(dim=1, keepdim=True) for s in chunks]
    dot = torch.stack(dots).sum(dim=0).clamp(-1, 1)
    linear = dot.abs() > dot_threshold
    theta = torch.acos(torch.where(linear, 0, dot))
    sin_theta = torch.sin(theta)
    coef_a = torch.where(linear, 1 - tt, torch.sin((1 - tt) * theta) / sin_theta)
    coef_b = torch.where(linear, tt, torch.sin(tt * theta) / sin_theta)
    result = torch.empty_like(a)
    for s in chunks:
        result[:, s:s + _SLERP_CHUNK] = coef_a * a[:, s:s + _SLERP_CHUNK].to(dtype) + \
            coef_b * b[:, s:s + _SLERP_CHUNK].to(dtype)
    return result.reshape(v0.shape)


def merge_tensor(method: str, base: torch.Tensor | None, xs: list[torch.Tensor], weights: list[float], *,
                 density: float = 1.0, lam: float = 1.0, t: float = 0.5,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """One floating tensor merged by ``method`` (one of :data:`METHODS`; see the module docstring).

    ``base``: the base model's tensor (every method but ``slerp``, whose two inputs are ``xs``); ``xs``: the inputs'
    tensors (same shape and dtype as ``base``); ``weights``: one per input (not normalised); ``density``: the
    fraction kept (ties, DARE); ``lam``: mergekit's ``lambda``; ``t``: slerp's interpolation factor; ``generator``:
    DARE's random draws. Returns a new tensor of ``base``'s (slerp: the inputs') dtype and shape; the arguments are
    left as they were.
    """
    import torch

    with torch.no_grad():
        if method == "slerp":
            return _slerp(t, xs[0], xs[1])
        assert base is not None
        out = base.contiguous().clone()
        _task_arithmetic_(out, (x.contiguous().clone() for x in xs), weights, method, density, lam,
                          generator or torch.Generator())
        return out


def new_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (DARE's draws; mergekit's ``--random-seed`` seeds torch's default one)."""
    import torch

    return torch.Generator().manual_seed(seed)


def merge_elements(method: str, dtype: str, shape: tuple[int, ...], base: bytearray | None, xs: Iterable[bytearray],
                   weights: list[float], *, density: float, lam: float, t: float,
                   generator: torch.Generator) -> bytes | bytearray:
    """:func:`merge_tensor` on the row-major little-endian bytes of one tensor (``dtype``, ``shape``) in the base
    and in each input, read one input at a time from ``xs`` (each buffer becomes that input's delta); returns the
    merged tensor's bytes: ``base``'s own buffer, overwritten (slerp: a new one).

    Raises:
        UnsupportedError: every input element is finite but the merged tensor holds an inf or NaN."""
    import torch

    finite = [True]  # every input element finite so far

    def checked(bufs: Iterable[bytearray]) -> Iterable[torch.Tensor]:
        for x in bufs:
            xt = tensor_of(x, dtype, shape)
            finite[0] = finite[0] and bool(torch.isfinite(xt).all())
            yield xt

    with torch.no_grad():
        if method == "slerp":
            a, b = checked(xs)
            out = _slerp(t, a, b)
            _refuse_overflow(finite[0], out, dtype)
            return out.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert base is not None
        if not base:
            return base
        bt = tensor_of(base, dtype, shape)
        finite[0] = bool(torch.isfinite(bt).all())
        _task_arithmetic_(bt, checked(xs), weights, method, density, lam, generator)
        _refuse_overflow(finite[0], bt, dtype)
        return base


def _refuse_overflow(inputs_finite: bool, out: torch.Tensor, dtype: str) -> None:
    """Raises UnsupportedError: every input was finite but ``out`` holds an inf or NaN (the weights or the method
    overflowed ``dtype``)."""
    import torch

    if inputs_finite and not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).sum())
        raise UnsupportedError(f"the merge makes {bad} values inf or NaN in {dtype} from finite inputs (the weights "
                               "or the method overflow the dtype); nothing was written: give smaller --weights")
