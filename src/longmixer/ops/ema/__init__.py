"""MD-EMA long convolution (MEGA, arXiv:2209.10655, section 2.2): kernel generation, the chunked state-passing
convolution and the FFT convolution."""

from longmixer.ops.ema.function import ema, ema_fft, ema_kernel
from longmixer.ops.ema.reference import ema_conv, ema_kernel_ref, ema_ref, ema_scan_ref

__all__ = ["ema", "ema_fft", "ema_kernel", "ema_ref", "ema_kernel_ref", "ema_conv", "ema_scan_ref"]
