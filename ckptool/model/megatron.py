"""Consolidating a Megatron legacy tree: tensor-parallel shards joined by layer type, pipeline stages renumbered.

A legacy ``model_optim_rng.pt`` holds each rank's shard of a tensor-parallel weight with no record of how it was
split: the split follows from the layer type (Megatron-Core ``ColumnParallelLinear`` splits its output dimension,
``RowParallelLinear`` its input dimension, ``VocabParallelEmbedding`` the vocabulary; layer norms are whole on every
rank). :data:`TP_RULES` is that knowledge as data, one table (``docs/megatron.md`` prints it): a name pattern
(``fnmatch``, ``*`` also crosses dots) and the rule, the first matching pattern winning:

* ``"0"`` / ``"1"`` (any digit): the shards are concatenated along that dimension, in tensor-parallel rank order;
* ``"glu"``: swiglu's fused ``linear_fc1`` (``--swiglu``): each rank holds its block of the gate half, then its
  block of the up half (``megatron.core.transformer.mlp.apply_swiglu_sharded_factory``), so the whole weight is
  every rank's gate block, then every rank's up block; a rule ``"0"`` becomes ``"glu"`` for ``*linear_fc1.*`` and
  ``*dense_h_to_4h.*`` when the checkpoint's ``args.swiglu`` is true;
* ``"none"``: replicated, rank 0's copy is taken (the others must have its shape).

Rules given by the user (``--tp-dim PATTERN=DIM``, :data:`USER_RULES`) come first. A tensor no rule covers is
refused by name (with tensor parallelism; with one rank nothing is joined). Pipeline stages number their layers
from 0 (``TransformerBlock`` / ``ParallelTransformer``); :func:`consolidate` renumbers every ``layers.N`` (per
prefix: ``decoder.layers``, ``language_model.encoder.layers``...) by the layers of the stages before it, in the
order Megatron runs them (virtual pipeline chunk ``model{v}`` of every stage before chunk ``v+1``), and every
``local_experts.N`` by the expert-parallel rank. Joining is byte work: a dimension-0 join lists each shard's bytes
in turn, a dimension-``d`` join each shard's block of every outer index in turn (:class:`~ckptool.formats.tensors.
Segment` ranges, read as one stream by :mod:`ckptool.formats.segments`), so nothing is read here.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

from ckptool.errors import UnsupportedError, UsageError
from ckptool.formats.dtypes import DTYPE_SIZES, contiguous_stride, numel
from ckptool.formats.tensors import Segment, Storage, Tensor, is_contiguous

__all__ = ["TP_RULES", "USER_RULES", "Consolidated", "ModelPart", "consolidate", "parse_tp_dims", "tp_rule"]

#: (pattern, rule, why): Megatron's tensor-parallel layouts, first match wins (module docstring)
TP_RULES: tuple[tuple[str, str, str], ...] = (
    ("*.layer_norm_weight", "none", "Transformer Engine's layer norm fused into linear_qkv / linear_fc1"),
    ("*.layer_norm_bias", "none", "Transformer Engine's layer norm fused into linear_qkv / linear_fc1"),
    ("*norm.weight", "none", "layer norms (input_layernorm, final_layernorm, q_layernorm, ...)"),
    ("*norm.bias", "none", "layer norms"),
    ("*.linear_qkv.weight", "0", "ColumnParallelLinear: fused QKV, heads split over ranks"),
    ("*.linear_qkv.bias", "0", "ColumnParallelLinear"),
    ("*.query_key_value.weight", "0", "ColumnParallelLinear (legacy Megatron-LM names)"),
    ("*.query_key_value.bias", "0", "ColumnParallelLinear (legacy Megatron-LM names)"),
    ("*.linear_q.weight", "0", "ColumnParallelLinear (cross attention)"),
    ("*.linear_kv.weight", "0", "ColumnParallelLinear (cross attention)"),
    ("*.linear_fc1.weight", "0", "ColumnParallelLinear (glu with --swiglu)"),
    ("*.linear_fc1.bias", "0", "ColumnParallelLinear (glu with --swiglu)"),
    ("*.dense_h_to_4h.weight", "0", "ColumnParallelLinear (legacy names; glu with --swiglu)"),
    ("*.dense_h_to_4h.bias", "0", "ColumnParallelLinear (legacy names; glu with --swiglu)"),
    ("*.linear_proj.weight", "1", "RowParallelLinear: attention output"),
    ("*.linear_fc2.weight", "1", "RowParallelLinear: MLP output"),
    ("*.dense_4h_to_h.weight", "1", "RowParallelLinear (legacy names)"),
    ("*.dense.weight", "1", "RowParallelLinear (legacy attention output self_attention.dense)"),
    ("*.linear_proj.bias", "none", "RowParallelLinear's bias is added after the reduction: whole on every rank"),
    ("*.linear_fc2.bias", "none", "RowParallelLinear's bias"),
    ("*.dense_4h_to_h.bias", "none", "RowParallelLinear's bias (legacy names)"),
    ("*.dense.bias", "none", "RowParallelLinear's bias (legacy names)"),
    ("*word_embeddings.weight", "0", "VocabParallelEmbedding: the vocabulary split over ranks"),
    ("*word_embeddings_for_head.weight", "0", "the last stage's copy of the embedding (legacy names)"),
    ("*output_layer.weight", "0", "ColumnParallelLinear: the output layer, vocabulary split"),
    ("*position_embeddings.weight", "none", "learned absolute position embeddings"),
    ("*tokentype_embeddings.weight", "none", "token type embeddings"),
    ("*.router.weight", "none", "the MoE router (TopKRouter): whole on every rank"),
)
_GLU = ("*linear_fc1.*", "*dense_h_to_4h.*")
#: rules given by the caller (``--tp-dim PATTERN=DIM``, :func:`parse_tp_dims`), ahead of :data:`TP_RULES`
USER_RULES: ContextVar[tuple[tuple[str, str], ...]] = ContextVar("megatron_tp_rules", default=())
_LAYER = re.compile(r"(^|\.)(layers|local_experts)\.(\d+)(?=\.)")


def parse_tp_dims(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``PATTERN=DIM`` options as ``(pattern, rule)`` pairs (DIM: a dimension, ``glu`` or ``none``).

    Raises:
        UsageError: an item without ``=`` or a DIM that is none of those.
    """
    out = []
    for item in items:
        pattern, eq, dim = item.rpartition("=")
        if not eq or not pattern or not ((dim.isascii() and dim.isdigit()) or dim in ("glu", "none")):
            raise UsageError(f"--tp-dim {item!r}: give PATTERN=DIM, DIM a dimension (0, 1, ...), glu or none "
                             "(replicated), e.g. --tp-dim '*.my_proj.weight=1'")
        out.append((pattern, dim))
    return tuple(out)


def tp_rule(name: str, swiglu: bool = False, user: Sequence[tuple[str, str]] = ()) -> str | None:
    """The rule for ``name`` (module docstring): the first of ``user`` then :data:`TP_RULES` whose pattern
    matches; None when none does."""
    for pattern, rule in user:
        if fnmatch.fnmatchcase(name, pattern):
            return rule
    for pattern, rule, _why in TP_RULES:
        if fnmatch.fnmatchcase(name, pattern):
            if rule == "0" and swiglu and any(fnmatch.fnmatchcase(name, g) for g in _GLU):
                return "glu"
            return rule
    return None


@dataclass
class ModelPart:
    """The model tensors of one model-parallel piece: pipeline rank ``pp``, virtual chunk ``v``, expert rank ``ep``,
    one list of tensors (local names, file order) per tensor-parallel rank, in rank order."""

    pp: int
    v: int
    ep: int
    shards: list[list[Tensor]]


@dataclass
class Consolidated:
    """What :func:`consolidate` gives: the tensors (global names, Megatron's order), ``notes`` for people."""

    tensors: list[Tensor]
    notes: list[str] = field(default_factory=list)


def _counts(tensors: Sequence[Tensor], kind: str, names: dict[str, int]) -> None:
    """For each prefix of a ``layers.N`` / ``local_experts.N`` (``kind``) component: the number of indices."""
    for t in tensors:
        for m in _LAYER.finditer(t.name):
            if m.group(2) == kind:
                prefix = t.name[:m.start(2)]
                names[prefix] = max(names.get(prefix, 0), int(m.group(3)) + 1)


def _renumber(name: str, layer_offsets: dict[str, int], expert_offsets: dict[str, int]) -> str:
    def sub(m: re.Match[str]) -> str:
        prefix = name[:m.start(2)]
        base = (layer_offsets if m.group(2) == "layers" else expert_offsets).get(prefix, 0)
        return f"{m.group(1)}{m.group(2)}.{int(m.group(3)) + base}"
    return _LAYER.sub(sub, name)


def _base(t: Tensor, where: str) -> Segment:
    """The segment of a shard's whole contiguous data.

    Raises:
        UnsupportedError: a shard that is not contiguous in its storage.
    """
    es = DTYPE_SIZES[t.dtype]
    if not is_contiguous(t.shape, t.stride):
        raise UnsupportedError(f"{where}: the shard {t.src_name!r} is saved as a non-contiguous view; ckptool joins "
                               "contiguous shards only (Megatron saves them contiguous)")
    st = t.storage
    swap = st.segments[0].swap if st.segments else 0
    return Segment(st.path, st.offset + t.offset * es, numel(t.shape) * es, swap=swap)


def _check_shapes(name: str, shards: Sequence[Tensor], rule: str, where: str) -> int:
    """The dimension ``rule`` joins ``shards`` along (-1: replicated), checked against their dtypes and shapes.

    Raises:
        UnsupportedError: dtypes that differ, shapes that do not fit the rule (naming ``--tp-dim``).
    """
    first = shards[0]
    shapes = [s.shape for s in shards]
    route = f"; if the rule is wrong for this model, give one with --tp-dim '{name}=DIM'"
    if any(s.dtype != first.dtype for s in shards):
        raise UnsupportedError(f"{where}: the shards of {name!r} have different dtypes {[s.dtype for s in shards]}")
    if rule == "none":
        if any(s != first.shape for s in shapes):
            raise UnsupportedError(f"{where}: {name!r} is taken as replicated, but its shards' shapes differ "
                                   f"({[list(s) for s in shapes]}){route}")
        return -1
    dim, rank = 0 if rule == "glu" else int(rule), len(first.shape)
    rest = first.shape[:dim] + first.shape[dim + 1:]
    fits = dim < rank and all(len(s) == rank and s[:dim] + s[dim + 1:] == rest for s in shapes)
    if not fits or (rule == "glu" and any(s[0] % 2 for s in shapes)):
        raise UnsupportedError(f"{where}: {name!r} cannot be joined along dimension {dim} ({rule}): its shards' "
                               f"shapes are {[list(s) for s in shapes]}{route}")
    return dim


def _segments(bases: Sequence[Segment], shapes: Sequence[tuple[int, ...]], dim: int, glu: bool,
              es: int) -> list[Segment]:
    """The byte ranges of the joined tensor, in order: for ``glu`` every shard's first half then every shard's
    second half; else, for each index of the dimensions before ``dim``, each shard's block in rank order."""
    segs: list[Segment] = []
    if glu:
        for half in (0, 1):
            segs += [b._replace(offset=b.offset + half * (b.nbytes // 2), nbytes=b.nbytes // 2) for b in bases]
        return segs
    blocks = [numel(s[dim:]) * es for s in shapes]
    for o in range(numel(shapes[0][:dim])):
        segs += [b._replace(offset=b.offset + o * n, nbytes=n) for b, n in zip(bases, blocks)]
    return [s for s in segs if s.nbytes]


#: the most byte ranges a join may take (one per outer index and shard of a dimension-``d`` join): a 16384-row
#: layer over 64 ranks takes about 10^6; a checkpoint claiming millions of rows of one element is refused rather
#: than listed (each range costs about 100 bytes of memory)
MAX_JOIN_PIECES = 1 << 22


def join(name: str, shards: Sequence[Tensor], rule: str, where: str) -> Tensor:
    """One tensor ``name`` from its tensor-parallel ``shards`` (rank order) by ``rule`` (module docstring): a
    replicated tensor is rank 0's as it is; a joined one a contiguous tensor over the shards' byte ranges
    (``segments``).

    Raises:
        UnsupportedError: shards whose dtypes differ, or whose shapes do not fit the rule (each names the tensor
            and the ``--tp-dim`` route); a shard that is not contiguous; a join of more than
            :data:`MAX_JOIN_PIECES` byte ranges.
    """
    first = shards[0]
    dim = _check_shapes(name, shards, rule, where)
    if dim < 0:
        return Tensor(name, first.src_name, first.dtype, first.shape, first.stride, first.offset, first.storage,
                      first.requires_grad)
    es = DTYPE_SIZES[first.dtype]
    shapes = [s.shape for s in shards]
    pieces = 2 * len(shards) if rule == "glu" else numel(first.shape[:dim]) * len(shards)
    if pieces > MAX_JOIN_PIECES:
        raise UnsupportedError(f"{where}: joining {name!r} along dimension {dim} takes {pieces} byte ranges (its "
                               f"shards {list(first.shape)} x {len(shards)}: one per row and shard), more than "
                               f"{MAX_JOIN_PIECES}; refused before anything is allocated (a Megatron layer has far "
                               "fewer rows): check the rank files, or give --tp-dim for it")
    segs = _segments([_base(s, where) for s in shards], shapes, dim, rule == "glu", es)
    shape = list(first.shape)
    shape[dim] = sum(s[dim] for s in shapes)
    st = Storage(segs[0].path if segs else first.storage.path, segs[0].offset if segs else 0, numel(shape) * es,
                 first.dtype, first.storage.location, segments=segs)
    return Tensor(name, first.src_name, first.dtype, tuple(shape), contiguous_stride(shape), 0, st)


def _check_ranks(c: ModelPart, where: str) -> None:
    """Raise UnsupportedError when the tensor-parallel ranks of ``c`` do not hold the same names."""
    names = [t.name for t in c.shards[0]]
    for i, shards in enumerate(c.shards[1:], 1):
        if [t.name for t in shards] != names:
            odd = sorted(set(names) ^ {t.name for t in shards}) or ["(the same names in another order)"]
            raise UnsupportedError(f"{where}: tensor-parallel rank {i} of stage {c.pp} holds other tensors than "
                                   f"rank 0 ({', '.join(odd[:5])}); the checkpoint is incomplete or mixed")


def consolidate(chunks: Sequence[ModelPart], where: str, swiglu: bool = False) -> Consolidated:
    """The whole model from its ``chunks`` (any order): layers renumbered, expert indices offset, shards joined
    (module docstring); a name met again in a later stage (a tied copy) keeps its first occurrence (noted).

    Raises:
        UnsupportedError: a tensor no rule covers (named, with ``--tp-dim``), ranks missing a tensor, shards that
            do not fit their rule (:func:`join`).
    """
    user = USER_RULES.get()
    order = sorted(chunks, key=lambda c: (c.v, c.pp, c.ep))
    offsets: dict[tuple[int, int], dict[str, int]] = {}
    experts: dict[tuple[int, int], dict[str, int]] = {}
    running: dict[str, int] = {}
    for c in order:  # layer offsets per (chunk, stage), in run order; experts per stage are the same on every rank
        if (c.pp, c.v) not in offsets:
            offsets[(c.pp, c.v)] = dict(running)
            _counts(c.shards[0], "local_experts", experts.setdefault((c.pp, c.v), {}))
            counts: dict[str, int] = {}
            _counts(c.shards[0], "layers", counts)
            for prefix, n in counts.items():
                running[prefix] = running.get(prefix, 0) + n
    out: list[Tensor] = []
    seen: dict[str, tuple[int, int]] = {}
    notes: list[str] = []
    uncovered: list[str] = []
    for c in order:
        _check_ranks(c, where)
        exp_base = {k: c.ep * n for k, n in experts[(c.pp, c.v)].items()}
        for j, t0 in enumerate(c.shards[0]):
            name = _renumber(t0.name, offsets[(c.pp, c.v)], exp_base)
            if name in seen:
                if seen[name] != (c.pp, c.v):
                    notes.append(f"{name} is also held by pipeline stage {c.pp} (a tied copy): the first kept")
                continue
            seen[name] = (c.pp, c.v)
            shards = [s[j] for s in c.shards]
            rule = tp_rule(name, swiglu, user) if len(shards) > 1 else "none"
            if rule is None:
                uncovered.append(name)
                continue
            t = join(name, shards, rule, where)
            t.src_name, t.index = f"{t0.src_name} (stage {c.pp}, {len(shards)} rank(s))", len(out)
            out.append(t)
    if uncovered:
        raise UnsupportedError(
            f"{where}: no tensor-parallel rule covers {', '.join(uncovered[:6])}"
            f"{' and more' if len(uncovered) > 6 else ''} ({len(uncovered)} tensor(s)): how their shards join depends "
            "on the layer type; give it with --tp-dim PATTERN=DIM (DIM the dimension they are split along, glu, or "
            "none when every rank holds the whole tensor; see docs/megatron.md)")
    return Consolidated(out, notes)
