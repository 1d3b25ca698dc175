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
* torch pickles: :class:`Checkpoint` (:mod:`ckptool.formats.torchfile`).
"""

from __future__ import annotations

from ckptool.formats.dcp import METADATA_FILE, DcpEntry, DcpLayout, DcpMetadata
from ckptool.formats.safetensors import SHARED_KEY, SafetensorsHeader, decode_shared, recorded_names
from ckptool.formats.sharded import SINGLE_FILES, ShardIndex
from ckptool.formats.torchfile import Checkpoint

__all__ = ["METADATA_FILE", "SHARED_KEY", "SINGLE_FILES", "Checkpoint", "DcpEntry", "DcpLayout", "DcpMetadata",
           "SafetensorsHeader", "ShardIndex", "decode_shared", "recorded_names"]
