"""ChunkedAttention (longmixer.layers.attention) against straightforward per-element formulas (MEGA section 3)."""

import math

import pytest
import torch

from longmixer.layers.attention import ChunkedAttention
from longmixer.ops.local_attention import laplace, relu2


def _loop_attention(q, k, v, C, attention, causal, bias, mask):
    """out_i = sum_j w_ij v_j over keys j of i's chunk, one (b, i) at a time."""
    B, H, L, K = q.shape
    out = torch.zeros(B, H, L, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for i in range(L):
            c0 = (i // C) * C
            keys = [j for j in range(c0, min(c0 + C, L)) if (not causal or j <= i) and bool(mask[b, j])]
            if not keys:
                continue
            n = (i - c0 + 1) if causal else sum(bool(mask[b, j]) for j in range(c0, min(c0 + C, L)))
            idx = torch.tensor(keys)
            dots = (q[b, :, i:i + 1] * k[b, :, idx]).sum(-1)  # [H, n_keys]
            rel = bias[(C - 1) + idx - i]
            if attention == "softmax":
                w = torch.softmax(dots / math.sqrt(K) + rel, dim=-1)
            elif attention == "relu2":
                w = torch.relu(dots / n + rel) ** 2
            else:
                sigma = math.sqrt(0.25 / math.pi)
                w = 0.5 * (1 + torch.erf((dots / n + rel - math.sqrt(0.5)) / (sigma * math.sqrt(2))))
            out[b, :, i] = (w[..., None] * v[b, :, idx]).sum(1)
    return out


@pytest.mark.parametrize("attention", ["softmax", "relu2", "laplace"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["full", "C5"])
def test_matches_per_element_formula(attention, causal, chunk):
    torch.manual_seed(0)
    B, H, L, K, V = 2, 1, 13, 4, 3
    q, k, v = torch.randn(B, H, L, K), torch.randn(B, H, L, K), torch.randn(B, H, L, V)
    q, k, v = q.double(), k.double(), v.double()
    C = L if chunk is None else chunk
    bias = torch.randn(2 * C - 1, dtype=torch.float64) * 0.3
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 9:] = False
    layer = ChunkedAttention(attention, chunk, causal=causal, backend="torch")
    torch.testing.assert_close(layer(q, k, v, bias, mask), _loop_attention(q, k, v, C, attention, causal, bias, mask))


def test_activation_values():
    s = torch.tensor([-1.0, 0.0, math.sqrt(0.5), 3.0], dtype=torch.float64)
    torch.testing.assert_close(relu2(s), torch.tensor([0.0, 0.0, 0.5, 9.0], dtype=torch.float64))
    lap = laplace(s)
    assert lap[2] == pytest.approx(0.5) and lap[0] < 1e-6 and lap[3] > 1 - 1e-12
    assert lap[1] == pytest.approx(0.5 * (1 + math.erf(-math.sqrt(0.5) / (math.sqrt(0.25 / math.pi) * math.sqrt(2)))))


def test_rejects_unknown_attention():
    with pytest.raises(ValueError, match="attention"):
        ChunkedAttention("sigmoid")
