"""LaS attention (Local and Smooth; Zimerman & Wolf, arXiv:2311.16620, eq. 3): decayed, smoothed causal attention."""

from longmixer.ops.las_attention.function import las_attention
from longmixer.ops.las_attention.reference import las_attention_ref, las_attention_separable_ref, smooth_values

__all__ = ["las_attention", "las_attention_ref", "las_attention_separable_ref", "smooth_values"]
