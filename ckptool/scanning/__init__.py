"""The scan engine: every pickle, archive member, config and shipped module of a checkpoint read byte by byte and
rated safe / needs-trust / dangerous (:func:`ckptool.scanning.entry.scan_file`), nothing imported or run.

It is a reading layer, below :mod:`ckptool.torch_ops` and above :mod:`ckptool.readers`: the trusted loads of
``torch_ops`` (:mod:`ckptool.torch_ops.trusted`) refuse what it rates dangerous by calling it directly, and the
``scan`` / ``inspect`` operations (:mod:`ckptool.ops.scan`, :mod:`ckptool.ops.inspect`) build on it. It walks the
formats' bytes itself (the pickle opcodes, the zip directory, tar and 7z members), starting from the one classifier
(:mod:`ckptool.formats.detect`).
"""
