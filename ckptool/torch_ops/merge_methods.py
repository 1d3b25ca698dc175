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

Integer and bool tensors are not merged here (the caller takes them from the base).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptool.torch_ops.merge import tensor_of

if TYPE_CHECKING:
    import torch

__all__ = ["METHODS", "merge_elements", "merge_tensor", "new_generator"]

#: the methods of ``average --method`` besides ``linear``
METHODS = ("task-arithmetic", "ties", "dare-ties", "dare-linear", "slerp")
_SLERP_CHUNK = 1024 * 1024


def _magnitude(delta: torch.Tensor, density: float) -> torch.Tensor:
    """mergekit ``sparsify.magnitude`` without rescaling: the ``density`` fraction of largest magnitudes kept."""
    import torch

    if density >= 1:
        return delta
    if density <= 0 or delta.numel() == 0:
        return torch.zeros_like(delta)
    k = max(1, int(density * delta.numel()))
    mask = torch.zeros(delta.numel(), dtype=delta.dtype)
    w = delta.abs().reshape(-1).float()
    mask[torch.argsort(w, descending=True)[:k]] = 1
    return delta * mask.reshape_as(delta)


def _bernoulli(delta: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """mergekit ``sparsify.bernoulli`` with L1 rescaling (``rescale``, DARE's default)."""
    import torch

    if density >= 1:
        return delta
    work = delta.dtype if delta.dtype == torch.bfloat16 else torch.float32
    mask = torch.bernoulli(torch.full_like(delta, fill_value=density, dtype=work), generator=generator)
    x = delta.to(work)
    masked = x * mask
    before, after = x.abs().sum(), masked.abs().sum()
    if before < 1e-7 or after < 1e-7:
        return masked.to(delta.dtype)
    return (masked * (before / after)).to(delta.dtype)


def _task_arithmetic(base: torch.Tensor, xs: list[torch.Tensor], weights: list[float], method: str,
                     density: float, lam: float, generator: torch.Generator) -> torch.Tensor:
    """mergekit ``GeneralizedTaskArithmeticMerge.merge_group`` for ``method`` (see the module docstring)."""
    import torch

    deltas = base.new_empty((len(xs), *base.shape))
    for i, x in enumerate(xs):
        delta = x - base
        if method == "ties":
            delta = _magnitude(delta, density)
        elif method.startswith("dare"):
            delta = _bernoulli(delta, density, generator)
        deltas[i] = delta
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
    if method == "ties":  # mergekit's default normalize: True for ties only
        mixed /= divisor
    if lam != 1:
        mixed *= lam
    return (base + mixed).to(base.dtype)


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
    DARE's random draws. Returns a new tensor of ``base``'s (slerp: the inputs') dtype and shape.
    """
    import torch

    with torch.no_grad():
        if method == "slerp":
            return _slerp(t, xs[0], xs[1])
        assert base is not None
        return _task_arithmetic(base, xs, weights, method, density, lam, generator or torch.Generator())


def new_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (DARE's draws; mergekit's ``--random-seed`` seeds torch's default one)."""
    import torch

    return torch.Generator().manual_seed(seed)


def merge_elements(method: str, dtype: str, shape: tuple[int, ...], base: bytearray | None, xs: list[bytearray],
                   weights: list[float], *, density: float, lam: float, t: float,
                   generator: torch.Generator) -> bytes:
    """:func:`merge_tensor` on the row-major little-endian bytes of one tensor (``dtype``, ``shape``) in the base
    and in each input; returns the merged tensor's bytes."""
    import torch

    b = tensor_of(base, dtype, shape) if base is not None else None
    merged = merge_tensor(method, b, [tensor_of(x, dtype, shape) for x in xs], weights, density=density, lam=lam,
                          t=t, generator=generator)
    return merged.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

