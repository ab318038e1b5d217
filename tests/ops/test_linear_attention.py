"""Tiled linear attention (CHELA section 4.1): the chunked reference against the quadratic form and Q (K^T V), and
the Triton kernel (forward and every gradient) against the reference in float64, under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from longmixer.ops.linear_attention import linear_attention, linear_attention_ref
from longmixer.ops.linear_attention.function import linear_attention_triton
from longmixer.ops.linear_attention.reference import linear_attention_quadratic
from tests.ops._helpers import assert_close

TOL_FP32 = 2e-4  # kernel (float32, IEEE dots) vs float64 reference, relative to the reference's largest entry


def _inputs(B, L, H, K, V, gate, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, L, H, K, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(B, L, H, V, generator=gen, dtype=dtype)
    g = torch.randn(B, L, H, V, generator=gen, dtype=dtype) if gate else None
    return q, k, v, g


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("L,chunk", [(1, 16), (63, 16), (100, 32)], ids=["L1-C16", "L63-C16", "L100-C32"])
def test_chunked_reference_equals_quadratic_form(causal, L, chunk):
    q, k, v, g = _inputs(2, L, 3, 8, 12, gate=True)
    for normalize in (True, False):
        ref = linear_attention_ref(q, k, v, g, causal=causal, normalize=normalize, chunk_size=chunk)
        quad = linear_attention_quadratic(q, k, v, g, causal=causal, normalize=normalize)
        torch.testing.assert_close(ref, quad, rtol=1e-10, atol=1e-10)


def test_noncausal_equals_q_ktv():
    q, k, v, _ = _inputs(2, 37, 2, 8, 5, gate=False)
    out = linear_attention_ref(q, k, v, causal=False, scale=1.0, normalize=False)
    expected = torch.einsum("blhk,bhkv->blhv", q, torch.einsum("blhk,blhv->bhkv", k, v))  # CHELA eq. 2: Q (K^T V)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_causal_output_ignores_future():
    q, k, v, g = _inputs(1, 40, 2, 8, 8, gate=True)
    out = linear_attention_ref(q, k, v, g, causal=True, chunk_size=16)
    k2, v2 = k.clone(), v.clone()
    k2[:, 25:], v2[:, 25:] = torch.randn_like(k2[:, 25:]), torch.randn_like(v2[:, 25:])
    out2 = linear_attention_ref(q, k2, v2, g, causal=True, chunk_size=16)
    torch.testing.assert_close(out[:, :25], out2[:, :25], rtol=0, atol=0)
    assert not torch.allclose(out[:, 25:], out2[:, 25:])


CASES = [  # B, L, H, K, V, chunk, segments, gate, normalize
    pytest.param(2, 50, 2, 20, 24, 16, None, True, True, id="B2-L50-H2-K20-V24-C16-gate-norm"),
    pytest.param(1, 70, 1, 16, 16, 16, 3, True, True, id="B1-L70-H1-K16-V16-C16-seg3"),
    pytest.param(1, 64, 2, 32, 16, 16, 4, False, False, id="B1-L64-H2-K32-V16-C16-seg4-plain"),
    pytest.param(2, 33, 1, 12, 40, 32, 2, True, False, id="B2-L33-H1-K12-V40-C32-seg2-gate"),
    # K x V tile over 64 x 64: the q^T dp segment sums run in their own pass instead of inside the dq kernel
    pytest.param(1, 48, 1, 72, 40, 16, 3, True, True, id="B1-L48-H1-K72-V40-C16-seg3-wide"),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("B,L,H,K,V,chunk,segments,gate,normalize", CASES)
def test_kernel_parity_forward_backward(causal, B, L, H, K, V, chunk, segments, gate, normalize):
    ins = [t for t in _inputs(B, L, H, K, V, gate) if t is not None]
    ref_in = [t.clone().requires_grad_() for t in ins]
    ref = linear_attention_ref(*ref_in, causal=causal, normalize=normalize, chunk_size=chunk)
    do = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ref_in, do)
    tri_in = [t.float().requires_grad_() for t in ins]
    out = linear_attention(*tri_in, causal=causal, normalize=normalize, chunk_size=chunk, backend="triton",
                           num_segments=segments)
    assert out.dtype == torch.float32
    tri_grads = torch.autograd.grad(out, tri_in, do.float())
    assert_close("o", ref, out, rtol=TOL_FP32, min_scale=1.0)
    for name, r, t in zip(("dq", "dk", "dv", "dg"), ref_grads, tri_grads):
        assert_close(name, r, t, rtol=TOL_FP32, min_scale=1.0)


TILED = [  # B, L, H, K, V, chunk, tune, gate, normalize: column tiles narrower than the head, both sum paths
    pytest.param(1, 75, 2, 40, 24, 16, dict(block=16, segments=3), True, True, id="L75-K40-V24-BC16-seg3-gate-norm"),
    pytest.param(2, 40, 1, 24, 40, 16, dict(block=16, segments=2, fuse_sums=False), True, False,
                 id="L40-K24-V40-BC16-seg2-gate-unfused"),
    pytest.param(1, 96, 1, 32, 32, 32, dict(block=16, segments=2), False, False, id="L96-K32-V32-C32-BC16-seg2-plain"),
    pytest.param(1, 50, 2, 16, 48, 16, dict(block=32, segments=4, warps=2), False, True,
                 id="L50-K16-V48-BC32-seg4-norm"),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("B,L,H,K,V,chunk,tune,gate,normalize", TILED)
def test_kernel_tiles_parity(causal, B, L, H, K, V, chunk, tune, gate, normalize):
    """Column tiles, segment sums fused into the dq walk or in their own pass, forward-only without saving."""
    ins = [t for t in _inputs(B, L, H, K, V, gate, seed=1) if t is not None]
    ref_in = [t.clone().requires_grad_() for t in ins]
    ref = linear_attention_ref(*ref_in, causal=causal, normalize=normalize, chunk_size=chunk)
    do = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ref_in, do)
    tri_in = [t.float().requires_grad_() for t in ins]
    q, k, v = tri_in[:3]
    g = tri_in[3] if gate else None
    args = (causal, K ** -0.5, normalize, 1e-5, chunk, tune)
    out = linear_attention_triton(q, k, v, g, *args)
    tri_grads = torch.autograd.grad(out, tri_in, do.float())
    assert_close("o", ref, out, rtol=TOL_FP32, min_scale=1.0)
    for name, r, t in zip(("dq", "dk", "dv", "dg"), ref_grads, tri_grads):
        assert_close(name, r, t, rtol=TOL_FP32, min_scale=1.0)
    with torch.no_grad():
        assert_close("o (no grad)", ref, linear_attention_triton(q, k, v, g, *args), rtol=TOL_FP32, min_scale=1.0)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_kernel_segments_agree(causal):
    """Splitting the sequence across programs must not change the result (the prefix/suffix state hand-off)."""
    q, k, v, g = (t.float() for t in _inputs(1, 96, 1, 16, 16, gate=True))
    outs = [linear_attention(q, k, v, g, causal=causal, chunk_size=16, backend="triton", num_segments=s)
            for s in (1, 2, 6)]  # no input needs a gradient: the inference path, without an autograd node
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)
    ref = linear_attention_ref(q.double(), k.double(), v.double(), g.double(), causal=causal, chunk_size=16)
    assert_close("o", ref, outs[0], rtol=TOL_FP32, min_scale=1.0)


def test_split_policy():
    """Programs are added only where batch*heads leaves SMs idle: column tiles for short sequences, segments
    (>= 16 chunks each) for long ones; the H200 numbers behind it are in docs/benchmarks.md."""
    from longmixer.ops.linear_attention.kernel import _split

    assert _split(programs=128, n_chunks=1024, sms=132) == (64, 1)  # B8 H16 D64: already ~one program per SM
    assert _split(programs=64, n_chunks=64, sms=132) == (32, 1)  # B8 H8 D64 T4K
    assert _split(programs=64, n_chunks=256, sms=132) == (64, 2)  # B8 H8 D64 T16K
    assert _split(programs=16, n_chunks=64, sms=132) == (32, 1)
    assert _split(programs=16, n_chunks=1024, sms=132) == (64, 8)  # B1 H16 D64 T64K
    assert _split(programs=4, n_chunks=40, sms=132) == (32, 1)


def test_dispatch_torch_backend_is_reference():
    q, k, v, g = (t.float() for t in _inputs(1, 20, 1, 8, 8, gate=True))
    torch.testing.assert_close(linear_attention(q, k, v, g, causal=True, backend="torch"),
                               linear_attention_ref(q, k, v, g, causal=True))


@pytest.mark.parametrize("kwargs,match", [
    (dict(chunk_size=48), "chunk_size=48"),
    (dict(chunk_size=8), "chunk_size=8"),
])
def test_bad_chunk_size(kwargs, match):
    q, k, v, _ = _inputs(1, 8, 1, 4, 4, gate=False)
    with pytest.raises(ValueError, match=match):
        linear_attention(q, k, v, causal=True, backend="torch", **kwargs)


def test_triton_rejects_wide_heads_and_float64():
    q, k, v, _ = _inputs(1, 8, 1, 160, 16, gate=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="n_heads"):
        linear_attention(q, k, v, causal=True, backend="triton")
    q, k, v, _ = _inputs(1, 8, 1, 16, 16, gate=False)
    with pytest.raises(ValueError, match="float64"):
        linear_attention(q, k, v, causal=True, backend="triton")


def test_shape_errors():
    q, k, v, _ = _inputs(1, 8, 2, 4, 4, gate=False)
    with pytest.raises(ValueError, match="v must be"):
        linear_attention(q, k, v[:, :, :1], causal=True, backend="torch")
    with pytest.raises(ValueError, match="g must have"):
        linear_attention(q, k, v, v[..., :2], causal=True, backend="torch")
