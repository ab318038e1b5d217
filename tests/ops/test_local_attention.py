"""ops/local_attention: the Triton kernels (under TRITON_INTERPRET=1 on CPU) against the float64 torch reference,
forward and every gradient, with ragged chunks, padding, causal masks and the relative bias, through both backward
paths (one fused kernel when a key span holds whole chunks; dq + dk/dv kernels with bias atomics otherwise)."""

import itertools

import pytest
import torch

from longmixer.ops.local_attention import kernel, local_attention, local_attention_ref
from tests._pairwise import all_pairs
from tests.ops._helpers import rel_error

ATTENTION = ["softmax", "relu2", "laplace"]
CAUSAL = [pytest.param(False, id="bidir"), pytest.param(True, id="causal")]


def _case(B, H, L, K, V, C, seed=0, bias_heads=0, masked=True):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, L, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, L, V, generator=g, dtype=torch.float64)
    CC = L if C is None else C
    shape = (2 * CC - 1,) if bias_heads == 0 else (bias_heads, 2 * CC - 1)
    bias = torch.randn(*shape, generator=g, dtype=torch.float64) * 0.5
    mask = None
    if masked:
        mask = torch.ones(B, L, dtype=torch.bool)
        mask[0, L - 13:] = False
        if B > 1:
            mask[1, 5:] = False  # later chunks of this row have no real key at all
    return [t.requires_grad_() for t in (q, k, v, bias)], mask


def _assert_matches_reference(q, k, v, bias, kw):
    """The Triton path's output and every gradient within 1e-5 (relative) of the float64 reference."""
    ref = local_attention_ref(q, k, v, **kw)
    tri = local_attention(q, k, v, backend="triton", **kw)
    do = torch.randn_like(ref)
    assert rel_error(tri, ref) < 1e-5, "o"
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), torch.autograd.grad(tri, [q, k, v, bias], do),
                          torch.autograd.grad(ref, [q, k, v, bias], do)):
        assert rel_error(a, b) < 1e-5, name


CASES = [
    pytest.param(2, 2, 50, 8, 20, 16, 0, True, id="B2-H2-L50-K8-V20-C16-mask"),
    pytest.param(1, 1, 70, 12, 130, 32, 0, False, id="B1-H1-L70-K12-V130-C32"),
    pytest.param(2, 3, 33, 16, 16, None, 3, True, id="B2-H3-L33-full-headbias-mask"),
    # a chunk longer than any key span: the split backward (dq kernel, then dk/dv with bias atomics)
    pytest.param(2, 1, 150, 8, 24, None, 0, True, id="B2-H1-L150-K8-V24-full-mask"),
]


@pytest.mark.parametrize("attention", ["softmax", "relu2", "laplace"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("B,H,L,K,V,C,bias_heads,masked", CASES)
def test_parity_fwd_bwd(attention, causal, B, H, L, K, V, C, bias_heads, masked):
    (q, k, v, bias), mask = _case(B, H, L, K, V, C, bias_heads=bias_heads, masked=masked)
    kw = dict(chunk_size=C, attention=attention, causal=causal, bias=bias, mask=mask)
    ref = local_attention_ref(q, k, v, **kw)
    tri = local_attention(q, k, v, backend="triton", **kw)
    do = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, [q, k, v, bias], do)
    g_tri = torch.autograd.grad(tri, [q, k, v, bias], do)
    assert rel_error(tri, ref) < 1e-5, "o"
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), g_tri, g_ref):
        assert rel_error(a, b) < 1e-5, name


@pytest.mark.parametrize("C,span,block_m,dq_atomic,block_v,attention,causal", all_pairs(
    [pytest.param(20, 16, 16, False, 16, id="split"), pytest.param(12, 64, 16, False, 16, id="fused"),
     pytest.param(20, 16, 16, True, 32, id="split-atomic-dq"),
     pytest.param(20, 16, 16, True, 16, id="split-atomic-dq-vblocks"),
     pytest.param(20, 16, 32, False, 16, id="split-query-block>span"),
     pytest.param(8, 16, 32, False, 16, id="fused-query-block>span")], ATTENTION, CAUSAL))
def test_backward_tilings(monkeypatch, C, span, block_m, dq_atomic, block_v, attention, causal):
    """Other backward tiles on one ragged case: chunks of 20 longer than a 16-key span (split path, a query block
    spanning two chunks, value blocks of 16 for V = 20), and spans of five chunks of 12 (fused, two value blocks);
    the split path with dq by atomics (the query blocks visited in a rotated order), with one and with two value
    blocks; and query blocks wider than the key span (split, and fused over spans of two chunks of 8). The bias
    gradient's diagonal sums rotate each tile along its query axis (`_query_rotated`), whose wrap classes depend on
    both tile sizes."""
    monkeypatch.setattr(kernel, "_bwd_config", lambda C, K, V: dict(span=span, BLOCK_M=block_m, BLOCK_V_MAX=block_v,
                                                                     num_warps=4, num_stages=2, dq_atomic=dq_atomic))
    (q, k, v, bias), mask = _case(2, 2, 45, 8, 20, C, bias_heads=2)
    kw = dict(chunk_size=C, attention=attention, causal=causal, bias=bias, mask=mask)
    _assert_matches_reference(q, k, v, bias, kw)


@pytest.mark.parametrize("block_m,ds_tiles,attention,causal,bias_heads", all_pairs(
    [pytest.param(16, False, id="query-block=span"), pytest.param(8, False, id="query-block=span/2"),
     pytest.param(16, True, id="ds-tiles"), pytest.param(8, True, id="ds-tiles-two-a-span")], ATTENTION, CAUSAL,
    [pytest.param(0, id="shared-bias"), pytest.param(2, id="head-bias")]))
def test_full_length_one_pass_backward(monkeypatch, block_m, ds_tiles, attention, causal, bias_heads):
    """Full attention longer than a key span through the one-pass backward, ragged (L = 45 over spans of 16): dq by
    atomics and the bias gradient either by the ds tiles (the default), whose slots cover the sequence rounded up to
    whole query tiles and whose tiles past L add zeros, or as per-program partials folded on the host, through the
    carried tile (query blocks of 16) or added to tile by tile (query blocks of 8)."""
    monkeypatch.setattr(kernel, "_bwd_config", lambda C, K, V: dict(span=16, BLOCK_M=block_m, BLOCK_V_MAX=32,
                                                                     num_warps=4, num_stages=1, dq_atomic=True,
                                                                     ds_tiles=ds_tiles))
    folds = []
    for name in ("fold_ds_tiles", "fold_span_partials"):
        monkeypatch.setattr(kernel, name, lambda *a, f=getattr(kernel, name), n=name: folds.append(n) or f(*a))
    (q, k, v, bias), mask = _case(2, 2, 45, 8, 20, None, bias_heads=bias_heads)
    kw = dict(chunk_size=None, attention=attention, causal=causal, bias=bias, mask=mask)
    _assert_matches_reference(q, k, v, bias, kw)
    assert folds == ["fold_ds_tiles" if ds_tiles else "fold_span_partials"], folds


def _two_pass(monkeypatch, dv_block_m=16, dv_block_n=16, **extra):
    """The long-span backward in two passes: the one-pass kernel without dv (spans of 16, dq by atomics), then dv
    by `_local_attention_bwd_dv_kernel` over value blocks of 16; `extra` config entries (`piece_queries`). Returns
    the dv kernel's launches as (grid, tile mode)."""
    dv_pass = dict(BLOCK_M=dv_block_m, BLOCK_N=dv_block_n, BLOCK_V_MAX=16, num_warps=4, num_stages=1)
    monkeypatch.setattr(kernel, "_bwd_config", lambda C, K, V: dict(span=16, BLOCK_M=16, BLOCK_V_MAX=32,
                                                                     num_warps=4, num_stages=1, dq_atomic=True,
                                                                     dv_pass=dv_pass, **extra))
    grids, jit = [], kernel._local_attention_bwd_dv_kernel

    class Spy:  # records each launch's grid and tile mode
        def __getitem__(self, grid):
            return lambda *args, **kw: grids.append((grid, kw["ALIGNED"])) or jit[grid](*args, **kw)

    monkeypatch.setattr(kernel, "_local_attention_bwd_dv_kernel", Spy())
    return grids


@pytest.mark.parametrize("L,C,masked,bias_heads,dv_tiles,aligned,attention,causal", all_pairs(
    [pytest.param(45, None, True, 2, (16, 16), False, id="ragged-masked-dv16x16"),
     pytest.param(48, None, False, 0, (8, 32), False, id="unmasked-dv8x32"),
     pytest.param(64, None, False, 2, (16, 16), True, id="aligned-dv16x16"),
     pytest.param(64, None, False, 0, (32, 16), True, id="aligned-dv32x16"),
     pytest.param(64, 32, False, 2, (32, 16), True, id="chunks-of-32-dv32x16")], ATTENTION, CAUSAL))
def test_two_pass_long_span_backward(monkeypatch, L, C, masked, bias_heads, dv_tiles, aligned, attention, causal):
    """Attention longer than a key span with dv in its own pass (V = 20: two value blocks of 16): full-length ragged
    L = 45 with padded keys and a bias per head, and L = 48 unmasked with a shared bias and dv tiles of 8 queries x
    32 keys, both with tiles that straddle the sequence's end (tile mode 0); L = 64 with dv tiles that divide it
    (tile mode 2, causal 1), among them query tiles wider than the key tiles; and chunks of 32 with those tiles,
    whose causal query ranges start at a key tile inside a chunk and end at the chunk's end."""
    grids = _two_pass(monkeypatch, *dv_tiles)
    (q, k, v, bias), mask = _case(2, 2, L, 8, 20, C, bias_heads=bias_heads, masked=masked)
    kw = dict(chunk_size=C, attention=attention, causal=causal, bias=bias, mask=mask)
    _assert_matches_reference(q, k, v, bias, kw)
    mode = (1 if causal else 2) if aligned else 0
    assert grids == [((-(-L // dv_tiles[1]), 4, 2), mode)], grids


@pytest.mark.parametrize("L,piece,masked,bias_heads,attention,causal", all_pairs(
    [pytest.param(45, 16, True, 2, id="ragged-masked-pieces-of-1-tile"),
     pytest.param(64, 32, False, 0, id="aligned-pieces-of-2-tiles"),
     pytest.param(80, 48, True, 0, id="last-piece-short")], ATTENTION, CAUSAL))
def test_backward_in_pieces(monkeypatch, L, piece, masked, bias_heads, attention, causal):
    """Both passes of the long-span backward over pieces of `piece` queries a program (dk and dv then added by
    atomics into float32 buffers): the same gradients as the reference, with spans whose causal ranges start
    inside a piece, pieces of one and two query tiles, a last piece shorter than the others, and spans whose pieces
    have no query at all. The dv pass's grid has a program per key tile and piece."""
    grids = _two_pass(monkeypatch, piece_queries=piece)
    first = []
    jit = kernel._local_attention_bwd_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: first.append((grid, kw["DK_ATOMIC"])) or jit[grid](*args, **kw)

    monkeypatch.setattr(kernel, "_local_attention_bwd_kernel", Spy())
    (q, k, v, bias), mask = _case(2, 2, L, 8, 20, None, bias_heads=bias_heads, masked=masked)
    kw = dict(chunk_size=None, attention=attention, causal=causal, bias=bias, mask=mask)
    _assert_matches_reference(q, k, v, bias, kw)
    n_pieces = -(-(-(-L // 16)) // (piece // 16))
    assert first == [((-(-L // 16) * n_pieces, 4, 1), True)], first
    assert [g for g, _ in grids] == [(-(-L // 16) * n_pieces, 4, 2)], grids


@pytest.mark.parametrize("attention,causal,bias_heads", all_pairs(
    ATTENTION, CAUSAL, [pytest.param(0, id="shared-bias"), pytest.param(2, id="head-bias")]))
def test_dv_pass_bias_table(monkeypatch, attention, causal, bias_heads):
    """The dv pass reading its bias tiles from `bias_table`, each tile transposed to the kernel's [keys, queries]
    (chunks >= 256 by default; here full attention over L = 48 with 16 x 16 tiles, a padded row and a row without
    keys past 5), gives bitwise the gradients of the gather from the bias, and those match the reference."""
    grids = _two_pass(monkeypatch, 16, 16)
    (q, k, v, bias), mask = _case(2, 2, 48, 8, 20, None, bias_heads=bias_heads)
    kw = dict(chunk_size=None, attention=attention, causal=causal, bias=bias, mask=mask)
    do = torch.randn(2, 2, 48, 20, dtype=torch.float64)
    grads = {}
    for table in (False, True):  # the forward's 64 x 64 tiles do not divide L: only the dv pass asks for 16 x 16
        asked = []
        monkeypatch.setattr(kernel, "use_bias_table",
                            lambda C, M, N, table=table: asked.append((C, M, N)) or (table and (M, N) == (16, 16)))
        out = local_attention(q, k, v, backend="triton", **kw)
        grads[table] = torch.autograd.grad(out, [q, k, v, bias], do)
        assert (48, 16, 16) in asked
    assert len(grids) == 2
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads[True], grads[False]):
        assert torch.equal(a, b), name
    ref = local_attention_ref(q, k, v, **kw)
    assert rel_error(grads[True][2], torch.autograd.grad(ref, v, do)[0]) < 1e-5


@pytest.mark.parametrize("C,V,path", [(None, 160, "two-pass"), (None, 128, "one-pass"), (160, 96, "dq-kernel")],
                         ids=["full-V160-two-pass", "full-V128-one-pass", "C160-V96-dq-kernel"])
def test_long_span_default_tiles_route_by_value_width(monkeypatch, C, V, path):
    """With the default tiles (no override), attention longer than a span with K 64 takes, at full length, the dv
    pass for values wider than 128 and one pass for values up to 128; a chunk shorter than the sequence (C 160 of
    L 192) with values of 96 takes the dq kernel and the dk/dv kernel, as before the dv pass. Each matches the
    reference. The two passes' square tiles (float32: spans of 64) take the ds tiles; the one pass's 32-query tiles,
    which do not ask for them, the per-program partials; the split path's chunk of 160 the atomics."""
    launched, folds = {}, []
    for name in ("fold_ds_tiles", "fold_span_partials"):
        monkeypatch.setattr(kernel, name, lambda *a, f=getattr(kernel, name), n=name: folds.append(n) or f(*a))
    for name in ("_local_attention_bwd_dv_kernel", "_local_attention_bwd_dq_kernel"):
        jit = getattr(kernel, name)
        monkeypatch.setattr(kernel, name, type("Spy", (), {
            "__getitem__": lambda self, grid, jit=jit, name=name: (launched.setdefault(name, grid), jit[grid])[1]})())
    (q, k, v, bias), mask = _case(1, 1, 192, 64, V, C, masked=True)
    kw = dict(chunk_size=C, attention="softmax", causal=False, bias=bias, mask=mask)
    _assert_matches_reference(q, k, v, bias, kw)
    expected = {"two-pass": {"_local_attention_bwd_dv_kernel"}, "one-pass": set(),
                "dq-kernel": {"_local_attention_bwd_dq_kernel"}}[path]
    assert set(launched) == expected, launched
    assert folds == {"two-pass": ["fold_ds_tiles"], "one-pass": ["fold_span_partials"], "dq-kernel": []}[path], folds


def test_default_backward_tiles_by_length_chunk_and_dtype():
    """The launcher's default tiles: MEGA's full attention with values wider than 128 takes 128-key spans in 16-bit
    (8 warps) and spans of 64 in float32, whose 128-key tiles would not fit an H200's shared memory, and where the
    bias gradient's ds slots would pass `DS_TILES_MAX_BYTES` (the carried tile then runs, at the tiles it was measured
    at); values up to 128 the one-pass tiles; a chunk shorter than the sequence the split tiles; chunks of at most 128
    the fused kernel."""
    tiles = kernel._default_bwd_tiles
    for dtype in (torch.bfloat16, torch.float16):
        assert tiles(4096, 4096, 64, 256, dtype, 25, True) == kernel.LONG_SPAN_K64  # 25 x 127 slots: 52 MB
    assert kernel.LONG_SPAN_K64["span"] == 128 and kernel.LONG_SPAN_K64["num_warps"] == 8
    fp32 = tiles(4000, 4000, 64, 160, torch.float32)
    span64 = kernel.LONG_SPAN_K64_SPAN64
    assert fp32 == span64 and fp32["span"] == 64 and fp32["num_warps"] == 4 and fp32["dv_pass"]
    assert tiles(4096, 4096, 64, 256, torch.bfloat16, 50, True) == span64  # 104 MB of slots
    assert tiles(4096, 4096, 64, 256, torch.bfloat16, 50, False) == kernel.LONG_SPAN_K64  # no bias gradient
    assert tiles(4096, 4096, 64, 128, torch.float32) == kernel.LONG_SPAN_K64_ONE_PASS
    assert tiles(1024, 4096, 64, 256, torch.bfloat16) == kernel.SPLIT_SPAN_K64
    assert tiles(1024, 4096, 64, 64, torch.float32) == kernel.SPLIT_SPAN_K64_NARROW
    assert tiles(128, 4096, 64, 64, torch.bfloat16)["span"] == 128


@pytest.mark.parametrize("L,C,dq_atomic,attention,causal", all_pairs(
    [pytest.param(48, None, id="L48-full"), pytest.param(45, 64, id="L45-C64")],
    [pytest.param(True, id="one-pass"), pytest.param(False, id="dq-kernel")], ["softmax", "laplace"], CAUSAL))
def test_one_chunk_span_partials(monkeypatch, L, C, dq_atomic, attention, causal):
    """One chunk holding the whole sequence, with L a multiple of the span and with a chunk longer than L: the
    backward's bias gradient through per-program partials (`fold_span_partials`), every span one row, in the
    one-pass kernel and in the dk/dv kernel after the dq kernel (the carried tile in both: the one pass's ds tiles
    switched off)."""
    monkeypatch.setattr(kernel, "_bwd_config", lambda C, K, V: dict(span=16, BLOCK_M=16, BLOCK_V_MAX=32,
                                                                     num_warps=4, num_stages=1, dq_atomic=dq_atomic,
                                                                     ds_tiles=False))
    folds = []
    monkeypatch.setattr(kernel, "fold_span_partials",
                        lambda *a, f=kernel.fold_span_partials: folds.append(a[0].shape) or f(*a))
    (q, k, v, bias), mask = _case(2, 2, L, 8, 20, C, bias_heads=2)
    kw = dict(chunk_size=C, attention=attention, causal=causal, bias=bias, mask=mask)
    _assert_matches_reference(q, k, v, bias, kw)
    assert folds == [(4, 3, (C or L) + 16)], folds


def _small_tiles(monkeypatch, span, block_m, dq_atomic, ds_tiles=True):
    """16 x 16 forward tiles and a backward of `span`-key spans with `block_m`-query tiles, so that C = 32 holds
    several tiles of each kind."""
    fwd = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_V=32, num_warps=4, num_stages=2)
    bwd = dict(span=span, BLOCK_M=block_m, BLOCK_V_MAX=32, num_warps=4, num_stages=2, dq_atomic=dq_atomic,
               ds_tiles=ds_tiles)
    monkeypatch.setattr(kernel, "_fwd_config", lambda C, K, V: fwd)
    monkeypatch.setattr(kernel, "_bwd_config", lambda C, K, V: bwd)


@pytest.mark.parametrize("span,block_m,dq_atomic,ds_tiles,bias_heads,attention,causal", all_pairs(
    [pytest.param(32, 16, False, True, 2, id="fused"), pytest.param(16, 16, False, True, 2, id="split-dq-kernel"),
     pytest.param(16, 8, True, True, 2, id="split-atomic-dq-ds-tiles-two-a-span"),
     pytest.param(16, 8, True, False, 2, id="split-atomic-dq"),
     pytest.param(16, 16, True, False, 2, id="split-atomic-dq-carry"),
     pytest.param(16, 16, True, True, 0, id="split-atomic-dq-ds-tiles-shared-bias")], ATTENTION, CAUSAL))
def test_tiles_inside_chunks(monkeypatch, span, block_m, dq_atomic, ds_tiles, bias_heads, attention, causal):
    """Tiles that divide the chunk (C = 32, tiles of 16 and 8) take the ALIGNED path: no per-pair chunk test and the
    bias read without an index select. A ragged last chunk (L = 70), padded keys, rows without keys and a bias per
    head (or one shared) keep their results, forward and every gradient, through each backward path. The split
    paths' spans tile the chunk, so their bias gradient goes through per-program partials (`fold_span_partials`):
    added to tile by tile with 8-query tiles, and with query tiles as wide as the span through the carried tile,
    in order (dq kernel) and in the rotated order of dq by atomics, which wraps around the chunk. With dq by
    atomics the default is the ds tiles summed by tile diagonal (`fold_ds_tiles`), in slots of the query tile: a
    span of 16 keys over 8-query tiles, whose tiles ask for them (`ds_tiles=True`, as `LONG_SPAN_K64`), adds each
    tile's second half into the next slot."""
    _small_tiles(monkeypatch, span, block_m, dq_atomic, ds_tiles)
    aligned, folds, ds_folds = [], [], []
    monkeypatch.setattr(kernel, "tiles_in_one_chunk",
                        lambda *a, f=kernel.tiles_in_one_chunk: aligned.append(f(*a)) or aligned[-1])
    monkeypatch.setattr(kernel, "fold_span_partials",
                        lambda *a, f=kernel.fold_span_partials: folds.append(a[0].shape) or f(*a))
    monkeypatch.setattr(kernel, "fold_ds_tiles",
                        lambda *a, f=kernel.fold_ds_tiles: ds_folds.append(a[0].shape) or f(*a))
    (q, k, v, bias), mask = _case(2, 2, 70, 8, 20, 32, bias_heads=bias_heads)
    kw = dict(chunk_size=32, attention=attention, causal=causal, bias=bias, mask=mask)
    _assert_matches_reference(q, k, v, bias, kw)
    assert aligned and all(aligned), aligned  # forward and backward launches all took the aligned path
    # split paths: partials of [B H, 3 chunks x 2 spans, C + span], or slots of [B H, 2 C / block_m - 1 tile
    # diagonals, block_m, block_m]
    by_tiles = dq_atomic and ds_tiles
    assert folds == ([] if span == 32 or by_tiles else [(4, 6, 48)]), folds
    assert ds_folds == ([(4, 64 // block_m - 1, block_m, block_m)] if by_tiles else []), ds_folds


@pytest.mark.parametrize("span,block_m,dq_atomic,attention,L,causal,mode", all_pairs(
    [pytest.param(32, 16, False, id="fused"), pytest.param(16, 16, False, id="split-dq-kernel"),
     pytest.param(16, 8, True, id="split-atomic-dq"), pytest.param(16, 16, True, id="split-atomic-dq-carry")],
    ATTENTION, [pytest.param(96, False, 2, id="whole-chunks"), pytest.param(70, False, 1, id="ragged"),
                pytest.param(70, True, 1, id="ragged-causal")]))
def test_aligned_tiles_without_key_mask(monkeypatch, span, block_m, dq_atomic, attention, L, causal, mode):
    """Without a key mask only the tile bounds and the causal test mask scores. A sequence of whole chunks (L = 3 C),
    not causal, takes tile mode 2: every score is valid and the kernels apply no mask. A ragged last chunk keeps
    mode 1, whose row and key bounds alone keep the keys past L out. Forward and every gradient match the
    reference through each backward path, with values wider than one value block."""
    _small_tiles(monkeypatch, span, block_m, dq_atomic)
    modes = []
    monkeypatch.setattr(kernel, "tile_mode", lambda *a, f=kernel.tile_mode: modes.append(f(*a)) or modes[-1])
    (q, k, v, bias), _ = _case(2, 2, L, 8, 40, 32, bias_heads=2, masked=False)
    _assert_matches_reference(q, k, v, bias, dict(chunk_size=32, attention=attention, causal=causal, bias=bias))
    assert modes and all(m == mode for m in modes), modes


def test_tile_mode():
    """Mode 2 (no score masked) only for whole chunks, not causal, no key mask; else 1 for tiles inside one chunk, 0
    for tiles that may straddle chunks."""
    assert kernel.tile_mode(128, 4096, False, False, 64, 64) == 2
    assert kernel.tile_mode(4096, 4096, False, False, 64, 64) == 2  # full attention: one chunk of L
    assert kernel.tile_mode(128, 4096, True, False, 64, 64) == 1
    assert kernel.tile_mode(128, 4096, False, True, 64, 64) == 1
    assert kernel.tile_mode(128, 4000, False, False, 64, 64) == 1  # a ragged last chunk
    assert kernel.tile_mode(1024, 1000, False, False, 64, 64) == 1  # a chunk longer than the sequence
    assert kernel.tile_mode(96, 960, False, False, 64, 64) == 0
    # a packed sequence (the slots' chunk rounded up to whole spans, the rows' counts anywhere): 2 unless causal
    assert kernel.packed_tile_mode(1024, False, 64, 128, 128) == 2
    assert kernel.packed_tile_mode(1024, True, 64, 128, 128) == 1
    assert kernel.packed_tile_mode(96, False, 64, 64) == 0


@pytest.mark.parametrize("attention,causal,bias_heads", all_pairs(
    ATTENTION, CAUSAL, [pytest.param(0, id="shared-bias"), pytest.param(2, id="head-bias")]))
def test_forward_bias_table(monkeypatch, attention, causal, bias_heads):
    """The forward reading its bias tiles from `bias_table` (chunks >= 256 by default; here C = 32 with 16 x 16
    tiles) gives bitwise the output and statistics of the gather from the bias, with a ragged last chunk, padded
    keys and rows without keys; and the table's tile d is the Toeplitz block d - (C / 16 - 1) tiles right of the
    diagonal."""
    fwd = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_V=32, num_warps=4, num_stages=2)
    (q, k, v, bias), mask = _case(2, 2, 70, 8, 20, 32, bias_heads=bias_heads)
    b32 = bias.detach().float().reshape(-1, 63).contiguous()
    args = [t.detach().float().contiguous() for t in (q, k, v)] + [b32, (mask if mask is None else mask.to(torch.uint8))]
    kw = dict(attention=attention, causal=causal, chunk=32, scale=8 ** -0.5, cfg=fwd)
    monkeypatch.setattr(kernel, "use_bias_table", lambda C, M, N: False)
    o_gather, stat_gather = kernel.local_attention_fwd(*args, **kw)
    tables = []
    monkeypatch.setattr(kernel, "use_bias_table", lambda C, M, N: tables.append((C, M, N)) or True)
    o_table, stat_table = kernel.local_attention_fwd(*args, **kw)
    assert tables == [(32, 16, 16)]
    assert torch.equal(o_table, o_gather) and torch.equal(stat_table, stat_gather)
    ref = local_attention_ref(q, k, v, chunk_size=32, attention=attention, causal=causal, bias=bias, mask=mask,
                              scale=8 ** -0.5)
    assert rel_error(o_table, ref) < 1e-5

    tab = kernel.bias_table(b32, 32, 16, 16)
    assert tab.shape == (b32.shape[0], 3, 16, 16)
    full = b32[:, 31 + torch.arange(32)[None, :] - torch.arange(32)[:, None]]  # [G, 32 queries, 32 keys]
    for d, (r0, c0) in enumerate([(16, 0), (0, 0), (0, 16)]):  # key tile 1 left, on, 1 right of the query tile
        assert torch.equal(tab[:, d], full[:, r0:r0 + 16, c0:c0 + 16])
    assert torch.equal(kernel.bias_table(b32, 32, 16, 16, transposed=True), tab.transpose(-1, -2))  # [keys, queries]


def test_bias_table_only_for_long_aligned_chunks():
    assert kernel.use_bias_table(256, 64, 64) and kernel.use_bias_table(1024, 64, 64)
    assert not kernel.use_bias_table(128, 64, 64)  # every program would read the same three tiles
    assert not kernel.use_bias_table(1000, 64, 64)  # tiles cross chunk boundaries
    assert not kernel.use_bias_table(256, 128, 64)


@pytest.mark.parametrize("per_head", [True, False], ids=["head-bias", "shared-bias"])
def test_fold_span_partials_equals_scatter(per_head):
    """Each program's partial entry x is tap x + n0 % C of its bias's gradient (n0 the program's first key)."""
    B, H, chunks, C, span = 2, 3, 3, 32, 8
    R = C // span
    part = torch.randn(B * H, chunks * R, C + span, dtype=torch.float64)
    want = torch.zeros(H if per_head else 1, 2 * C + span, dtype=torch.float64)
    for bh in range(B * H):
        for row in range(chunks * R):
            want[bh % H if per_head else 0, (row % R) * span:(row % R) * span + C + span] += part[bh, row]
    got = kernel.fold_span_partials(part, B, chunks, per_head, C, span)
    assert got.shape == (H if per_head else 1, 2 * C - 1)
    torch.testing.assert_close(got, want[:, :2 * C - 1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_head", [True, False], ids=["head-bias", "shared-bias"])
def test_fold_ds_tiles_equals_scatter(per_head):
    """Element (c, r) of slot d, the [keys, queries] ds tiles whose key tile starts (d - (T - 1)) S right of their
    query tile, is tap (C - 1) + (d - (T - 1)) S + c - r of the bias's gradient."""
    B, H, C, S = 2, 3, 32, 8
    T = C // S
    tiles = torch.randn(B * H, 2 * T - 1, S, S, dtype=torch.float64)
    want = torch.zeros(H if per_head else 1, 2 * C - 1, dtype=torch.float64)
    for bh, d, c, r in itertools.product(range(B * H), range(2 * T - 1), range(S), range(S)):
        want[bh % H if per_head else 0, (C - 1) + (d - (T - 1)) * S + c - r] += tiles[bh, d, c, r]
    got = kernel.fold_ds_tiles(tiles, B, per_head)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_tiles_in_one_chunk():
    """Both tile sizes must divide the chunk, and the backward's key span must be a whole number of key tiles; the
    default tiles of MEGA-chunk's C = 128 (64 x 64 forward, 128-key spans of 32- or 64-query tiles backward)
    qualify."""
    assert kernel.tiles_in_one_chunk(128, 64, 64) and kernel.tiles_in_one_chunk(128, 32, 128, 128)
    assert not kernel.tiles_in_one_chunk(96, 64, 64)  # a 64-tile would cross the chunk boundary at 96
    assert not kernel.tiles_in_one_chunk(64, 32, 128, 128)  # a 128-key span holds two chunks of 64
    assert not kernel.tiles_in_one_chunk(128, 32, 64, 96)  # spans of 96 start key tiles off the 64 grid


def test_bias_without_grad():
    """A bias that needs no gradient skips the bias-gradient pass (BIAS_GRAD off) and leaves dq, dk, dv as they are."""
    (q, k, v, bias), mask = _case(2, 2, 50, 8, 20, 16)
    bias = bias.detach()
    kw = dict(chunk_size=16, attention="softmax", causal=False, bias=bias, mask=mask)
    ref = local_attention_ref(q, k, v, **kw)
    tri = local_attention(q, k, v, backend="triton", **kw)
    do = torch.randn_like(ref)
    for name, a, b in zip(("dq", "dk", "dv"), torch.autograd.grad(tri, [q, k, v], do),
                          torch.autograd.grad(ref, [q, k, v], do)):
        assert rel_error(a, b) < 1e-5, name


def test_rows_without_keys_output_zero():
    (q, k, v, bias), mask = _case(2, 1, 40, 8, 8, 16)
    out = local_attention(q, k, v, chunk_size=16, attention="softmax", mask=mask, backend="triton")
    assert torch.all(out[1, :, 16:] == 0)


@pytest.mark.parametrize("attention", ["softmax", "laplace"])
@pytest.mark.parametrize("two_pass", [False, True], ids=["chunks-of-8", "full-two-pass"])
def test_dropout_mask_is_shared_by_forward_and_backward(monkeypatch, attention, two_pass):
    """The kernel's Philox mask, read out by attending to the identity, reproduces its forward and gradients: in
    chunks of 8, and at full length through the two-pass backward, whose dv pass draws the mask again."""
    (q, k, v, bias), mask = _case(1, 2, 24, 8, 8, 24 if two_pass else 8, masked=False)
    if two_pass:
        grids = _two_pass(monkeypatch)
    p = 0.3
    kw = dict(chunk_size=None if two_pass else 8, attention=attention, bias=bias)
    eye = torch.eye(24, dtype=torch.float64).expand(1, 2, 24, 24)
    with torch.no_grad():
        torch.manual_seed(5)
        dropped = local_attention(q, k, eye, dropout=p, backend="triton", **kw)  # [B, H, L, L] dropped weights
        weights = local_attention_ref(q, k, eye, **kw)
    valid = weights != 0
    keep = (dropped != 0) & valid
    torch.testing.assert_close(dropped[keep], weights[keep] / (1 - p), rtol=1e-5, atol=1e-6)
    assert 0.1 < 1 - keep.sum().item() / valid.sum().item() < 0.5  # about p of the weights dropped
    torch.manual_seed(5)
    tri = local_attention(q, k, v, dropout=p, backend="triton", **kw)
    ref = torch.matmul(local_attention_ref(q, k, eye, **kw) * keep / (1 - p), v)
    do = torch.randn_like(ref)
    assert rel_error(tri, ref) < 1e-5, "o"
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), torch.autograd.grad(tri, [q, k, v, bias], do),
                          torch.autograd.grad(ref, [q, k, v, bias], do)):
        assert rel_error(a, b) < 1e-5, name
    if two_pass:
        assert len(grids) == 1, grids


def test_dropout_needs_a_device_seed():
    """The kernels read the Philox seed from device memory: a launch with dropout and no seed tensor is refused, and
    the seed's value picks the mask."""
    (q, k, v, _), _ = _case(1, 1, 16, 8, 8, 8, masked=False)
    q, k, v = (t.float().contiguous() for t in (q, k, v))
    kw = dict(attention="softmax", causal=False, chunk=8, scale=1.0)
    with pytest.raises(ValueError, match="Philox seed"):
        kernel.local_attention_fwd(q, k, v, None, None, dropout=0.2, **kw)
    a, _ = kernel.local_attention_fwd(q, k, v, None, None, dropout=0.2, seed=torch.tensor([7]), **kw)
    b, _ = kernel.local_attention_fwd(q, k, v, None, None, dropout=0.2, seed=torch.tensor([7]), **kw)
    c, _ = kernel.local_attention_fwd(q, k, v, None, None, dropout=0.2, seed=torch.tensor([8]), **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("L,chunk", [(64, 32), (256, None)], ids=["chunks-of-32", "full-two-pass"])
def test_dropout_draws_a_new_mask_per_cuda_graph_replay(monkeypatch, L, chunk):
    """The seed is drawn by a kernel inside the graph and loaded by the attention kernels, so each replay of a
    captured forward + backward drops a new mask, and each replay's backward uses its own forward's mask: the output
    is linear in v (o = W v), so <o, do> = <v, W^T do> = <v, dv> holds only when both passes drop the same weights.
    In chunks of 32 (the fused backward) and at full length 256 through the two-pass backward's tiles
    (`LONG_SPAN_K64`, which the default gives values wider than 128), whose dv pass draws the mask again."""
    launches = []
    if chunk is None:
        monkeypatch.setattr(kernel, "_bwd_config", lambda C, K, V: dict(kernel.LONG_SPAN_K64))
        jit = kernel._local_attention_bwd_dv_kernel
        monkeypatch.setattr(kernel, "_local_attention_bwd_dv_kernel",
                            type("Spy", (), {"__getitem__": lambda self, grid: launches.append(grid) or jit[grid]})())
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 16, device="cuda", generator=g, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 2, L, 16, device="cuda", generator=g)

    def step():
        out = local_attention(q, k, v, chunk_size=chunk, dropout=0.5, backend="triton")
        (dv,) = torch.autograd.grad(out, v, do)
        return out, dv

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, dv = step()
    replays = []
    for _ in range(2):
        graph.replay()
        replays.append((out.clone(), dv.clone()))
    assert not torch.equal(replays[0][0], replays[1][0]), "two replays dropped the same mask"
    for o, d in replays:
        torch.testing.assert_close((o * do).sum(), (v.detach() * d).sum(), rtol=1e-4, atol=1e-4)
    assert bool(launches) == (chunk is None), launches


def test_rejects_bad_inputs():
    q = torch.randn(1, 1, 10, 4)
    with pytest.raises(ValueError, match="2C-1"):
        local_attention(q, q, q, chunk_size=4, bias=torch.zeros(5), backend="torch")
    with pytest.raises(ValueError, match="attention="):
        local_attention(q, q, q, attention="sigmoid", backend="torch")
    with pytest.raises(ValueError, match="dropout"):
        local_attention(q, q, q, dropout=1.0, backend="torch")


def test_no_grad_path_equals_the_autograd_path():
    """Under no_grad the op launches the forward kernel without an autograd node; the output is the same."""
    (q, k, v, bias), mask = _case(2, 1, 40, 16, 16, 16, masked=True)
    kw = dict(chunk_size=16, attention="laplace", bias=bias, mask=mask, backend="triton")
    with_grad = local_attention(q, k, v, **kw)
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        without = local_attention(q, k, v, **kw)
    assert without.grad_fn is None
    torch.testing.assert_close(without, with_grad.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("attention", ["relu2", "laplace"])
@pytest.mark.parametrize("causal", CAUSAL)
def test_float64_reference_divides_by_the_row_count_in_float64(attention, causal):
    """The float64 reference against a loop over queries and keys, to float64's precision: element attention divides
    each score by n (the chunk's real keys, or the position in the chunk + 1 when causal), and the reference's 1/n was
    float32 (1/3 off by 1e-8 relative) whatever its inputs."""
    from longmixer.ops.common import laplace
    from longmixer.ops.local_attention.reference import default_scale, relu2

    B, H, L, K, V, C = 2, 1, 7, 4, 3, 3
    (q, k, v, bias), _ = _case(B, H, L, K, V, C, masked=False)
    q, k, v, bias = (t.detach() for t in (q, k, v, bias))
    mask = torch.tensor([[True] * 7, [True, True, False, True, True, True, False]])
    phi = relu2 if attention == "relu2" else laplace
    scale = default_scale(attention, K)
    want = torch.zeros(B, H, L, V, dtype=torch.float64)
    for b, i in itertools.product(range(B), range(L)):
        start = i // C * C
        keys = [j for j in range(start, min(start + C, L)) if mask[b, j] and (not causal or j <= i)]
        n = i - start + 1 if causal else max(sum(bool(mask[b, j]) for j in range(start, min(start + C, L))), 1)
        for j in keys:
            s = (q[b, 0, i] @ k[b, 0, j]) * scale / n + bias[(C - 1) + j - i]
            want[b, 0, i] += phi(s) * v[b, 0, j]
    got = local_attention_ref(q, k, v, chunk_size=C, attention=attention, causal=causal, bias=bias, mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
