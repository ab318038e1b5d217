"""LaS attention op: the materialized reference (eq. 3) against a loop oracle, the separable form against the
materialized one, and both Triton paths (prep + SDPA, flash kernel) forward and backward under the interpreter."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from longmixer.ops.las_attention import las_attention, las_attention_ref, las_attention_separable_ref, smooth_values
from longmixer.ops.las_attention.function import las_attention_flash, las_attention_separable


def _qkv(B, H, L, K, dtype=torch.float64, seed=0, Kv=None):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, d, generator=g, dtype=dtype) for d in (K, K, Kv or K)]


def _loop_oracle(q, k, v, alpha, P, causal_pool):
    """Eq. 3 one row at a time: decayed logits for j <= i, softmax, pool the row over P keys (zero padded), @ V."""
    B, H, L, K = q.shape
    out = torch.zeros(B, H, L, v.shape[-1], dtype=q.dtype)
    lo = -(P - 1) if causal_pool else -((P - 1) // 2)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                logits = torch.stack([math.exp(-float(alpha[h]) * (i - j)) * (q[b, h, i] @ k[b, h, j]) / math.sqrt(K)
                                      for j in range(i + 1)])
                row = torch.zeros(L, dtype=q.dtype)
                row[: i + 1] = torch.softmax(logits, 0)
                pooled = torch.zeros(L, dtype=q.dtype)
                for j in range(L):  # pooled[j] averages row over the window of column j
                    idx = [j - lo - w for w in range(P)] if causal_pool else [j + lo + w for w in range(P)]
                    pooled[j] = sum(row[t] for t in idx if 0 <= t < L) / P
                out[b, h, i] = pooled @ v[b, h]
    return out


@pytest.mark.parametrize("P,causal_pool", [(1, False), (3, False), (5, False), (3, True)], ids=str)
def test_reference_matches_loop_oracle(P, causal_pool):
    q, k, v = _qkv(1, 2, 9, 3)
    alpha = torch.tensor([0.0, 0.4], dtype=torch.float64)
    got = las_attention_ref(q, k, v, alpha, pool_size=P, causal_pool=causal_pool)
    torch.testing.assert_close(got, _loop_oracle(q, k, v, alpha, P, causal_pool), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("P", [3, 5])
def test_centred_pooling_is_torch_avgpool(P):
    """The paper's AP is PyTorch's AvgPool1d(P, stride 1, padding P // 2) (count_include_pad default) on each row."""
    a = torch.rand(4, 7, 11, dtype=torch.float64)
    v = torch.randn(4, 11, 5, dtype=torch.float64)
    pooled = torch.nn.AvgPool1d(P, stride=1, padding=P // 2)(a)  # [4, 7, 11]
    torch.testing.assert_close(pooled @ v, a @ smooth_values(v[None], P, False)[0])


@pytest.mark.parametrize("L", [1, 17, 64, 130])
@pytest.mark.parametrize("P,causal_pool", [(1, False), (3, False), (5, False), (3, True), (7, True)], ids=str)
@pytest.mark.parametrize("alphas", [(0.0, 0.0), (0.0, 0.01), (0.05, 0.3)], ids=str)
def test_separable_equals_materialized(L, P, causal_pool, alphas):
    """V-smoothed, q/k-scaled causal attention == AP(softmax(ELD * S)) V, float64."""
    q, k, v = _qkv(2, 2, L, 8, Kv=6)
    alpha = torch.tensor(alphas, dtype=torch.float64)
    ref = las_attention_ref(q, k, v, alpha, pool_size=P, causal_pool=causal_pool)
    sep = las_attention_separable_ref(q, k, v, alpha, pool_size=P, causal_pool=causal_pool)
    torch.testing.assert_close(sep, ref, rtol=1e-10, atol=1e-10)


def test_alpha0_p1_is_causal_softmax_attention():
    q, k, v = _qkv(2, 3, 33, 8)
    ref = las_attention_ref(q, k, v, torch.zeros(3, dtype=torch.float64), pool_size=1)
    torch.testing.assert_close(ref, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_decay_multiplies_logits_not_adds():
    """A huge alpha drives off-diagonal logits to 0 (not to -inf): the row becomes softmax([0, ..., 0, s_ii])."""
    q, k, v = _qkv(1, 1, 6, 4)
    ref = las_attention_ref(q, k, v, torch.tensor([60.0], dtype=torch.float64))
    s_ii = (q * k).sum(-1) / 2.0  # [1, 1, 6]
    for i in range(6):
        w = torch.ones(i + 1, dtype=torch.float64)
        w[i] = torch.exp(s_ii[0, 0, i])
        torch.testing.assert_close(ref[0, 0, i], (w / w.sum()) @ v[0, 0, : i + 1])


# Triton paths under the interpreter: float32 against the float64 reference. Small shapes; ragged tails.
TRITON_CASES = [
    pytest.param(1, 2, 37, 20, 20, 3, False, (0.0, 0.05), id="B1-H2-L37-K20-P3"),
    pytest.param(2, 1, 64, 16, 16, 5, True, (0.02,), id="B2-H1-L64-K16-P5-causalpool"),
    pytest.param(1, 2, 45, 8, 8, 5, False, (0.0, 0.03), id="B1-H2-L45-K8-P5"),  # LaS Text's head width
    pytest.param(1, 2, 33, 8, 24, 3, False, (0.0, 0.03), id="B1-H2-L33-K8-V24-P3"),  # values wider than keys
]

PATHS = {
    "separable-sdpa": las_attention_separable,
    "separable-triton": lambda *a, **kw: las_attention_separable(*a, attention="triton", **kw),
    "flash": las_attention_flash,
}


@pytest.mark.parametrize("path,one_pass", [("separable-sdpa", False), ("separable-triton", True),
                                           ("separable-triton", False), ("flash", True), ("flash", False)],
                         ids=["separable-sdpa", "separable-triton-dq-atomic", "separable-triton-dq-kernel",
                              "flash-dq-atomic", "flash-dq-kernel"])
@pytest.mark.parametrize("B,H,L,K,V,P,causal_pool,alphas", TRITON_CASES)
def test_triton_parity_fwd_bwd(path, one_pass, B, H, L, K, V, P, causal_pool, alphas, monkeypatch):
    """Every Triton path, with the flash backward's dq taken either way (`one_pass`: atomics in the dk/dv kernel, or
    the dq kernel), against the float64 reference. SDPA's backward is PyTorch's, so it runs once."""
    from longmixer.ops.las_attention import kernel

    monkeypatch.setattr(kernel, "one_pass_backward", lambda K, dtype: one_pass)
    path = PATHS[path]
    q, k, v = (t.requires_grad_() for t in _qkv(B, H, L, K, seed=1, Kv=V))
    alpha = torch.tensor(alphas, dtype=torch.float64)
    ref = las_attention_ref(q, k, v, alpha, pool_size=P, causal_pool=causal_pool)
    do = torch.randn_like(ref)
    grads_ref = torch.autograd.grad(ref, (q, k, v), do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = path(q32, k32, v32, alpha.float(), pool_size=P, causal_pool=causal_pool)
    grads = torch.autograd.grad(out, (q32, k32, v32), do.float())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5, msg="o")
    for name, g, gr in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(g.double(), gr, rtol=1e-4, atol=1e-5, msg=name)


def test_flash_kernel_survives_large_alpha():
    """alpha * L far outside exp's range: the separable factors would overflow; the per-tile rebase must not."""
    q, k, v = (t.requires_grad_() for t in _qkv(1, 3, 40, 16, seed=2))
    alpha = torch.tensor([0.0, 3.0, 50.0], dtype=torch.float64)
    ref = las_attention_ref(q, k, v, alpha, pool_size=3)
    do = torch.randn_like(ref)
    grads_ref = torch.autograd.grad(ref, (q, k, v), do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = las_attention(q32, k32, v32, alpha.float(), pool_size=3, backend="triton")  # dispatches to flash
    grads = torch.autograd.grad(out, (q32, k32, v32), do.float())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5, msg="o")
    for name, g, gr in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(g.double(), gr, rtol=1e-4, atol=1e-5, msg=name)


def test_backend_torch_is_reference():
    q, k, v = _qkv(1, 2, 10, 4, dtype=torch.float32)
    alpha = torch.tensor([0.0, 0.1])
    torch.testing.assert_close(las_attention(q, k, v, alpha, pool_size=3, backend="torch"),
                               las_attention_ref(q, k, v, alpha, pool_size=3))


@pytest.mark.parametrize("kwargs,match", [
    (dict(pool_size=4), "pool_size=4"),
    (dict(alpha=torch.tensor([0.0, -0.1])), "alpha must be >= 0"),
    (dict(max_alpha=-0.1), "max_alpha=-0.1"),
    (dict(alpha=torch.zeros(3)), "one decay rate per head"),
    (dict(backend="cuda"), "ops.backend='cuda'"),
], ids=["even-P", "negative-alpha", "negative-max-alpha", "alpha-shape", "bad-backend"])
def test_errors_name_the_value(kwargs, match):
    q, k, v = _qkv(1, 2, 8, 4, dtype=torch.float32)
    kwargs = {"alpha": torch.zeros(2), **kwargs}
    with pytest.raises(ValueError, match=match):
        las_attention(q, k, v, **kwargs)


def test_one_pass_backward_matches_two_kernels(monkeypatch):
    """dq by atomics from the dk/dv kernel equals dq from its own kernel, and the one-pass backward launches no dq
    kernel."""
    from longmixer.ops.las_attention import kernel

    q, k, v = (t.float().contiguous() for t in _qkv(1, 2, 40, 8, seed=4))
    alpha = torch.tensor([0.0, 0.1])
    o, lse = kernel.las_attention_fwd(q, k, v, alpha, 8 ** -0.5)
    do = torch.randn_like(o)
    launched = []
    real = kernel._las_attention_bwd_dq_kernel
    monkeypatch.setattr(kernel, "_las_attention_bwd_dq_kernel",
                        type("Spy", (), {"__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    grads = {one_pass: kernel.las_attention_bwd(q, k, v, alpha, o, lse, do, 8 ** -0.5, one_pass=one_pass)
             for one_pass in (True, False)}
    assert len(launched) == 1, "only the two-kernel backward runs the dq kernel"
    for name, a, b in zip(("dq", "dk", "dv"), grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("decay", [True, False], ids=["decay", "no-decay"])
@pytest.mark.parametrize("one_pass", [True, False], ids=["dq-atomic", "dq-kernel"])
def test_cuda_default_tiles(decay, one_pass):
    """The GPU's 64 x 64 tiles (the interpreter's default is 32 x 16) against the float64 reference: plain causal
    attention without the decay, LaS attention without smoothing with it. L 130 leaves a ragged last tile."""
    from longmixer.ops.las_attention import kernel

    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 130, 8, seed=5, Kv=12))
    alpha = torch.tensor([0.0, 0.05], dtype=torch.float64)
    ref = las_attention_ref(q, k, v, alpha if decay else torch.zeros(2, dtype=torch.float64))
    do = torch.randn_like(ref)
    refs = [ref, *torch.autograd.grad(ref, (q, k, v), do)]
    x = [t.detach().float().contiguous() for t in (q, k, v)]
    o, lse = kernel.las_attention_fwd(*x, alpha.float(), 8 ** -0.5, decay, config=(64, 64, 4, 1))
    grads = kernel.las_attention_bwd(*x, alpha.float(), o, lse, do.float(), 8 ** -0.5, decay,
                                     config=(64, 64, 4, 1), one_pass=one_pass)
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), refs):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg=name)


def test_tiles_must_nest():
    from longmixer.ops.las_attention import kernel

    q = torch.zeros(1, 1, 8, 8)
    with pytest.raises(ValueError, match=r"outer tile \(32\) must be a multiple of the inner \(64\)"):
        kernel.las_attention_fwd(q, q, q, torch.zeros(1), 1.0, config=(32, 64, 4, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("one_pass", [True, False], ids=["dq-atomic", "dq-kernel"])
@pytest.mark.parametrize("path", ["separable-triton", "flash"])
def test_narrow_heads_on_a_gpu(path, one_pass, dtype, monkeypatch):
    """The compiled kernels at LaS Text's head width in 16-bit, the backward each way, against float64: the path
    training takes (atomics, 64 x 64 tiles), which the interpreter cannot run."""
    from longmixer.ops.las_attention import kernel

    monkeypatch.setattr(kernel, "one_pass_backward", lambda K, dtype: one_pass)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 1000, 8, device="cuda", dtype=torch.float64, generator=g).requires_grad_()
               for _ in range(3))
    alpha = torch.linspace(0, 1e-3, 8, device="cuda")
    ref = las_attention_ref(q, k, v, alpha.double(), pool_size=5)
    do = torch.randn_like(ref)
    refs = [ref, *torch.autograd.grad(ref, (q, k, v), do)]
    x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = PATHS[path](*x, alpha, pool_size=5)
    got = [out, *torch.autograd.grad(out, x, do.to(dtype))]
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, refs):
        assert a.dtype == dtype, name
        err = float((a.double() - b).norm() / b.norm())
        assert err < 2e-2, f"{name}: relative L2 error {err:.2e}"


def test_one_pass_rule(monkeypatch):
    """Atomics for 16-bit inputs with narrow heads; the dq kernel for float32, wide heads and deterministic mode."""
    from longmixer.ops.las_attention.kernel import ONE_PASS_MAX_K, one_pass_backward

    assert one_pass_backward(8, torch.bfloat16) and one_pass_backward(ONE_PASS_MAX_K, torch.float16)
    assert not one_pass_backward(ONE_PASS_MAX_K + 1, torch.bfloat16)
    assert not one_pass_backward(8, torch.float32) and not one_pass_backward(8, torch.float64)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not one_pass_backward(8, torch.bfloat16)


def test_narrow_heads_take_the_triton_causal_kernel(monkeypatch):
    """In the separable range, heads up to TRITON_CAUSAL_MAX_K wide run the flash kernel without the decay; wider
    heads run SDPA. Decided from the head width, a size."""
    import longmixer.ops.las_attention.function as las_function

    taken = []
    monkeypatch.setattr(las_function, "las_attention_separable",
                        lambda *a, attention, **kw: taken.append(attention))
    for K in (8, las_function.TRITON_CAUSAL_MAX_K, las_function.TRITON_CAUSAL_MAX_K + 1, 64):
        q, k, v = _qkv(1, 2, 9, K, dtype=torch.float32)
        las_function.las_attention(q, k, v, torch.zeros(2), max_alpha=0.0, backend="triton")
    assert taken == ["triton", "triton", "sdpa", "sdpa"]


def test_separable_rejects_an_unknown_attention():
    q, k, v = _qkv(1, 2, 9, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="attention='flex'"):
        las_attention_separable(q, k, v, torch.zeros(2), attention="flex")


def test_path_is_chosen_from_max_alpha_only(monkeypatch):
    """The Triton path never depends on alpha's values: without max_alpha the flash kernel runs (valid for any
    alpha >= 0); with it, the separable path runs while max_alpha (L - 1) / 2 is within the dtype's limit."""
    import longmixer.ops.las_attention.function as las_function

    taken = []
    monkeypatch.setattr(las_function, "las_attention_separable", lambda *a, **kw: taken.append("separable"))
    monkeypatch.setattr(las_function, "las_attention_flash", lambda *a, **kw: taken.append("flash"))
    q, k, v = _qkv(1, 2, 9, 4, dtype=torch.float32)
    for max_alpha in (None, 0.0, 100.0):
        las_function.las_attention(q, k, v, torch.zeros(2), max_alpha=max_alpha, backend="triton")
    assert taken == ["flash", "separable", "flash"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("max_alpha", [None, 0.05], ids=["no-bound", "bound"])
def test_compiles_as_one_graph_without_reading_alpha(backend, max_alpha):
    """Regression: scripts/bench/parity.py compiles las_attention with fullgraph=True and no max_alpha, which failed
    with "Could not guard on data-dependent expression zuf0 < 0.0": the op read max(alpha) on the host and compared
    it (a host sync on CUDA, a data-dependent guard under torch.compile). Path and checks now come from sizes and
    max_alpha only; the compiled forward and backward equal the eager ones."""
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 37, 16, dtype=torch.float32, seed=3))
    alpha = torch.tensor([0.0, 0.05])

    def attend(q, k, v, alpha):
        return las_attention(q, k, v, alpha, pool_size=3, max_alpha=max_alpha, backend=backend)

    torch._dynamo.reset()
    outs = [fn(q, k, v, alpha) for fn in (attend, torch.compile(attend, backend="aot_eager", fullgraph=True))]
    do = torch.randn_like(outs[0])
    grads = [torch.autograd.grad(out, (q, k, v), do) for out in outs]
    torch.testing.assert_close(outs[1], outs[0], msg="o")
    for name, g_c, g_e in zip(("dq", "dk", "dv"), grads[1], grads[0]):
        torch.testing.assert_close(g_c, g_e, msg=name)
    torch._dynamo.reset()


def test_backward_tiles_avoid_float32_spills():
    """float32 heads wider than 16 take 64 x 32 backward tiles (64 x 64 spilled: 4-6x slower on an H100)."""
    from longmixer.ops.las_attention.kernel import _backward_tiles

    def on_cuda(dtype, K):
        t = torch.empty(1, 1, 1, K, dtype=dtype)
        return _backward_tiles(type("CudaLike", (), {"is_cuda": True, "dtype": t.dtype, "shape": t.shape})())

    assert on_cuda(torch.bfloat16, 64) == on_cuda(torch.float32, 16) == (64, 64, 4, 2)
    assert on_cuda(torch.float32, 32) == on_cuda(torch.float32, 64) == (64, 32, 4, 1)
    assert _backward_tiles(torch.empty(1, 1, 1, 64)) == (32, 16, 4, 1)  # the interpreter's
