"""LongVQ's vector-quantized attention: nearest-codeword search with statistics, blockwise VQ attention."""

from longmixer.ops.vq_attention.function import vq_attention, vq_search
from longmixer.ops.vq_attention.reference import (vq_attention_quadratic_ref, vq_attention_ref, vq_search_ref,
                                                  window_bias)

__all__ = ["vq_attention", "vq_attention_quadratic_ref", "vq_attention_ref", "vq_search", "vq_search_ref",
           "window_bias"]
