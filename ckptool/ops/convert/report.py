"""What ``convert`` did (:class:`ConvertResult`) and, in sentences for people, the lines ``ckptool convert`` prints
around its ``Wrote`` line (:func:`convert_text`, also ``str(result)``).

The input's facts come from the registry (:data:`ckptool.readers.FORMATS`, by ``ConvertResult.format_in``): a
DeepSpeed folder's consolidated state_dict (``tagged``), the one flat mapping of a safetensors file or a sharded set
(not ``keyed``), how ``--key`` names another state_dict (``key_form``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptool.model.casts import CastCount
from ckptool.model.units import human_bytes, wrote_line
from ckptool.ops.convert.source import OutputFormat
from ckptool.readers import FORMATS, Format

_LIST = 8  # names listed before "and N more"
_LEFT_OUT = 20  # entries not carried listed before "... and N more"


@dataclass
class ConvertResult:
    """What :func:`ckptool.ops.convert.convert` did.

    ``format_in`` is the input's registry name (:data:`ckptool.readers.FORMATS`: ``torch-zip``,
    ``sharded-safetensors``, ``dcp``...), ``format_out`` an :class:`OutputFormat`'s value (``torch``,
    ``safetensors``, ``dcp``).
    ``dst`` is the file written (the ``*.index.json`` of a named shard set), or the folder for a shard folder and
    DCP output; ``files`` lists every file written (shards, then the index). ``key`` is the dotted path of the
    state_dict converted (``""``: top level; None for safetensors, sharded and whole-object conversions).
    ``tensors`` counts the tensors of the output (aliases included), ``stored`` those whose bytes were written,
    ``bytes_written`` the output size in bytes. ``left_out`` describes the other entries of the source that were not
    carried (``"optimizer_state: optimizer state (12 tensors)"``); ``skipped`` the non-tensor entries of the
    selected state_dict, which safetensors cannot hold. ``aliases`` maps each tensor stored as a view of another to
    that tensor; ``made_contiguous`` lists tensors stored contiguous although their layout was not;
    ``trimmed_bytes`` counts storage bytes that no tensor reached (``torch.save`` of a slice keeps its whole
    storage). ``cast`` counts ``"float32->float16": tensors``; ``cast_values`` is the cast report, tensor name ->
    what the cast did to its values (:class:`~ckptool.model.casts.CastCount`: overflows, underflows, NaNs, largest
    errors; a storage shared by several tensors under its first tensor's name) and ``cast_total`` their sum.
    ``renamed`` counts renamed keys. ``verified`` is True
    after a passing verification (``checked``: what was compared with what, the sentence after ``Verified:``),
    None with ``verify=False``. """

    src: str
    dst: str
    format_in: str
    format_out: str
    key: str | None = None
    tensors: int = 0
    stored: int = 0
    bytes_written: int = 0
    files: list[str] = field(default_factory=list)
    shards: int = 1
    left_out: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    made_contiguous: list[str] = field(default_factory=list)
    trimmed_bytes: int = 0
    cast: dict[str, int] = field(default_factory=dict)
    cast_values: dict[str, CastCount] = field(default_factory=dict)
    cast_total: CastCount | None = None
    renamed: int = 0
    notes: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # model-folder files copied beside a set (ops.rewrite.companions)
    verified: bool | None = None
    checked: str = "the output re-opens with the names, shapes, dtypes and values of the source"

    @property
    def load_path(self) -> str:
        """The one path that opens the output: the DCP folder, the index of several shards, else the file written
        (the single file of a shard folder whose tensors fit one shard, not the folder ``dst``)."""
        if OutputFormat(self.format_out).folder or not self.files:
            return self.dst
        return self.files[-1]

    def __str__(self) -> str:
        """The text ``ckptool convert`` prints (:func:`convert_text`)."""
        return convert_text(self)


def _names(items: list[str]) -> str:
    more = f" and {len(items) - _LIST} more" if len(items) > _LIST else ""
    return ", ".join(items[:_LIST]) + more


def _entries(n: int) -> str:
    return f"entr{'y' if n == 1 else 'ies'}"


def _input_format(res: ConvertResult) -> Format:
    """The registry entry of ``res.format_in`` (a plain keyed file for a name the registry does not hold)."""
    return FORMATS.get(res.format_in) or Format(res.format_in, res.format_in, "file", keyed=True)


def selection(res: ConvertResult) -> str:
    """What was converted: ``state_dict 'model'``, ``the top-level state_dict``, a DeepSpeed folder's consolidated
    state_dict, ``the tensors`` of a flat mapping, else ``the whole checkpoint``."""
    spec = _input_format(res)
    if res.key:
        return f"state_dict {res.key!r}"
    if res.key == "":
        return "the top-level state_dict"
    if spec.selected:
        return spec.selected
    if not spec.keyed:
        return "the tensors"
    return "the whole checkpoint"


def _left_out_lines(res: ConvertResult) -> list[str]:
    """The entries of the input not carried, with the ``--key`` that converts another (where one can: a format
    holding several mappings, :attr:`ckptool.readers.Format.keyed`)."""
    spec = _input_format(res)
    n = len(res.left_out)
    how = "" if not spec.keyed else f" (pass --key {spec.key_form} to convert another state_dict)"
    lines = [f"Not carried: {n} other {_entries(n)} of the file{how}:"]
    lines += [f"  {line}" for line in res.left_out[:_LEFT_OUT]]
    if n > _LEFT_OUT:
        lines.append(f"  ... and {n - _LEFT_OUT} more")
    return lines


def _layout_lines(res: ConvertResult) -> list[str]:
    """Aliases, layouts made contiguous, storage bytes left out, casts, renamed keys."""
    lines = []
    if res.aliases:
        pairs = [f"{a} -> {k}" for a, k in res.aliases.items()]
        lines.append(f"Shared storage: {len(res.aliases)} tensor(s) stored once, as views of another (recorded in "
                     f"__metadata__; ckptool restores them): {_names(pairs)}")
    if res.made_contiguous:
        lines.append(f"Stored contiguous (their layout was not): {_names(res.made_contiguous)}")
    if res.trimmed_bytes:
        lines.append(f"Storage bytes no tensor reaches were not carried: {human_bytes(res.trimmed_bytes)}")
    if res.cast:
        lines.append("Cast: " + ", ".join(f"{k} ({n})" for k, n in sorted(res.cast.items())))
    lines += cast_report_lines(res)
    if res.renamed:
        lines.append(f"Renamed {res.renamed} key(s)")
    return lines


def convert_lines(res: ConvertResult) -> list[str]:
    """The report of ``res`` before its ``Wrote`` line: what was converted, what was left out or not stored, the
    layout changes (:func:`_layout_lines`), the notes."""
    lines = [f"Converted {selection(res)} of {res.src} ({res.format_in}) to {res.format_out}."]
    if res.left_out:
        lines += _left_out_lines(res)
    if res.skipped:
        lines.append(f"Not stored: {len(res.skipped)} non-tensor {_entries(len(res.skipped))} of the state_dict: "
                     f"{_names(res.skipped)}")
    lines += _layout_lines(res)
    if res.kept:
        lines.append(f"kept: {', '.join(res.kept)}")
    lines += [f"Note: {note}" for note in res.notes]
    return lines


def written_detail(res: ConvertResult) -> str:
    """What the output holds, for the ``Wrote DST (SIZE, DETAIL)`` line: ``12 tensors`` / ``3 of 4 tensors stored``,
    and the shard count of a set."""
    shards = f", {res.shards} shards + index" if res.shards > 1 else ""
    stored = f"{res.stored} of {res.tensors} tensors stored" if res.stored != res.tensors else f"{res.tensors} tensors"
    return stored + shards


def convert_text(res: ConvertResult) -> str:
    """Everything ``ckptool convert`` prints for ``res`` before its load hint: :func:`convert_lines`, the
    ``Wrote DST (SIZE, DETAIL)`` line (:func:`written_detail`), :func:`verification_line`."""
    lines = [*convert_lines(res), wrote_line(res.dst, res.bytes_written, written_detail(res)), verification_line(res)]
    return "\n".join(line for line in lines if line)


def verification_line(res: ConvertResult) -> str:
    """``Verified: ...`` (what was compared with what), ``Not verified (--no-verify)``, or ``""`` (neither)."""
    if res.verified:
        return f"Verified: {res.checked}"
    if res.verified is None:
        return "Not verified (--no-verify)"
    return ""


def _count_words(c: CastCount) -> str:
    """``overflow to +-inf 2, underflow to 0 5, NaN in 1 / out 1, max abs error 0.0039, max rel error 0.00049``."""
    made = f", finite to NaN {c.nan_made}" if c.nan_made else ""
    return (f"overflow to +-inf {c.overflow}, underflow to 0 {c.underflow}{made}, NaN in {c.nan_in} / out "
            f"{c.nan_out}, max abs error {c.max_abs_error:.3g}, max rel error {c.max_rel_error:.3g}")


def cast_report_lines(res: ConvertResult) -> list[str]:
    """The cast report: the totals over every value cast, then each tensor whose values overflowed, underflowed or
    became NaN (the first :data:`_LIST`, then how many more)."""
    total = res.cast_total
    if total is None:
        return []
    lines = [f"Cast report ({total.elements} values): {_count_words(total)}"]
    hit = [(n, c) for n, c in res.cast_values.items() if c.overflow or c.underflow or c.nan_made]
    lines += [f"  {n} ({c.src}->{c.dst}): {_count_words(c)}" for n, c in hit[:_LIST]]
    if len(hit) > _LIST:
        lines.append(f"  ... and {len(hit) - _LIST} more tensor(s) with overflow or underflow")
    return lines
