"""The writing side, beside :mod:`ckptool.readers`: which output formats exist and what each can hold
(:mod:`ckptool.writers.registry`), and the one output resolver every writing command asks
(:mod:`ckptool.writers.resolve`): file or folder, the format, the file a folder holds, and what would be replaced.

The rules are said once, in ``docs/outputs.md``. Layer: ``cli -> ops / torch_ops -> readers / writers -> model ->
formats``; nothing here imports torch or a higher layer.
"""

from __future__ import annotations

from ckptool.writers.registry import WRITERS, Writer, choose_format, known_suffixes, suffix_writer, writer
from ckptool.writers.resolve import Output, is_folder_form, refuse_replacing, resolve_output, set_members

__all__ = ["WRITERS", "Output", "Writer", "choose_format", "is_folder_form", "known_suffixes", "refuse_replacing",
           "resolve_output", "set_members", "suffix_writer", "writer"]
