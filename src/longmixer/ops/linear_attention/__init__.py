"""Tiled linear attention with output normalization and gate (CHELA section 4.1, arXiv:2406.08128)."""

from longmixer.ops.linear_attention.function import linear_attention
from longmixer.ops.linear_attention.reference import linear_attention_ref

__all__ = ["linear_attention", "linear_attention_ref"]
