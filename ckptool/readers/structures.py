"""The structures the readers parse, as the layers above name them (issue 46): ``ops``, ``torch_ops`` and ``cli``
take these types and constants from here, not from a format's own module, so that which module parses what stays
the readers' business. Each is read through :class:`ckptool.readers.Opened` (``dcp_metadata()``,
``safetensors_header()``, ``index()``, ``graph()``).

* a DCP folder: :class:`DcpMetadata`, :class:`DcpEntry`, :class:`DcpLayout`, :data:`METADATA_FILE`
  (:mod:`ckptool.formats.dcp`);
* safetensors: :class:`SafetensorsHeader`, the sharing record's key and decoder (:data:`SHARED_KEY`,
  :func:`decode_shared`), the tied names a header records (:func:`recorded_names`)
  (:mod:`ckptool.formats.safetensors`);
* sharded sets: :class:`ShardIndex`, :data:`SINGLE_FILES` (:mod:`ckptool.formats.sharded`);
* torch pickles: :class:`Checkpoint` (:mod:`ckptool.formats.torchfile`);
* a torch.export archive (:meth:`ckptool.readers.Opened.pt2`): :class:`Pt2Archive` and its tensor :class:`Payload`
  (:mod:`ckptool.formats.pt2`);
* zip members: :class:`ZipEntry`, :func:`data_offset`, :func:`read_member_head`, :data:`ENCRYPTED`
  (:mod:`ckptool.formats.zipdir`);
* tensor bytes: :func:`gather` (a strided view's bytes, :mod:`ckptool.formats.strided`), :func:`read_segments` and
  :class:`ConcatenatedFile` (a storage held in several byte ranges, :mod:`ckptool.formats.segments`).
"""

from __future__ import annotations

from ckptool.formats.dcp import METADATA_FILE, DcpEntry, DcpLayout, DcpMetadata
from ckptool.formats.pt2 import Payload, Pt2Archive
from ckptool.formats.safetensors import SHARED_KEY, SafetensorsHeader, decode_shared, recorded_names
from ckptool.formats.segments import ConcatenatedFile, read_segments
from ckptool.formats.sharded import SINGLE_FILES, ShardIndex
from ckptool.formats.strided import gather
from ckptool.formats.torchfile import Checkpoint
from ckptool.formats.zipdir import ENCRYPTED, ZipEntry, data_offset, read_member_head

__all__ = ["ENCRYPTED", "METADATA_FILE", "SHARED_KEY", "SINGLE_FILES", "Checkpoint", "ConcatenatedFile", "DcpEntry",
           "DcpLayout", "DcpMetadata", "Payload", "Pt2Archive", "SafetensorsHeader", "ShardIndex", "ZipEntry",
           "data_offset", "decode_shared", "gather", "read_member_head", "read_segments", "recorded_names"]
