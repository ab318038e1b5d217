"""ops/sparse_local_attention: the fused Triton path (TRITON_INTERPRET=1 on CPU) against the scatter-based reference,
and the reference against a dense per-row reference."""

import itertools

import pytest
import torch
import triton

from longmixer.ops.sparse_local_attention import (
    compress_ref,
    extract_ref,
    packed_index,
    sparse_local_attention,
    sparse_local_attention_ref,
)
from longmixer.ops.sparse_local_attention import kernel as sparse_kernel
from longmixer.ops.sparse_local_attention.reference import sparse_attention_naive
from tests._pairwise import all_pairs

PATTERNS = [pytest.param(dict(window=6), id="w6"), pytest.param(dict(window=64), id="w64>L"),
            pytest.param(dict(chunk=5), id="chunk5"), pytest.param(dict(), id="full")]


def _inputs(B, L, K, V, p_active, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, L, K, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, L, V, generator=g, dtype=dtype)
    active = torch.rand(B, L, generator=g) < p_active
    active[-1, : L // 3] = False  # ragged: rows with different counts
    bias = torch.randn(2 * L + 5, generator=g, dtype=dtype) * 0.5
    return q, k, v, active, bias


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("causal,attention,rel_pos", list(itertools.product(
    [False, True], ["softmax", "relu2"], ["original", "compressed"])))
def test_reference_matches_naive(pattern, causal, attention, rel_pos):
    q, k, v, active, bias = _inputs(3, 37, 8, 12, 0.6, seed=1, dtype=torch.float64)
    active[1] = False  # a row with nothing activated
    opts = dict(causal=causal, attention=attention, rel_pos=rel_pos, **pattern)
    ref = sparse_local_attention_ref(q, k, v, active, bias, **opts)
    naive = sparse_attention_naive(q, k, v, active, bias, **opts)
    torch.testing.assert_close(ref, naive, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pattern,causal,attention,rel_pos", [
    pytest.param(dict(window=6), False, "softmax", "original", id="w6-bidir-softmax-orig"),
    pytest.param(dict(window=6), True, "relu2", "compressed", id="w6-causal-relu2-comp"),
    pytest.param(dict(window=64), False, "relu2", "original", id="w64-bidir-relu2-orig"),
    pytest.param(dict(window=8), True, "softmax", "original", id="w8-causal-softmax-orig"),
    pytest.param(dict(chunk=5), False, "softmax", "compressed", id="chunk5-bidir-softmax-comp"),
    pytest.param(dict(), False, "relu2", "original", id="full-bidir-relu2-orig"),
    pytest.param(dict(), True, "softmax", "compressed", id="full-causal-softmax-comp"),
])
@pytest.mark.parametrize("B,L,K,V", [pytest.param(2, 45, 12, 40, id="B2-L45-K12-V40")])
def test_kernel_parity_fwd_bwd(pattern, causal, attention, rel_pos, B, L, K, V):
    """Forward and every gradient (dq, dk, dv, dbias) of the Triton path against the reference, by name; V = 40
    spans two value blocks under the interpreter, L = 45 leaves ragged query and key blocks."""
    _check_parity(pattern, causal, attention, rel_pos, B, L, K, V)


@pytest.mark.parametrize("pattern,causal,attention,rel_pos,table", [
    pytest.param(dict(window=6), True, "relu2", "compressed", None, id="w6-causal-relu2-comp"),
    pytest.param(dict(chunk=5), False, "softmax", "compressed", None, id="chunk5-bidir-softmax-comp"),
    pytest.param(dict(), False, "softmax", "compressed", None, id="full-bidir-softmax-comp-diag"),
    pytest.param(dict(), True, "relu2", "compressed", None, id="full-causal-relu2-comp-diag"),
    pytest.param(dict(), False, "softmax", "original", None, id="full-bidir-softmax-orig"),
    pytest.param(dict(), False, "softmax", "compressed", 19, id="full-bidir-softmax-comp-short-table"),
])
@pytest.mark.parametrize("dv_pass", [True, False], ids=["dv-pass", "dv-in-kernel"])
def test_one_kernel_backward_every_mode(monkeypatch, pattern, causal, attention, rel_pos, table, dv_pass):
    """The one-kernel backward (dq by atomics; the bias gradient by diagonal sums where the table is Toeplitz in
    packed slots and covers every distance, else one atomic per score), forced on for every attention pattern: with
    dv by a second pass (the dk/dv kernel without dk, the default) and with dv in the same kernel."""
    from longmixer.ops.sparse_local_attention import kernel

    monkeypatch.setattr(kernel, "FUSED_BWD_MODES", {kernel.MODE_WINDOW, kernel.MODE_CHUNK, kernel.MODE_FULL})
    if not dv_pass:
        monkeypatch.setattr(kernel, "DV_PASS_TILES", None)
    launches = []
    monkeypatch.setattr(kernel, "_sparse_local_attention_bwd_dkdv_kernel",
                        _Spy(kernel._sparse_local_attention_bwd_dkdv_kernel, launches))
    _check_parity(pattern, causal, attention, rel_pos, 2, 45, 12, 40, table=table)
    assert launches == ([(3, 1, 2)] if dv_pass else []), launches


class _Spy:
    """Records the grids a Triton kernel is launched on."""

    def __init__(self, jit, grids):
        self.jit, self.grids = jit, grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.jit[grid]


def _check_parity(pattern, causal, attention, rel_pos, B, L, K, V, table=None):
    q, k, v, active, bias = _inputs(B, L, K, V, 0.7, seed=L)
    if table is not None:  # a table shorter than the packed distances: the ends are clamped
        bias = bias[:table]
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]
    do = torch.randn(B, L, V)
    opts = dict(causal=causal, attention=attention, rel_pos=rel_pos, **pattern)
    results = {}
    for backend in ("torch", "triton"):
        o = sparse_local_attention(q, k, v, active, bias, backend=backend, **opts)
        grads = torch.autograd.grad(o, leaves, do)
        results[backend] = dict(zip(("o", "dq", "dk", "dv", "dbias"), (o, *grads)))
    for name, ref in results["torch"].items():
        tri = results["triton"][name]
        scale = ref.abs().max().clamp(min=1.0)
        assert ((tri - ref).abs().max() / scale).item() < 2e-5, name


def test_kernel_inactive_rows_and_no_bias():
    """A batch row with no activated token, and a batch with none at all, give zeros (not NaN) on both paths."""
    q, k, v, active, _ = _inputs(2, 20, 16, 16, 0.5, seed=3)
    active[0] = False
    for act in (active, torch.zeros_like(active)):
        ref = sparse_local_attention(q, k, v, act, None, window=4, backend="torch")
        tri = sparse_local_attention(q, k, v, act, None, window=4, backend="triton")
        torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(tri).all() and (tri[~act] == 0).all()


def test_compress_extract_round_trip():
    x = torch.randn(3, 11, 4)
    active = torch.rand(3, 11) < 0.5
    active[2] = False
    xc, positions, cmask = compress_ref(x, active)
    assert xc.shape[1] == int(active.sum(-1).max())
    for b in range(3):
        idx = active[b].nonzero().squeeze(-1)
        torch.testing.assert_close(xc[b, : idx.numel()], x[b, idx])
        assert (positions[b, : idx.numel()] == idx).all() and (xc[b, idx.numel():] == 0).all()
        assert cmask[b].sum() == idx.numel()
    torch.testing.assert_close(extract_ref(xc, active), x * active[..., None])


def test_packed_index():
    active = torch.tensor([[False, True, True, False, True], [False] * 5])
    idx, count = packed_index(active)
    assert count.tolist() == [3, 0]
    assert idx[0, :3].tolist() == [1, 2, 4]


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=4, chunk=4), "exclude"), (dict(window=0), "positive"), (dict(attention="laplace"), "attention"),
    (dict(rel_pos="rope"), "rel_pos"),
])
def test_validation_errors(kwargs, match):
    q, k, v, active, bias = _inputs(1, 8, 4, 4, 0.5, seed=0)
    with pytest.raises(ValueError, match=match):
        sparse_local_attention(q, k, v, active, bias, backend="torch", **kwargs)


@pytest.mark.parametrize("nb,ratio,W,center,n_taps", [(3, 1, 2, 40, 81), (4, 2, 3, 30, 61), (2, 1, 2, 50, 101)])
def test_fold_diagonal_partials_equals_scatter(nb, ratio, W, center, n_taps):
    """The skewed-view fold equals adding each tile's sums at its taps one by one (taps past the table dropped)."""
    BN = 8
    part = torch.randn(2, nb, nb * ratio, W, BN, dtype=torch.float64)
    want = torch.zeros(2, n_taps, dtype=torch.float64)
    for n in range(nb):
        for m in range(nb * ratio):
            for w in range(W):
                for jj in range(BN):
                    tap = center + jj - (m // ratio - n + w) * BN
                    if 0 <= tap < n_taps:
                        want[:, tap] += part[:, n, m, w, jj]
    torch.testing.assert_close(sparse_kernel.fold_diagonal_partials(part, center, n_taps, ratio), want)


@pytest.mark.parametrize("V,dv_pass_tiles,two_pass", [(256, "default", True), (160, "default", True),
                                                      (128, "default", False), (256, None, False)],
                         ids=["V256", "V160", "V128-one-kernel", "V256-dv-pass-off"])
def test_full_mode_plan_on_a_gpu(monkeypatch, V, dv_pass_tiles, two_pass):
    """The GPU's plan for full mode (the interpreter's small tiles off): values wider than 128 take the two passes
    with 64-query tiles, two diagonal classes a tile and no dv in the first kernel; values up to 128, and
    `DV_PASS_TILES = None`, keep dv in the one kernel with 32-query tiles (three classes a tile), the backward the
    dv pass replaced."""
    from longmixer.ops.sparse_local_attention import kernel

    monkeypatch.setattr(kernel, "triton_interpreter_on", lambda: False)
    if dv_pass_tiles is None:
        monkeypatch.setattr(kernel, "DV_PASS_TILES", None)
    cfg = dict(MODE=kernel.MODE_FULL, BIAS_ORIG=False)
    plan = kernel._bwd_plan(cfg, V, 4096, torch.zeros(2 * 4096 - 1))
    tiles = kernel.FUSED_BWD_TILES if two_pass else kernel.ONE_KERNEL_BWD_TILES
    assert (plan["BLOCK_M"], plan["BLOCK_N"]) == (tiles["BLOCK_M"], tiles["BLOCK_N"])
    assert plan["BLOCK_M"] == (64 if two_pass else 32) and plan["PART_W"] == (2 if two_pass else 3)
    assert plan["DV"] is not two_pass and (plan["dv_pass"] == kernel.DV_PASS_TILES if two_pass else
                                            plan["dv_pass"] is None)
    assert plan["BLOCK_V"] == triton.next_power_of_2(V) and plan["BIAS_DIAG"]


@pytest.mark.parametrize("causal,table,V,pieces", all_pairs(
    [pytest.param(False, id="bidir"), pytest.param(True, id="causal")],
    [pytest.param(None, id="no-bias"), pytest.param(153, id="table-M153<padded"),
     pytest.param(300, id="table-M300>padded")],
    [pytest.param(40, id="V40-one-pass"), pytest.param(160, id="V160-two-pass")],
    [pytest.param(None, id="whole-range"), pytest.param(64, id="pieces-of-64")]))
def test_packed_long_span_route(monkeypatch, causal, table, V, pieces):
    """SeqBoat-full's softmax attention over L > 128 runs as MEGA's full-length attention on the packed sequence
    (rows read and written through the slot index, one chunk of 256 slots, each row's count its length): forward
    and every gradient against the reference, with a row that has nothing activated and a ragged one; a bias
    table shorter than the chunk (zeros past it) and a longer one (sliced); values of 40 (dv in the one pass) and
    160 (the dv pass), whose two passes take the query range whole or in pieces of 64 (`PACKED_PIECE_QUERIES`).
    Bidirectional, no score is masked (`packed_tile_mode`): the keys past a row's count are left out in the tile
    that holds the count."""
    from longmixer.ops.sparse_local_attention import kernel

    monkeypatch.setattr(kernel.local_kernel, "PACKED_PIECE_QUERIES", pieces)
    fwd_rows, bwd_rows = [], []
    for name, seen in (("local_attention_fwd", fwd_rows), ("local_attention_bwd", bwd_rows)):
        launcher = getattr(kernel.local_kernel, name)
        monkeypatch.setattr(kernel.local_kernel, name, lambda *a, f=launcher, s=seen, **kw: s.append(
            (tuple(a[0].shape), kw["chunk"], kw["rows"][1].tolist())) or f(*a, **kw))
    B, L, K = 3, 150, 16
    q, k, v, active, bias = _inputs(B, L, K, V, 0.7, seed=V)
    active[1] = False
    bias = None if table is None else torch.randn(2 * table - 1, generator=torch.Generator().manual_seed(5)) * 0.5
    o = _route_matches_reference(q, k, v, active, bias, causal)
    counts = active.sum(-1).tolist()
    assert fwd_rows == [((B, 1, L, K), 256, counts)] and bwd_rows == fwd_rows, (fwd_rows, bwd_rows)
    assert (o[~active] == 0).all()


def _route_matches_reference(q, k, v, active, bias, causal):
    """The Triton path's output and every gradient against the reference's (compressed bias); returns the output."""
    leaves = [t.requires_grad_() for t in (q, k, v) + (() if bias is None else (bias,))]
    do = torch.randn(v.shape)
    results = {}
    for backend in ("torch", "triton"):
        o = sparse_local_attention(q, k, v, active, bias, causal=causal, rel_pos="compressed", backend=backend)
        results[backend] = (o, *torch.autograd.grad(o, leaves, do))
    for name, tri, ref in zip(("o", "dq", "dk", "dv", "dbias"), results["triton"], results["torch"]):
        assert ((tri - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item() < 2e-5, name
    return results["triton"][0]


def test_packed_long_span_without_ds_tiles(monkeypatch):
    """With the ds tiles off (`DS_TILES_MAX_BYTES` = 0, as for many rows at long lengths) the route's bias gradient
    takes the carried tile and per-program partials, whose unmasked scores (bidirectional, `packed_tile_mode`) get
    the keys past each row's count zeroed there too; the pieces, which need the ds tiles, stay off."""
    from longmixer.ops.sparse_local_attention import kernel

    monkeypatch.setattr(kernel.local_kernel, "DS_TILES_MAX_BYTES", 0)
    monkeypatch.setattr(kernel.local_kernel, "PACKED_PIECE_QUERIES", 64)
    folds, launches = [], []
    fold, jit = kernel.local_kernel.fold_span_partials, kernel.local_kernel._local_attention_bwd_kernel
    monkeypatch.setattr(kernel.local_kernel, "fold_span_partials", lambda *a: folds.append(a[-1]) or fold(*a))

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw["CARRY"], kw["ALIGNED"])) or jit[grid](*args, **kw)

    monkeypatch.setattr(kernel.local_kernel, "_local_attention_bwd_kernel", Spy())
    B, L, K, V = 2, 150, 16, 160
    q, k, v, active, _ = _inputs(B, L, K, V, 0.7, seed=11)
    bias = torch.randn(2 * 160 - 1, generator=torch.Generator().manual_seed(3)) * 0.5
    _route_matches_reference(q, k, v, active, bias, False)
    assert folds == [64] and launches == [((3, B, 1), True, 2)], (folds, launches)  # spans of 64 over L


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_packed_long_span_bias_table_and_whole_rows(monkeypatch, causal):
    """The route at L = 200 (one chunk of 256: the forward and the backward's dv pass read their bias from the tile
    table, as every sequence longer than 128 does), a row with every token active beside a ragged one, and values of
    160 in one 256-wide block of the forward (each score tile computed once, as the fused forward did)."""
    from longmixer.ops.sparse_local_attention import kernel

    fwd_cfgs, tables = [], []
    launcher, table = kernel.local_kernel.local_attention_fwd, kernel.local_kernel.bias_table
    monkeypatch.setattr(kernel.local_kernel, "local_attention_fwd",
                        lambda *a, **kw: fwd_cfgs.append(kw["cfg"]) or launcher(*a, **kw))
    monkeypatch.setattr(kernel.local_kernel, "bias_table", lambda *a, **kw: tables.append(a[1:]) or table(*a, **kw))
    B, L, K, V = 2, 200, 16, 160
    q, k, v, active, bias = _inputs(B, L, K, V, 0.7, seed=7)
    active[0] = True
    _route_matches_reference(q, k, v, active, bias, causal)
    assert [c["BLOCK_V"] for c in fwd_cfgs] == [256] and tables == [(256, 64, 64)] * 2, (fwd_cfgs, tables)


@pytest.mark.parametrize("kwargs,expected", [
    (dict(), True), (dict(L=128), False), (dict(K=96), False), (dict(V=320), False), (dict(rel_pos="original"), False),
    (dict(m_bias=140), False), (dict(no_bias=True, rel_pos="original"), True), (dict(attention="relu2"), False),
    (dict(window=256), False), (dict(chunk=64), False),
], ids=["full-softmax-compressed", "L128", "K96", "V320", "original-bias", "short-table", "no-bias", "relu2",
        "window", "chunk"])
def test_packed_long_span_routing(kwargs, expected):
    """Which calls take MEGA's full-length kernels: full softmax attention over more than 128 slots with K <= 64,
    V <= 256 and a bias, if any, Toeplitz in packed slots over every distance."""
    L, K, V = kwargs.get("L", 150), kwargs.get("K", 64), kwargs.get("V", 256)
    q, v = torch.zeros(1, L, K), torch.zeros(1, L, V)
    bias = None if kwargs.get("no_bias") else torch.zeros(2 * kwargs.get("m_bias", L) - 1)
    assert sparse_kernel.packed_long_span(q, v, bias, window=kwargs.get("window"), chunk=kwargs.get("chunk"),
                                          attention=kwargs.get("attention", "softmax"),
                                          rel_pos=kwargs.get("rel_pos", "compressed")) is expected


def test_packed_rows_refused_off_their_path():
    """A packed sequence (`rows`) is only for one head's full-length softmax attention on the one-pass long-span
    backward, with int32 indices of the right shapes."""
    from longmixer.ops.local_attention import kernel as local_kernel

    q = torch.zeros(1, 1, 150, 16)
    rows = (torch.zeros(1, 150, dtype=torch.int32), torch.tensor([100], dtype=torch.int32))
    kw = dict(causal=False, scale=0.25)
    for attention, chunk, qq in (("laplace", 192, q), ("softmax", 64, q), ("softmax", 192, q.expand(1, 2, 150, 16))):
        with pytest.raises(ValueError, match="full-length softmax"):
            local_kernel.local_attention_fwd(qq, qq, qq, None, None, attention=attention, chunk=chunk, rows=rows, **kw)
    with pytest.raises(ValueError, match="count must be a contiguous int32"):
        local_kernel.local_attention_fwd(q, q, q, None, None, attention="softmax", chunk=192,
                                         rows=(rows[0], rows[1].long()), **kw)
    with pytest.raises(ValueError, match=r"idx must be a contiguous int32 \[1, 150\]"):
        local_kernel.local_attention_fwd(q, q, q, None, None, attention="softmax", chunk=192,
                                         rows=(rows[0][:, :100], rows[1]), **kw)
    stat = torch.zeros(1, 1, 150)
    with pytest.raises(ValueError, match="dq by atomics"):
        local_kernel.local_attention_bwd(q, q, q, q, stat, q, None, None, attention="softmax", chunk=192, rows=rows,
                                         cfg=dict(span=64, BLOCK_M=64, BLOCK_V_MAX=128, num_warps=4, num_stages=1),
                                         **kw)
