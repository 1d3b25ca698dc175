"""The JSON text of ``ckptool inspect --json``'s tensor rows, written column by column.

:meth:`ckptool.ops.inspect.entry.CheckpointInfo.json_pieces` writes ``"tensors": [...]`` with :func:`rows_json`: the
same text ``json.dumps`` writes for a list of dicts (``ensure_ascii``, ``", "`` and ``": "`` separators), without
a dict per tensor (50,000 tensors in a big state_dict). Nothing here knows the fields of a tensor row: the caller
passes the field names and one list of values per field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from itertools import chain, islice, repeat
from json.encoder import encode_basestring_ascii
from typing import Any

__all__ = ["ROWS_PER_PIECE", "json_column", "rows_json"]

_BOOL_JSON = {True: "true", False: "false"}

#: rows per piece of :func:`rows_json` (:meth:`ckptool.ops.inspect.entry.CheckpointInfo.json_pieces`)
ROWS_PER_PIECE = 2000


def json_column(values: list[Any]) -> str | list[str]:
    """``json.dumps(v)`` of each of ``values`` (not empty), in order, or that text once when it is the same for
    all: a value at a time only for a column that is not all strings, ints, bools, lists of ints, or strings and
    None (what the fields of :class:`~ckptool.ops.inspect.entry.TensorInfo` hold)."""
    first = values[0]
    if type(first) is str:  # only a str equals a str, and encode_basestring_ascii takes nothing else
        if values.count(first) == len(values):
            return json.dumps(first)
        try:
            return list(map(encode_basestring_ascii, values))  # what json.dumps writes for a str (ensure_ascii)
        except TypeError:  # not only strings
            pass
    types = set(map(type, values))  # strings are done: one type here is int, bool, list or another
    if len(types) == 1:
        kind = types.pop()
        if kind is list and not set(map(type, chain.from_iterable(values))) <= {int}:
            kind = object  # not only ints (True, 1.0, "a", None, nodes...)
        if kind in (int, bool, list) and values.count(first) == len(values):  # one type: == is exact here
            return json.dumps(first)
        if kind is int:
            return list(map(int.__repr__, values))  # json.dumps's own rule for ints
        if kind is bool:
            return list(map(_BOOL_JSON.__getitem__, values))
        if kind is list:
            return list(map(list.__repr__, values))  # "[1, 2]": ints joined by ", ", as json.dumps writes them
    if types == {str, type(None)}:
        return [encode_basestring_ascii(v) if v is not None else "null" for v in values]
    return list(map(json.dumps, values))


def rows_json(names: Iterable[str], columns: Iterable[list[Any]], n: int) -> Iterator[str]:
    """The inside of a JSON list of ``n`` objects (``", ".join(json.dumps(row) for row in rows)``, each row's keys
    ``names`` in order, ``columns`` the values of each key, one list per name, ``n`` values each), in pieces of
    :data:`ROWS_PER_PIECE` rows: each column is encoded in one pass (:func:`json_column`), a column with one value
    for every row is written once into the row template, and the rows of a piece are joined in one call. Every
    value is encoded before this returns (an error is raised here, not while the pieces are read). ``n`` must not
    be 0.

    Raises:
        ValueError / TypeError: as ``json.dumps`` (a value JSON cannot hold).
    """
    pieces: list[Iterable[str]] = []  # a row, in order: constant text, then the texts of a varying field, ...
    text = "{"
    for i, (name, values) in enumerate(zip(names, columns, strict=True)):
        col = json_column(values)
        text += f'{", " if i else ""}{json.dumps(name)}: '
        if type(col) is str:  # one value in every row: part of the template
            text += col
            continue
        # the first constant text of a row starts it: ", " before it in every row but the first
        pieces += (repeat(text) if pieces else chain((text,), repeat(", " + text)), col)
        text = ""
    text += "}"
    if not pieces:  # every field the same in every row (one row, or copies of one)
        return (", ".join(repeat(text, min(ROWS_PER_PIECE, n - i))) if i == 0 else
                ", " + ", ".join(repeat(text, min(ROWS_PER_PIECE, n - i)))
                for i in range(0, n, ROWS_PER_PIECE))
    pieces.append(repeat(text))
    texts = chain.from_iterable(zip(*pieces))
    size = ROWS_PER_PIECE * len(pieces)
    return ("".join(islice(texts, size)) for _ in range(0, n, ROWS_PER_PIECE))
