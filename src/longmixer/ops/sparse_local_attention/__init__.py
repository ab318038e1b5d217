"""SeqBoat's compress -> local attention -> extract as one op (Triton) with its scatter-based torch reference."""

from longmixer.ops.sparse_local_attention.function import packed_index, sparse_local_attention
from longmixer.ops.sparse_local_attention.reference import (compress_ref, extract_ref, packing_capacity,
                                                             sparse_local_attention_ref)

__all__ = ["compress_ref", "extract_ref", "packed_index", "packing_capacity", "sparse_local_attention",
           "sparse_local_attention_ref"]
