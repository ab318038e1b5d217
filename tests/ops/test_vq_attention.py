"""Tests of the VQ attention op: references against each other, and the Triton kernels (search, attention forward
and backward) against the references under the interpreter."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from longmixer.ops.vq_attention import (vq_attention, vq_attention_quadratic_ref, vq_search, vq_search_ref,
                                        window_bias)
from tests.ops._helpers import assert_close


def make_inputs(B, L, E, H, S, C, dtype=torch.float64, seed=0, pad=7, bias=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, E, generator=g, dtype=dtype)
    k = torch.randn(B, L, E, generator=g, dtype=dtype)
    v = torch.randn(B, L, H, generator=g, dtype=dtype)
    cb = torch.randn(S, E, generator=g, dtype=dtype)
    table = 0.3 * torch.randn(4 * C - 1, generator=g, dtype=dtype)
    mask = torch.ones(B, L, dtype=torch.bool)
    if pad:
        mask[-1, L - pad:] = False
    codes = vq_search_ref(k.flatten(0, 1), cb)[0].view(B, L)
    return dict(q=q, k=k, v=v, cb=cb, table=table if bias else None, mask=mask, codes=codes)


def run(fn, inp, C, causal, attention, dtype, **kw):
    """Forward and gradients w.r.t. q, k (through the straight-through k_hat), v and the bias table."""
    leaves = {n: inp[n].to(dtype).requires_grad_(True) for n in ("q", "k", "v", "table") if inp[n] is not None}
    cb = inp["cb"].to(dtype)
    k_hat = leaves["k"] + (cb[inp["codes"]] - leaves["k"]).detach()
    bias = window_bias(leaves["table"], C) if "table" in leaves else None
    o = fn(leaves["q"], k_hat, leaves["v"], cb, inp["codes"], inp["mask"], bias, block_size=C, causal=causal,
           attention=attention, **kw)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(o, list(leaves.values()), do)
    return {"o": o, **{f"d{n}": g for n, g in zip(leaves, grads)}}


MODES = [pytest.param(c, a, id=f"{'causal' if c else 'bidir'}-{a}") for c in (False, True)
         for a in ("softmax", "laplace")]


@pytest.mark.parametrize("causal,attention", MODES)
@pytest.mark.parametrize("B,L,E,H,S,C", [pytest.param(2, 50, 8, 12, 10, 16, id="B2-L50-E8-H12-S10-C16"),
                                         pytest.param(1, 96, 6, 5, 33, 32, id="B1-L96-E6-H5-S33-C32")])
def test_blockwise_reference_equals_quadratic(B, L, E, H, S, C, causal, attention):
    """The linear-time path (window + codebook summary, one normalization) equals the [L, L] formulation."""
    inp = make_inputs(B, L, E, H, S, C)
    ref = run(vq_attention_quadratic_ref, inp, C, causal, attention, torch.float64)
    lin = run(vq_attention, inp, C, causal, attention, torch.float64, backend="torch")
    for name in ref:
        assert_close(name, ref[name], lin[name], atol=1e-10)


@pytest.mark.parametrize("attention", ["softmax", "laplace"])
def test_full_codebook_without_bias_is_dense_attention(attention):
    """With a codebook as large as the set of distinct keys and no local bias, VQ attention is exact attention."""
    B, L, E, H, S, C = 2, 64, 8, 6, 12, 16
    g = torch.Generator().manual_seed(3)
    cb = torch.randn(S, E, generator=g, dtype=torch.float64)
    codes = torch.randint(S, (B, L), generator=g)
    k = cb[codes]  # every key is a codeword
    q = torch.randn(B, L, E, generator=g, dtype=torch.float64)
    v = torch.randn(B, L, H, generator=g, dtype=torch.float64)
    found = vq_search(k.flatten(0, 1), cb, backend="torch")[0].view(B, L)
    assert torch.equal(found, codes)
    o = vq_attention(q, k, v, cb, found, block_size=C, attention=attention, backend="torch")
    scores = q @ k.transpose(1, 2)
    if attention == "softmax":
        dense = torch.softmax(scores, -1) @ v
    else:
        dense = 0.5 * (1 + torch.erf((scores - math.sqrt(0.5)) / (math.sqrt(0.25 / math.pi) * math.sqrt(2)))) @ v
    assert_close("o", dense, o, atol=1e-10)
    if attention == "softmax":
        assert_close("o_sdpa", F.scaled_dot_product_attention(q, k, v, scale=1.0), o, atol=1e-10)


def test_search_reference_equals_brute_force():
    g = torch.Generator().manual_seed(4)
    k, cb = torch.randn(70, 5, generator=g, dtype=torch.float64), torch.randn(9, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(70, generator=g) > 0.3
    codes, counts, sums = vq_search_ref(k, cb, mask)
    assert torch.equal(codes, torch.cdist(k, cb).argmin(-1))
    for s in range(9):
        sel = (codes == s) & mask
        assert counts[s].item() == sel.sum().item()
        assert_close(f"sums[{s}]", k[sel].sum(0), sums[s], atol=1e-12)


@pytest.mark.parametrize("N,E,S", [pytest.param(77, 12, 40, id="N77-E12-S40"),
                                   pytest.param(130, 16, 200, id="N130-E16-S200")])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_search_kernel_parity(N, E, S, masked):
    g = torch.Generator().manual_seed(5)
    k, cb = torch.randn(N, E, generator=g), torch.randn(S, E, generator=g)
    mask = (torch.rand(N, generator=g) > 0.25) if masked else None
    ref = vq_search_ref(k.double(), cb.double(), mask)
    got = vq_search(k, cb, mask, backend="triton")
    assert torch.equal(ref[0], got[0]), "codes"
    assert_close("counts", ref[1], got[1], atol=0.0)
    assert_close("sums", ref[2], got[2], atol=1e-5)


@pytest.mark.parametrize("C", [16, 64])
def test_window_bias_gradient_is_the_gather_gradient(C):
    """window_bias's diagonal-sum backward against autograd of the plain gather it replaces."""
    g = torch.Generator().manual_seed(2)
    table = torch.randn(4 * C - 1, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(C, 3 * C, generator=g, dtype=torch.float64)
    i, c = torch.arange(C), torch.arange(3 * C)
    plain = table[(c[None, :] - C - i[:, None]) + 2 * C - 1]
    ours = window_bias(table, C)
    assert torch.equal(plain, ours)
    expected, = torch.autograd.grad(plain, table, grad)
    got, = torch.autograd.grad(ours, table, grad)
    assert_close("dtable", expected, got, atol=1e-12)


@pytest.mark.parametrize("B,L,H,S,C", [pytest.param(2, 64, 12, 10, 16, id="4-slices"),
                                         pytest.param(3, 32, 70, 130, 16, id="1-slice")])
def test_code_value_sums_kernel(B, L, H, S, C):
    """The one-hot product kernel (whole-row statistics of bidirectional attention) against index_add, with padded
    keys and the row cut into slices whose partial sums are added."""
    from longmixer.ops.vq_attention.kernel import code_value_sums
    from longmixer.ops.vq_attention.reference import code_block_stats

    g = torch.Generator().manual_seed(3)
    v = torch.randn(B, L, H, generator=g)
    codes = torch.randint(0, S, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) > 0.2
    ref_n, ref_u = code_block_stats(codes, v.double(), mask, S, L)
    n, u = code_value_sums(v, codes, mask, S, C)
    assert n.shape == (B, 1, S) and u.shape == (B, 1, S, H)
    assert_close("counts", ref_n, n, atol=0.0)
    assert_close("sums", ref_u, u, atol=1e-5)


def test_code_value_prefix_kernel():
    """The causal caches (keys of blocks 0..b-2 per block, walked in one program per row) against the reference's
    per-block sums and shifted prefix, with padded keys."""
    from longmixer.ops.vq_attention.kernel import code_value_prefix
    from longmixer.ops.vq_attention.reference import code_block_stats, outside_window_stats

    g = torch.Generator().manual_seed(4)
    B, L, H, S, C = 2, 80, 20, 40, 16
    v = torch.randn(B, L, H, generator=g)
    codes = torch.randint(0, S, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) > 0.2
    ref_n, ref_u = outside_window_stats(*code_block_stats(codes, v.double(), mask, S, C), True)
    n, u = code_value_prefix(v, codes, mask, S, C)
    assert_close("counts", ref_n, n, atol=0.0)
    assert_close("sums", ref_u, u, atol=1e-5)


@pytest.mark.parametrize("causal,attention", MODES)
@pytest.mark.parametrize("B,L,E,H,S,C,bias", [
    pytest.param(2, 50, 8, 12, 10, 16, True, id="B2-L50-E8-H12-S10-C16-bias"),
    pytest.param(1, 40, 12, 70, 20, 16, False, id="B1-L40-E12-H70-S20-C16-nobias"),
])
def test_attention_kernel_parity(B, L, E, H, S, C, bias, causal, attention):
    """Triton forward and backward (float32) against the float64 reference, every output and gradient by name."""
    inp = make_inputs(B, L, E, H, S, C, bias=bias)
    ref = run(vq_attention, inp, C, causal, attention, torch.float64, backend="torch")
    tri = run(vq_attention, inp, C, causal, attention, torch.float32, backend="triton")
    for name in ref:
        assert_close(name, ref[name], tri[name], atol=1e-5, rtol=1e-5)


def test_padded_queries_are_zero_and_padded_keys_ignored():
    inp = make_inputs(2, 40, 8, 6, 10, 16, pad=9)
    o = run(vq_attention, inp, 16, False, "softmax", torch.float64, backend="torch")["o"]
    assert o[-1, -9:].abs().max() == 0
    changed = dict(inp, v=inp["v"].clone())
    changed["v"][-1, -9:] += 100.0
    o2 = run(vq_attention, changed, 16, False, "softmax", torch.float64, backend="torch")["o"]
    assert_close("o", o, o2, atol=1e-12)


@pytest.mark.parametrize("block_size", [0, 24, 8])
def test_bad_block_size_raises(block_size):
    inp = make_inputs(1, 32, 4, 4, 4, 16)
    with pytest.raises(ValueError, match="block_size"):
        vq_attention(inp["q"], inp["k"], inp["v"], inp["cb"], inp["codes"], block_size=block_size)
