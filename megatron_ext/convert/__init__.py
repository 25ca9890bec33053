"""HF Llama-3.1 <-> Megatron-Core checkpoint conversion (one mapping table, streamed I/O, logit check)."""

from megatron_ext.convert.hf_io import ROPE_PRESETS, ConvertError
from megatron_ext.convert.exporter import to_hf
from megatron_ext.convert.importer import to_megatron

__all__ = ["ROPE_PRESETS", "ConvertError", "to_hf", "to_megatron"]
