"""layers/sma: compress / extract, the latent configurator's routers and schedules, and the attention-span statistic."""

import math

import pytest
import torch

from longmixer.layers.sma import ROUTERS, LatentConfigurator, attention_span, compress, extract, gumbel_temperature
from longmixer.ops.sparse_local_attention import packed_index


def test_compress_then_extract_restores_active_and_zeros_rest():
    x = torch.randn(4, 17, 6)
    active = torch.rand(4, 17) < 0.4
    active[3] = False  # a row with zero activation
    xc, positions, cmask = compress(x, active)
    y = extract(xc, active)
    torch.testing.assert_close(y[active], x[active])
    assert (y[~active] == 0).all()
    assert (positions[cmask] == active.nonzero()[:, 1]).all(), "original positions are carried in order"


def test_compress_zero_activation_batch():
    x = torch.randn(2, 5, 3)
    active = torch.zeros(2, 5, dtype=torch.bool)
    xc, positions, cmask = compress(x, active)
    assert xc.shape == (2, 0, 3) and positions.shape == (2, 0) and cmask.shape == (2, 0)
    assert (extract(xc, active) == 0).all()


@pytest.mark.parametrize("router", ROUTERS)
def test_configurator_outputs(router):
    torch.manual_seed(0)
    conf = LatentConfigurator(16, num_modules=2, router=router, init_temp_scale=0.3)
    h = torch.randn(3, 9, 16) * 10
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[0, 5:] = False
    active, c = conf(h, mask)
    assert active.shape == c.shape == (3, 9, 2) and active.dtype == torch.bool
    assert not active[0, 5:].any(), "padding is never activated"
    assert (c[~active] == 0).all() and (c[active] >= 0.5).all(), "c = max_i p_i on active tokens, 0 elsewhere"


def test_tempered_softmax_init_and_gradient_only_through_confidence():
    conf = LatentConfigurator(25, router="softmax", init_temp_scale=0.4)
    assert math.isclose(conf.log_temp.exp().item(), 0.4 * 5.0, rel_tol=1e-6), "tau_0 = alpha sqrt(D)"
    h = torch.randn(2, 7, 25)
    active, c = conf(h)
    assert not active.requires_grad
    c.sum().backward()
    assert conf.proj.weight.grad.abs().sum() > 0 and conf.log_temp.grad is not None


def test_gumbel_annealing_schedule():
    assert gumbel_temperature(0) == 2.0
    assert math.isclose(gumbel_temperature(100_000), 2 * 0.999995 ** 100_000)
    assert gumbel_temperature(10_000_000) == 0.5
    conf = LatentConfigurator(8, router="gumbel")
    conf.set_progress(200_000, 400_000)
    assert math.isclose(float(conf.gumbel_tau), gumbel_temperature(200_000), rel_tol=1e-6)
    assert "gumbel_tau" not in conf.state_dict(), "derived from the step: not a checkpoint entry"
    conf.eval()
    h = torch.randn(2, 5, 8)
    torch.testing.assert_close(conf(h)[1], conf(h)[1]), "no noise in eval mode"


def _span_bruteforce(active, window, chunk, causal):
    spans = []
    for row in active:
        pos = row.nonzero().squeeze(-1)
        r = pos.numel()
        for i in range(r):
            keys = []
            for j in range(r):
                d = j - i
                ok = True
                if window is not None:
                    ok = (-window <= d <= 0) if causal else (abs(d) <= window // 2)
                if chunk is not None:
                    ok = i // chunk == j // chunk
                if causal:
                    ok = ok and d <= 0
                if ok:
                    keys.append(abs(pos[j] - pos[i]).item())
            spans.append(sum(keys) / len(keys))
    return sum(spans) / max(len(spans), 1)


@pytest.mark.parametrize("window,chunk,causal", [(4, None, False), (3, None, True), (None, 3, False),
                                                 (None, 3, True), (None, None, False), (None, None, True)])
def test_attention_span_matches_bruteforce(window, chunk, causal):
    g = torch.Generator().manual_seed(0)
    active = torch.rand(3, 23, generator=g) < 0.5
    active[2] = False
    idx, count = packed_index(active)
    span = attention_span(idx, count, window, chunk, causal)
    assert math.isclose(span.item(), _span_bruteforce(active, window, chunk, causal), rel_tol=1e-5)


@pytest.mark.parametrize("window,chunk,causal", [(4, None, False), (None, 3, True), (None, None, False)])
def test_attention_span_prefix_sum_reads_no_row_count(window, chunk, causal):
    """Regression: SeqBoat and SeqBoat-full failed to compile at 16K tokens, batch 2 on an H100 (torch 2.11,
    "list indices must be integers or slices, not NoneType"). Inductor splits a scan that long over several
    programs, and torch 2.11's split-scan codegen fails on an operand indexed by the row alone (pytorch#180221);
    the prefix sum of positions read `count[:, None]` through its validity mask. It now reads `idx` alone
    (tests/test_compile.py::test_seqboat_block_codegen_at_16k checks the generated kernels)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.Generator().manual_seed(0)
    idx, count = packed_index(torch.rand(2, 23, generator=g) < 0.5)
    graph = make_fx(lambda i, c: attention_span(i, c, window, chunk, causal))(idx, count).graph
    count_input = [n for n in graph.nodes if n.op == "placeholder"][1]

    def reads(node, target, seen=None):
        seen = set() if seen is None else seen
        if node is target:
            return True
        seen.add(node)
        return any(reads(a, target, seen) for a in node.all_input_nodes if a not in seen)

    scans = [n for n in graph.nodes if n.target == torch.ops.aten.cumsum.default]
    assert scans
    assert not any(reads(scan, count_input) for scan in scans)


def test_gumbel_temperature_is_read_by_a_compiled_router_without_recompiling():
    """The annealed temperature is a buffer updated in place, so a compiled router follows it step by step from one
    graph (a float attribute would be a constant of the graph: a recompile per step, frozen under CUDA graphs)."""
    torch._dynamo.reset()
    conf = LatentConfigurator(8, router="gumbel").eval()  # eval: no noise, outputs comparable
    h = torch.randn(2, 5, 8)
    graphs = []

    def counting_backend(gm, example_inputs):  # called once per graph compiled
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(conf.probabilities, backend=counting_backend)
    for step in (0, 300_000, 600_000):
        conf.set_progress(step, 1_000_000)
        torch.testing.assert_close(compiled(h), conf.probabilities(h))
    assert len(graphs) == 1, f"{len(graphs)} graphs compiled for 3 temperatures"
