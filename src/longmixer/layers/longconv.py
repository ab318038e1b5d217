"""Explicit long convolution by FFT (Fu et al. 2023, arXiv:2302.06646; CHELA eq. 7) and CHELA's short-long
convolution Z = K_long(SiLU(K_short(X))) with structural reparameterization (CHELA section 4.2, eq. 8,
arXiv:2406.08128)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from longmixer.utils.optim import set_optim_hparams


def fft_conv(u: Tensor, k: Tensor, *, bidirectional: bool) -> Tensor:
    """Depthwise convolution of u with a kernel as long as the sequence, by FFT (CHELA eq. 7).

    Args:
        u: [B, L, D] input.
        k: [D, L] causal kernel (y_i = sum_{j<=i} k[i-j] u_j), or [2, D, L] two-sided kernel when `bidirectional`:
            k[0] weighs offsets 0..L-1 into the past, k[1][m] the offset m+1 into the future.
        bidirectional: two-sided kernel.

    Returns:
        y: [B, L, D] in u's dtype (float32 math; float64 for float64 inputs).
    """
    L = u.shape[1]
    acc = torch.float64 if u.dtype == torch.float64 else torch.float32
    n = 2 * L  # no circular wrap for offsets in (-L, L)
    if bidirectional:
        # circular layout: past taps at 0..L-1, future tap m+1 at n-(m+1); index L stays zero
        k = torch.cat([k[0], k.new_zeros(k.shape[1], 1), k[1, :, :L - 1].flip(-1)], dim=-1)  # [D, 2L]
    k_f = torch.fft.rfft(k.to(acc), n=n)  # [D, L+1]
    u_f = torch.fft.rfft(u.to(acc).transpose(1, 2), n=n)  # [B, D, L+1]
    y = torch.fft.irfft(u_f * k_f, n=n)[..., :L]  # [B, D, L]
    return y.transpose(1, 2).to(u.dtype)


def fit_kernel(k: Tensor, length: int) -> Tensor:
    """Cut or zero-pad the last dim of a kernel to `length`; taps past the trained length are zero, so a model
    trained at L runs at longer L (length extrapolation, CHELA section 5.3)."""
    L_k = k.shape[-1]
    return k[..., :length] if L_k >= length else F.pad(k, (0, length - L_k))


class LongConv(nn.Module):
    """y = K * u + D u, one explicit kernel per channel (Fu et al. 2023; CHELA eq. 7).

    The Squash / Smooth regularizers of Fu et al. are left out: CHELA's claim is that the short kernels make them
    unnecessary (section 4.2). The kernel gets no weight decay (it is a signal, not a projection).

    Args:
        d_model: D.
        max_len: kernel length (the training sequence length).
        bidirectional: two-sided kernel (classification) instead of a causal one (language modeling).
        kernel_std: init std of the kernel taps (0.002 as the safari long-conv code; the skip D carries the signal
            at init).
    """

    def __init__(self, d_model: int, max_len: int, *, bidirectional: bool, kernel_std: float = 0.002):
        super().__init__()
        if max_len < 1:
            raise ValueError(f"LongConv max_len={max_len} must be >= 1; set it to ${{data.seq_len}}")
        self.bidirectional = bidirectional
        shape = (2, d_model, max_len) if bidirectional else (d_model, max_len)
        self.kernel = set_optim_hparams(nn.Parameter(torch.randn(shape) * kernel_std), weight_decay=0.0)
        self.skip = nn.Parameter(torch.randn(d_model))

    def forward(self, u: Tensor) -> Tensor:
        """u [B, L, D] -> [B, L, D]."""
        k = fit_kernel(self.kernel, u.shape[1])
        return fft_conv(u, k, bidirectional=self.bidirectional) + u * self.skip


def short_kernel_sizes(max_len: int) -> tuple[int, int]:
    """The two short kernels of CHELA section 4.2: size 3 and 2 log10(L) + 1 (log floored so the size is odd)."""
    return 3, 2 * int(math.floor(math.log10(max(max_len, 1)))) + 1


def _fuse_short(weights: list[Tensor], biases: list[Tensor], *, causal: bool) -> tuple[Tensor, Tensor]:
    """One depthwise kernel [D, 1, s_max] and bias [D] equal to the sum of the parallel short branches: each
    smaller kernel is zero-padded to the largest size (centred when two-sided, on the past side when causal)."""
    size = max(w.shape[-1] for w in weights)
    fused = weights[0].new_zeros(weights[0].shape[0], 1, size)
    for w in weights:
        gap = size - w.shape[-1]
        fused = fused + F.pad(w, (gap, 0) if causal else (gap // 2, gap // 2))
    return fused, sum(biases[1:], biases[0].clone())


class ShortLongConv(nn.Module):
    """Z = K_long(SiLU(K_short(X))) (CHELA eq. 8); K_short is two parallel depthwise kernels whose outputs add.

    `reparameterize()` fuses the short branches into one kernel (RepVGG-style structural reparameterization,
    Ding et al. 2022): both are linear in X, so pad the smaller kernel to the larger one's size (centred when
    two-sided, on the past side when causal) and add kernels and biases. The fused output equals the two-branch one.
    The tasks fuse at test / predict time (`SequenceTask.on_test_start`); checkpoints keep the trained two-branch
    form, and a fused module loads them by fusing on load.

    Args:
        d_model: D.
        max_len: the training sequence length; sets the second short kernel's size and, by default, the long
            kernel's length.
        causal: causal short and long kernels (language modeling) instead of centred / two-sided ones.
        kernel_len: taps of the long kernel per direction (None: max_len, a kernel as long as the sequence, CHELA
            section 2.2); offsets past it get no weight.
    """

    def __init__(self, d_model: int, max_len: int, *, causal: bool, kernel_len: int | None = None):
        super().__init__()
        if kernel_len is not None and kernel_len < 1:
            raise ValueError(f"model.mixer.kernel_len={kernel_len} must be >= 1, or null for the sequence length")
        self.causal = causal
        self.short_sizes = short_kernel_sizes(max_len)
        self.short_weights = nn.ParameterList(
            nn.Parameter(torch.empty(d_model, 1, s).uniform_(-s ** -0.5, s ** -0.5)) for s in self.short_sizes)
        self.short_biases = nn.ParameterList(nn.Parameter(torch.zeros(d_model)) for _ in self.short_sizes)
        self.long = LongConv(d_model, max_len if kernel_len is None else kernel_len, bidirectional=not causal)

    def _short(self, x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        """Depthwise conv with odd kernel w [D, 1, s]: centred, or causal (pad s-1 on the past side)."""
        s = w.shape[-1]
        pad = (s - 1, 0) if self.causal else ((s - 1) // 2, (s - 1) // 2)
        return F.conv1d(F.pad(x.transpose(1, 2), pad), w, b, groups=w.shape[0]).transpose(1, 2)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x [B, L, D], mask [B, L] bool (True = real) -> Z [B, L, D]. Padded positions are zeroed before each
        convolution, so they never reach real positions."""
        keep = None if mask is None else mask.unsqueeze(-1)
        if keep is not None:
            x = x.masked_fill(~keep, 0.0)
        h = sum(self._short(x, w, b) for w, b in zip(self.short_weights, self.short_biases))
        h = F.silu(h)  # CHELA eq. 8
        if keep is not None:
            h = h.masked_fill(~keep, 0.0)
        return self.long(h)

    @torch.inference_mode(False)  # the test loop calls it under inference mode: keep the new parameters ordinary
    @torch.no_grad()
    def reparameterize(self) -> None:
        """Fuse the short branches into one kernel (idempotent)."""
        if len(self.short_weights) == 1:
            return
        fused, bias = _fuse_short(list(self.short_weights), list(self.short_biases), causal=self.causal)
        self.short_weights = nn.ParameterList([nn.Parameter(fused)])
        self.short_biases = nn.ParameterList([nn.Parameter(bias)])
        self.short_sizes = (fused.shape[-1],)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A fused module accepts the trained two-branch state (what checkpoints hold) by fusing it on load."""
        names = [k for k in state_dict if k.startswith(prefix + "short_weights.")]
        if len(self.short_weights) == 1 and len(names) > 1:
            n = len(names)
            weights = [state_dict.pop(f"{prefix}short_weights.{i}") for i in range(n)]
            biases = [state_dict.pop(f"{prefix}short_biases.{i}") for i in range(n)]
            fused, bias = _fuse_short(weights, biases, causal=self.causal)
            state_dict[prefix + "short_weights.0"], state_dict[prefix + "short_biases.0"] = fused, bias
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
