"""Merging checkpoints into one: ``merge-lora`` (a PEFT LoRA adapter merged into its base, streamed, without PEFT:
:mod:`ckptool.ops.merge.lora`, the adapter read as data in :mod:`ckptool.ops.merge.adapter`)."""

from ckptool.ops.merge.lora import MergeLoraResult, merge_lora

__all__ = ["MergeLoraResult", "merge_lora"]
