"""The byte-level encoders the writing commands use, as the writers layer offers them: the operations above
(``ops``, ``torch_ops``, ``cli``) write through this module, not through a format's own module (issue 46), so that
which format module encodes what stays the writers' business.

* pickles: :func:`dumps` (the pickler of node graphs, :mod:`ckptool.formats.pickler`) and :class:`PicklerError`;
* torch zip files: :class:`TorchZipWriter` (:mod:`ckptool.formats.torchzip`: ``torch.save``'s own layout);
* safetensors: :func:`encode_header`, :func:`rename_metadata`, the sharing record (:data:`SHARED_KEY`,
  :class:`SharedGroup`, :class:`SharedView`, :func:`encode_shared`) (:mod:`ckptool.formats.safetensors`);
* sharded sets: :func:`output_layout`, :class:`SetLayout`, :func:`encode_index`, :func:`files_named`,
  :data:`SET_FILE_SUFFIXES`, :data:`INDEX_SUFFIX` (:mod:`ckptool.formats.sharded`).
"""

from __future__ import annotations

from ckptool.formats.pickler import PicklerError, dumps
from ckptool.formats.safetensors import (
           SHARED_KEY,
           SharedGroup,
           SharedView,
           encode_header,
           encode_shared,
           rename_metadata,
)
from ckptool.formats.sharded import INDEX_SUFFIX, SET_FILE_SUFFIXES, SetLayout, encode_index, files_named, output_layout
from ckptool.formats.torchzip import TorchZipWriter

__all__ = ["INDEX_SUFFIX", "SET_FILE_SUFFIXES", "SHARED_KEY", "PicklerError", "SetLayout", "SharedGroup",
           "SharedView", "TorchZipWriter", "dumps", "encode_header", "encode_index", "encode_shared", "files_named",
           "output_layout", "rename_metadata"]
