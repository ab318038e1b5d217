"""Chunked (block-diagonal) attention with softmax, relu2 or laplace weights (MEGA-chunk, arXiv:2209.10655)."""

from longmixer.ops.local_attention.function import local_attention
from longmixer.ops.local_attention.reference import laplace, local_attention_ref, relu2

__all__ = ["local_attention", "local_attention_ref", "relu2", "laplace"]
