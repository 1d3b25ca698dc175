"""``average --method``: mergekit's merge methods (task arithmetic, TIES, DARE, SLERP) streamed tensor by tensor.

The options are checked here (:func:`check_method`); :func:`spool_merged` computes each output tensor from the
inputs' (and the base's) tensors, one key at a time, into the scratch file ``ckptool.average`` then writes in the
output format. The arithmetic is :mod:`ckptool.torch_ops.merge_methods` (mergekit's definitions, transcribed).
Memory: one key's tensors of every input at a time (a method like TIES ranks a whole tensor's magnitudes, so it does
not work a chunk at a time as ``linear`` does), not the checkpoints: each input's tensor is read when its delta is
computed, into the buffer the delta then lives in, and the result is written into the base's buffer
(:mod:`ckptool.torch_ops.merge_methods`).
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass
from typing import BinaryIO

from ckptool.errors import UsageError
from ckptool.formats.dtypes import contiguous_stride, element_size
from ckptool.formats.tensors import Source, Storage, Tensor
from ckptool.ops.merge.lora import tensor_bytes
from ckptool.ops.rewrite.stream import ProgressFn
from ckptool.readers.data import FileRanges
from ckptool.torch_ops.merge import release_freed_memory
from ckptool.torch_ops.merge_methods import merge_elements, new_generator

__all__ = ["METHODS", "MethodOptions", "check_method", "spool_merged"]

#: every method of ``average --method``, ``linear`` (the weighted mean) first
METHODS = ("linear", "task-arithmetic", "ties", "dare-ties", "dare-linear", "slerp")
_FLOATING = ("float16", "bfloat16", "float32", "float64")


@dataclass
class MethodOptions:
    """A merge method and its parameters: ``method`` (one of :data:`METHODS`), ``density`` (ties, DARE: the
    fraction of each delta kept), ``t`` (slerp), ``seed`` (DARE's random draws), ``lam`` (mergekit's ``lambda``:
    the merged delta's scale)."""

    method: str = "linear"
    density: float = 1.0
    t: float = 0.5
    seed: int = 0
    lam: float = 1.0


#: the largest seed torch.Generator.manual_seed takes (an unsigned 64-bit integer)
MAX_SEED = (1 << 64) - 1


def check_method(method: str, n_inputs: int, has_base: bool, density: float | None, t: float | None,
                 seed: int | None, weights: list[float] | None) -> MethodOptions:
    """The :class:`MethodOptions` of ``average``'s arguments.

    Raises:
        UsageError: an unknown method; a base missing (task-arithmetic, ties, DARE) or given where unused
            (linear, slerp); slerp with other than two inputs; ``density`` outside ``(0, 1]`` or given to a method
            without one, ``t`` outside ``[0, 1]`` or not for slerp, ``seed`` not for DARE or outside
            ``[0, 2**64 - 1]``; a weight that is not a finite number, or weights whose sum overflows.
    """
    _check_inputs(method, n_inputs, has_base)
    if density is not None and (method not in ("ties", "dare-ties", "dare-linear") or not 0 < density <= 1):
        raise UsageError(f"--density {density}: the fraction of each difference kept, in (0, 1], for ties and DARE")
    if t is not None and (method != "slerp" or not 0 <= t <= 1):
        raise UsageError(f"--t {t}: slerp's interpolation factor, in [0, 1] (0 gives the first input)")
    _check_seed_and_weights(method, seed, weights)
    return MethodOptions(method, 1.0 if density is None else density, 0.5 if t is None else t,
                         0 if seed is None else seed)


def _check_seed_and_weights(method: str, seed: int | None, weights: list[float] | None) -> None:
    """Raises UsageError: ``seed`` not for DARE or outside ``[0, MAX_SEED]``; a weight that is not finite, weights
    for slerp, or weights whose sum overflows."""
    if seed is not None and not method.startswith("dare"):
        raise UsageError("--seed applies to dare-ties and dare-linear (their random draws)")
    if seed is not None and (isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
        raise UsageError(f"--seed {seed}: an integer from 0 to {MAX_SEED} (what torch.Generator.manual_seed takes)")
    if weights is not None and (method == "slerp" or any(not math.isfinite(w) for w in weights)):
        raise UsageError("--weights: one finite number per input (not for slerp: use --t)")
    if weights is not None and not math.isfinite(sum(abs(w) for w in weights)):
        raise UsageError(f"--weights {','.join(map(str, weights))}: their sum overflows a float64; give smaller "
                         "weights (only their ratios matter to a mean)")


def _check_inputs(method: str, n_inputs: int, has_base: bool) -> None:
    """Raises UsageError: an unknown method, a base missing or not used, slerp with other than two inputs."""
    if method not in METHODS:
        raise UsageError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    needs_base = method not in ("linear", "slerp")
    if needs_base and not has_base:
        raise UsageError(f"--method {method} merges the differences from a base model: give --base BASE")
    if has_base and not needs_base:
        raise UsageError(f"--base applies to task-arithmetic, ties and DARE; {method} does not use one")
    if method == "slerp" and n_inputs != 2:
        raise UsageError(f"slerp interpolates between two inputs, got {n_inputs}")


def spool_merged(ref: Source, inputs: list[Source], opts: MethodOptions, weights: list[float], ties: dict[str, str],
                 scratch: BinaryIO, scratch_path: str, progress: ProgressFn | None) -> tuple[list[Tensor], list[str]]:
    """Compute every output tensor into ``scratch``: the floating tensors of ``ref`` (the base, or the first input
    for slerp) merged with the same keys of ``inputs``, the others (integer, bool) copied from ``ref``; tensors in
    ``ties`` stay views of the tensor they are tied to. Returns the output tensors and the names copied."""
    by_name = [{t.name: t for t in s.tensors} for s in inputs]
    generator = new_generator(opts.seed)
    out: list[Tensor] = []
    made: dict[str, Storage] = {}
    copied: list[str] = []
    with FileRanges() as files:
        for i, t in enumerate(ref.tensors):
            if t.name in ties:
                st = made[ties[t.name]]
            else:
                own = tensor_bytes(t, files)
                data: bytes | bytearray = own
                if t.dtype in _FLOATING:
                    xs = (tensor_bytes(m[t.name], files) for m in by_name)  # read one at a time, as merged
                    slerp = opts.method == "slerp"  # between ref and the other input; the others: onto the base
                    data = merge_elements(opts.method, t.dtype, t.shape, None if slerp else own,
                                          itertools.chain([own], xs) if slerp else xs, weights,
                                          density=opts.density, lam=opts.lam, t=opts.t, generator=generator)
                else:
                    copied.append(t.name)
                offset = scratch.tell()
                scratch.write(data)
                st = made[t.name] = Storage(scratch_path, offset, len(data), t.dtype, "cpu", zlib.crc32(data))
                del data, own
                release_freed_memory(st.nbytes)
                if progress is not None:
                    progress(t.numel * element_size(t.dtype))
            out.append(Tensor(t.name, t.name, t.dtype, t.shape, contiguous_stride(t.shape), 0, st, t.requires_grad,
                              i))
    return out, copied
