"""The mixed-dtype rule of the attention kernels (`ops/precision.py`)."""

import torch

from longmixer.ops.precision import work_dtype


def test_a_16_bit_input_sets_the_kernel_dtype():
    """Regression: under bf16 autocast LongVQ and SeqBoat passed float32 q/k with bf16 v, and the kernels ran
    their score dots in exact float32 (no tensor cores): LongVQ's three VQ attention kernels took 47 ms of a
    Text-4K B8 step on an H100, under 4.5 ms in bf16."""
    f32, bf16 = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)
    assert work_dtype(bf16, f32, f32) == torch.bfloat16
    assert work_dtype(f32, None, torch.zeros(1, dtype=torch.float16)) == torch.float16
    assert work_dtype(f32, f32) == torch.float32  # all-float32 keeps exact dots (the float64 parity tests)
    assert work_dtype(torch.zeros(1, dtype=torch.float64), f32) == torch.float64
