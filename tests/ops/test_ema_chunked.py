"""ops/ema chunked: the state-passing Triton kernels that `ema` runs for untruncated kernels (under TRITON_INTERPRET=1
on CPU), against the float64 loop reference `ema_scan_ref` (the recurrence itself) and the official FFT reference
`ema_ref`, forward and every gradient, causal and bidirectional."""

import copy

import pytest
import torch

from longmixer.layers.ema import MultiHeadEMA
from longmixer.ops.ema import ema, ema_ref, ema_scan_ref
from tests.ops._helpers import rel_error


def _inputs(B, L, D, N, dtype=torch.float64, seed=0, bidirectional=False):
    g = torch.Generator().manual_seed(seed)
    Dk = 2 * D if bidirectional else D
    x = torch.randn(B, L, D, generator=g, dtype=dtype)
    coef_in = torch.randn(Dk, N, generator=g, dtype=dtype)
    decay = torch.rand(Dk, N, generator=g, dtype=dtype) * 0.98 + 0.01
    coef_out = torch.randn(Dk, N, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (x, coef_in, decay, coef_out)]



def _run(fn, tensors, seed=1):
    y = fn()
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y.dtype)
    return (y,) + torch.autograd.grad(y, tensors, dy)


NAMES = ("y", "dx", "dcoef_in", "ddecay", "dcoef_out")


def test_loop_reference_equals_official_fft_reference():
    tensors = _inputs(2, 23, 3, 4)
    loop, fft = _run(lambda: ema_scan_ref(*tensors), tensors), _run(lambda: ema_ref(*tensors), tensors)
    for name, a, b in zip(NAMES, loop, fft):
        assert rel_error(a, b) < 1e-12, name


# ragged L around the 64-step chunk and the 1024-step block (the carried state), D not a power of two,
# N = 16, 5 and 1 (padded to the 16 rows a dot needs), B = 1 and 3
@pytest.mark.parametrize("B,L,D,N", [pytest.param(1, 37, 5, 16, id="B1-L37-D5-N16"),
                                     pytest.param(3, 70, 3, 5, id="B3-L70-D3-N5"),
                                     pytest.param(1, 1100, 2, 16, id="B1-L1100-D2-N16"),
                                     pytest.param(3, 64, 1, 1, id="B3-L64-D1-N1")])
def test_causal_parity_against_the_recurrence(B, L, D, N):
    tensors = _inputs(B, L, D, N, seed=L)
    ref = _run(lambda: ema_scan_ref(*tensors), tensors)
    tri = _run(lambda: ema(*tensors, backend="triton"), tensors)
    assert all(t.dtype == torch.float64 for t in tri)
    for name, a, b in zip(NAMES, tri, ref):
        assert rel_error(a, b) < 1e-5, name


@pytest.mark.parametrize("B,L,D,N", [pytest.param(2, 45, 3, 16, id="B2-L45-D3-N16"),
                                     pytest.param(1, 1030, 2, 3, id="B1-L1030-D2-N3")])
def test_bidirectional_parity_against_the_official_fft(B, L, D, N):
    tensors = _inputs(B, L, D, N, seed=L, bidirectional=True)
    ref = _run(lambda: ema_ref(*tensors, bidirectional=True), tensors)
    tri = _run(lambda: ema(*tensors, bidirectional=True, backend="triton"), tensors)
    for name, a, b in zip(NAMES, tri, ref):
        assert rel_error(a, b) < 1e-5, name


def test_float32_inputs_and_torch_backend():
    tensors64 = _inputs(2, 50, 7, 16, seed=3)
    tensors32 = [t.detach().float().requires_grad_() for t in tensors64]
    ref = _run(lambda: ema_scan_ref(*tensors64), tensors64)
    tri = _run(lambda: ema(*tensors32, backend="triton"), tensors32)
    tor = _run(lambda: ema(*tensors32, backend="torch"), tensors32)
    for name, a, b, c in zip(NAMES, tri, tor, ref):
        assert a.dtype == torch.float32, name
        assert rel_error(a, c) < 1e-5, f"triton {name}"
        assert rel_error(b, c) < 1e-5, f"torch {name}"


@pytest.mark.parametrize("chunk,block_j", [(64, 16), (16, 32)], ids=["C64-J16", "C16-J32"])
def test_tile_shapes_agree(chunk, block_j):
    """Other chunk lengths and chunks per block (another block boundary, another Toeplitz tile) give the same y,
    dx, dc and dq as the default launch."""
    from longmixer.ops.ema import chunked, kernel

    x, coef_in, decay, coef_out = (t.detach().float() for t in _inputs(2, 300, 3, 16, seed=5, bidirectional=True))
    c, q = (coef_in * coef_out).contiguous(), decay.contiguous()
    xt = chunked.transpose(x)
    dyt = torch.randn(xt.shape, generator=torch.Generator().manual_seed(6))
    outs = []
    for C, J in ((chunked.CHUNK, chunked.BLOCK_J), (chunk, block_j)):
        k = kernel.ema_kernel_fwd(c, q, C)
        y = chunked.ema_chunk_fwd(xt, k, c, q, True, out_dtype=torch.float32, block_j=J)
        outs.append((y,) + chunked.ema_chunk_bwd(xt, dyt, k, c, q, True, block_j=J))
    for name, a, b in zip(("y", "dx", "dc", "dq"), *outs):
        assert rel_error(a, b) < 1e-5, name


def test_transpose_casts_and_handles_ragged_tiles():
    from longmixer.ops.ema import chunked

    x = torch.randn(2, 70, 33, dtype=torch.float64)
    out = chunked.transpose(x, torch.float32)
    assert out.shape == (2, 33, 70) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, x.transpose(1, 2).float())


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidir"])
def test_layer_on_triton_equals_torch_backend(bidirectional):
    """MultiHeadEMA (padded batch) on the triton backend (the chunked kernels) equals the layer on the torch
    backend: output and the gradients of x and every parameter (delta, alpha, beta, gamma, omega through the
    parameter transforms)."""
    torch.manual_seed(0)
    layer = MultiHeadEMA(6, 16, bidirectional=bidirectional, backend="torch").double()
    twin = copy.deepcopy(layer)
    twin.backend = "triton"
    x = torch.randn(2, 40, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 31:] = False
    dy = torch.randn(2, 40, 6, dtype=torch.float64)
    y_ref, y_tri = layer(x, mask), twin(x, mask)
    g_ref = torch.autograd.grad(y_ref, [x, *layer.parameters()], dy)
    g_tri = torch.autograd.grad(y_tri, [x, *twin.parameters()], dy)
    assert rel_error(y_tri, y_ref) < 1e-5
    for (name, _), a, b in zip([("x", None), *layer.named_parameters()], g_tri, g_ref):
        assert rel_error(a, b) < 1e-5, name


@pytest.mark.parametrize("splits", [3], ids=["S3"])  # 3 splits of 5 rows: uneven, the harder case of the same path
def test_backward_batch_splits_agree(splits):
    """The backward split over the batch (each split's rows in its own programs, coefficient gradients summed
    from per-split partials; 3 splits of 5 rows leave them uneven) gives the one-program-per-channel result."""
    from longmixer.ops.ema import chunked, kernel

    x, coef_in, decay, coef_out = (t.detach().float() for t in _inputs(5, 70, 3, 16, seed=7, bidirectional=True))
    c, q = (coef_in * coef_out).contiguous(), decay.contiguous()
    xt = chunked.transpose(x)
    dyt = torch.randn(xt.shape, generator=torch.Generator().manual_seed(8))
    k = kernel.ema_kernel_fwd(c, q, chunked.CHUNK)
    one = chunked.ema_chunk_bwd(xt, dyt, k, c, q, True, splits=1)
    split = chunked.ema_chunk_bwd(xt, dyt, k, c, q, True, splits=splits)
    for name, a, b in zip(("dx", "dc", "dq"), split, one):
        assert rel_error(a, b) < 1e-6, name
    assert chunked.batch_splits(8, 128) == 8 and chunked.batch_splits(8, 1024) == 1 and chunked.batch_splits(2, 256) == 2
