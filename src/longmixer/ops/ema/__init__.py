"""MD-EMA long convolution (MEGA, arXiv:2209.10655, section 2.2): kernel generation and FFT convolution, and the
causal scan."""

from longmixer.ops.ema.function import ema, ema_kernel, ema_scan
from longmixer.ops.ema.reference import ema_conv, ema_kernel_ref, ema_ref, ema_scan_ref

__all__ = ["ema", "ema_kernel", "ema_scan", "ema_ref", "ema_kernel_ref", "ema_conv", "ema_scan_ref"]
