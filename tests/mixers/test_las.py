"""LaS mixer (arXiv:2311.16620) beyond the shared contract: the alpha grid, the variants of Table 3, the
classification variant's look-ahead and the backends."""

from __future__ import annotations

import math

import pytest
import torch

from longmixer.mixers.las import LaS, las_alphas
from longmixer.mixers.transformer import Transformer
from longmixer.ops.las_attention import las_attention_ref

D, HEADS = 32, 4

VARIANTS = {
    "las": dict(pool_size=3),
    "las-chunk": dict(pool_size=5, chunk_size=8),
    "l-attention": dict(smooth=False, chunk_size=8),
    "s-attention": dict(pool_size=3, position_bias=None, chunk_size=8),
    "alibi": dict(smooth=False, position_bias="alibi", chunk_size=8),
    "smooth-alibi": dict(pool_size=3, position_bias="alibi", chunk_size=8),
}


def _mixer(seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"n_heads": HEADS, "alpha_max": 0.3, "backend": "torch", **kwargs}
    return LaS(D, **kwargs).double()


def _x(B=2, L=21, seed=1):
    return torch.randn(B, L, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_alpha_grid():
    """alpha_0 = 0, exp(-alpha_c) evenly spaced down to 1 - B (section 4.1), no trainable parameters added."""
    a = torch.tensor(las_alphas(8, 0.001), dtype=torch.float64)
    assert a[0] == 0 and torch.all(a[1:] > a[:-1])
    torch.testing.assert_close(torch.exp(-a), torch.linspace(1, 1 - 0.001, 8, dtype=torch.float64))
    m = LaS(64, 8, alpha_max=0.001)
    assert sum(p.numel() for p in m.parameters()) == 4 * 64 * 64 + 4 * 64  # the projections only
    with pytest.raises(ValueError, match="alpha_max=1.5"):
        las_alphas(8, 1.5)


def test_classification_variant_reads_ahead_by_half_the_window():
    """causal=False reproduces eq. 3 as written: with P = 5, row i depends on x up to i + 2, and no further."""
    m = _mixer(pool_size=5)
    x = _x(B=1, L=12).requires_grad_()
    (g,) = torch.autograd.grad(m(x)[0][0, 4].sum(), x)
    assert g[0, 6].abs().max() > 0 and g[0, 7:].abs().max() == 0


def test_chunk_equal_to_length_is_full_attention():
    x = _x(L=16)
    full = _mixer(pool_size=3)
    chunked = _mixer(pool_size=3, chunk_size=16)
    torch.testing.assert_close(chunked(x)[0], full(x)[0], rtol=0, atol=0)


def test_chunks_are_independent_windows():
    """LaS-chunk with C = 8 on L = 20 equals full LaS run on each chunk separately (the last one ragged)."""
    x = _x(L=20)
    chunked = _mixer(pool_size=5, chunk_size=8)
    full = _mixer(pool_size=5)
    expected = torch.cat([full(x[:, s:s + 8])[0] for s in range(0, 20, 8)], 1)
    torch.testing.assert_close(chunked(x)[0], expected)


def test_no_decay_no_smoothing_is_the_causal_transformer():
    las = _mixer(smooth=False, position_bias=None)
    tr = Transformer(D, HEADS, causal=True).double()
    tr.load_state_dict(las.state_dict())
    x = _x()
    torch.testing.assert_close(las(x)[0], tr(x)[0])


def test_eld_heads_match_the_op():
    """The mixer's attention is las_attention_ref on its own projections with alpha = las_alphas(H, B)."""
    m = _mixer(pool_size=3)
    x = _x(B=1, L=10)
    q, k, v = m.qkv(x).view(1, 10, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
    alpha = torch.tensor(las_alphas(HEADS, 0.3), dtype=torch.float64)
    y = las_attention_ref(q, k, v, alpha, pool_size=3).transpose(1, 2).reshape(1, 10, D)
    torch.testing.assert_close(m(x)[0], m.out(y))


def test_alibi_is_eq1():
    """cT+ALiBi: softmax((QK^T - m_c D_L) / sqrt(d_k)) V with slopes 2^(-8c/H) (LaS eq. 1)."""
    m = _mixer(smooth=False, position_bias="alibi")
    x = _x(B=1, L=9)
    q, k, v = m.qkv(x).view(1, 9, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
    Kh = D // HEADS
    i = torch.arange(9)
    dist = (i[:, None] - i[None, :]).double()
    slopes = torch.tensor([2.0 ** (-8 * c / HEADS) for c in range(1, HEADS + 1)], dtype=torch.float64)
    s = (q @ k.transpose(-1, -2) - slopes[:, None, None] * dist) / math.sqrt(Kh)
    a = torch.softmax(s.masked_fill(dist < 0, -math.inf), -1)
    torch.testing.assert_close(m(x)[0], m.out((a @ v).transpose(1, 2).reshape(1, 9, D)))


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("variant", ["las", "las-chunk"])
def test_triton_backend_equals_torch(variant):
    x = _x(B=1, L=24).float()
    torch_m = _mixer(**VARIANTS[variant]).float()
    triton_m = _mixer(**{**VARIANTS[variant], "backend": "triton"}).float()
    torch.testing.assert_close(triton_m(x)[0], torch_m(x)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(pool_size=2), "pool_size=2"),
    (dict(position_bias="rope"), "position_bias='rope'"),
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(n_heads=5), "divisible"),
], ids=["even-P", "unknown-bias", "zero-chunk", "heads"])
def test_errors_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LaS(D, **kwargs)


def test_bf16_autocast_runs():
    m = LaS(D, HEADS, backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = m(_x().float())
    assert torch.isfinite(y).all()

