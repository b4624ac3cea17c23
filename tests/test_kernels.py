"""Triton kernels against their eager references, over fp32/bf16, batch 1-32, K in {4, 8, 16}, B in {8, 16}.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
the kernels are built); nothing is skipped there. On the GPU (`-m gpu`) the same checks run compiled, and
the engine's fused path is checked token for token against the eager one.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dspine.decoding import (  # noqa: E402
    top_candidates,
    transition_scores,
    walk_greedy,
    walk_sample,
)
from dspine.drafter import Injection, RMSNorm  # noqa: E402
from dspine.kernels.candidates import fused_top_candidates, tiled_top_candidates  # noqa: E402
from dspine.kernels.injection import add_sumsq, fused_injection, injection_variant  # noqa: E402
from dspine.kernels.transition import (  # noqa: E402
    fused_transition_scores,
    fused_walk_greedy,
    fused_walk_sample,
    lowrank_transition_scores,
)
from dspine.sampling import SamplingParams  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
pytestmark = [pytest.mark.gpu] if CUDA else []
# (N, B, K, d, r, s): batch 1-32, both block sizes, K 4-32; the first row is the real target's width
SHAPES = [
    (1, 16, 8, 576, 256, 256),
    (3, 8, 4, 64, 32, 48),
    (32, 8, 16, 64, 32, 32),
    (5, 16, 4, 96, 64, 64),
    (2, 16, 32, 64, 32, 32),
]  # K = 32: the widest walk the recipe evaluates
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative to the largest magnitude


def _inj(d, r, s, dtype, seed):
    torch.manual_seed(seed)
    inj = Injection(d, r, s)
    for p in inj.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return inj.to(DEV, dtype)


def _close(got, ref, dtype):
    scale = ref.float().abs().max().item()
    return (got.float() - ref.float()).abs().max().item() <= TOL[dtype] * max(scale, 1.0)


@pytest.mark.parametrize("variant", ["rows", "split", "gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_injection_matches_reference(shape, dtype, variant):
    N, B, K, d, r, s = shape
    inj = _inj(d, r, s, dtype, N)
    nb = 2 if N < 4 else 1
    h = torch.randn(N, nb, B, d, device=DEV).to(dtype)
    anchor = torch.randn(N, nb, r, device=DEV).to(dtype)
    with torch.no_grad():
        ref_h, ref_f = inj(h, anchor)
        got_h, got_f = fused_injection(inj, h, anchor, variant=variant)
    assert _close(got_h, ref_h, dtype) and _close(got_f, ref_f, dtype)
    assert torch.equal(got_h[:, :, 0], h[:, :, 0])  # the anchor slot is never written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,d", [(16, 576), (3, 100), (32, 2048)])
def test_add_sumsq_matches_reference(rows, d, dtype):
    """SGLang's (h, residual) summed into the stream exactly as torch adds them, |x|² beside it; without a
    residual the input itself comes back. The "gemm" injection reading these sums equals the reference."""
    torch.manual_seed(rows)
    h, res = (torch.randn(rows, d, device=DEV).to(dtype) for _ in range(2))
    x, sq = add_sumsq(h, res)
    if CUDA or dtype == torch.float32:
        assert torch.equal(x, h + res)
    else:  # Triton's interpreter truncates fp32 -> bf16 where compiled kernels round to nearest, as torch does
        torch.testing.assert_close(x, h + res, rtol=2**-7, atol=0)
    assert sq.dtype == torch.float32
    torch.testing.assert_close(sq, x.float().square().sum(-1), rtol=1e-5, atol=1e-3)  # |x|² of the stream given
    x2, sq2 = add_sumsq(h)
    assert x2.data_ptr() == h.data_ptr()
    torch.testing.assert_close(sq2, h.float().square().sum(-1), rtol=1e-5, atol=1e-3)
    if rows % 16 == 0:
        inj = _inj(d, 64, 64, dtype, rows)
        xb, anc = x.view(rows // 16, 1, 16, d), torch.randn(rows // 16, 1, 64, device=DEV).to(dtype)
        with torch.no_grad():
            ref_h, ref_f = inj(xb, anc)
            got_h, got_f = fused_injection(inj, xb, anc, variant="gemm", sumsq=sq)
        assert _close(got_h, ref_h, dtype) and _close(got_f, ref_f, dtype)


def test_injection_variant_is_checked(monkeypatch):
    monkeypatch.delenv("DSPINE_INJECTION", raising=False)
    monkeypatch.delenv("DSPINE_FUSED_MAX_WIDTH", raising=False)
    assert injection_variant() == "split" and injection_variant("rows") == "rows"
    assert injection_variant(width=576) == "split" and injection_variant(width=4096) == "gemm"
    monkeypatch.setenv("DSPINE_INJECTION", "rows")
    assert injection_variant() == "rows"
    monkeypatch.setenv("DSPINE_INJECTION", "fast")
    with pytest.raises(ValueError, match="DSPINE_INJECTION"):
        injection_variant()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_transition_and_walks_match_reference(shape, dtype):
    N, B, K, d, r, s = shape
    V = 4 * K + 37
    inj = _inj(d, r, s, dtype, N + 1)
    norm = RMSNorm(d, 1e-6).to(DEV, dtype)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    g = torch.Generator().manual_seed(N)
    head = torch.randn(V, d, generator=g).to(DEV, dtype)
    codes = torch.randn(V, r, generator=g).to(DEV)
    h_pre = torch.randn(N, B, d, generator=g).to(DEV, dtype)
    f = torch.randn(N, B, r, generator=g).to(DEV, dtype)
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N * (B - 1))]).view(N, B - 1, K).to(DEV)
    with torch.no_grad():
        ref = transition_scores(inj, norm, head, codes, h_pre, f, cand)
        got = fused_transition_scores(inj, norm, head, codes, h_pre, f, cand)
        low = lowrank_transition_scores(inj, norm, head, codes, h_pre, f, cand)
    assert got.shape == low.shape == (N, B - 2, K, K) and _close(got, ref, dtype) and _close(low, ref, dtype)
    # the walks read one score table, so they must agree exactly (jitter: no exact ties, whose order the
    # reference's sort leaves open)
    ref = ref + torch.rand(ref.shape, generator=g).to(DEV) * 1e-3
    assert torch.equal(fused_walk_greedy(cand, ref), walk_greedy(cand, ref))
    first = torch.randint(0, K, (N,), generator=g).to(DEV)
    u = torch.rand(N, B - 2, generator=g).to(DEV)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=max(1, K - 2), top_p=0.85)):
        t_ref, q_ref = walk_sample(cand, ref, first, params, V, None, uniforms=u)
        t_got, q_got = fused_walk_sample(cand, ref, first, params, V, u)
        assert torch.equal(t_got, t_ref)
        assert (q_got - q_ref).abs().max().item() < 1e-5
        assert torch.allclose(q_got.sum(-1), torch.ones_like(q_got.sum(-1)), atol=1e-5)


# (N rows = blocks × (B-1) slots, d, V, K): one block of the real target; ragged V; > 64 rows; K = 32
HEADS = [(15, 576, 49152, 8), (3, 64, 1000, 4), (70, 96, 517, 16), (30, 64, 300, 32)]


@pytest.mark.parametrize("how", [fused_top_candidates, tiled_top_candidates])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", HEADS)
def test_fused_candidates_match_reference(shape, dtype, how):
    N, d, V, K = shape
    g = torch.Generator().manual_seed(V)
    hidden = torch.randn(N, d, generator=g).to(DEV, dtype)
    head = torch.randn(V, d, generator=g).to(DEV, dtype)
    ids, vals = how(hidden, head, K)
    exact = hidden.double() @ head.double().t()  # (N, V): what both approximate
    assert ids.shape == vals.shape == (N, K) and ids.dtype == torch.int64 and vals.dtype == torch.float32
    assert (vals[:, :-1] >= vals[:, 1:]).all()  # best first, as torch.topk: slot 1's draft is ids[:, 0]
    assert all(len(set(row)) == K for row in ids.tolist())
    tol = TOL[dtype] * exact.abs().max().item()
    assert (vals.double() - exact.gather(1, ids)).abs().max().item() <= tol  # the values are those ids' logits
    kth = exact.topk(K, dim=-1).values[:, -1:]
    assert (exact.gather(1, ids) >= kth - 2 * tol).all()  # and they are the K best, up to near-ties
    if dtype == torch.float32:  # no near-ties in fp32 at these sizes: the very same sets, in the same order
        ref_ids, ref_vals = top_candidates(hidden, head, K)
        assert torch.equal(ids, ref_ids) and torch.allclose(vals, ref_vals, rtol=1e-4, atol=1e-4)


def test_candidates_switch_is_checked(monkeypatch):
    from dspine.kernels.candidates import FUSED_MAX_K, choice

    monkeypatch.delenv("DSPINE_CANDIDATES", raising=False)  # auto: fused only as wide as it was measured faster
    assert choice(FUSED_MAX_K) == "fused" and choice(FUSED_MAX_K + 1) == "tiled"
    # at 8B width cuBLAS logits win from 16 blocks of 16 on; at SmolLM2's width the fused head always
    assert [choice(8, n, w) for n, w in ((60, 4096), (240, 4096), (480, 576))] == ["fused", "tiled", "fused"]
    monkeypatch.setenv("DSPINE_CANDIDATES", "fast")
    with pytest.raises(ValueError, match="DSPINE_CANDIDATES"):
        choice(8)
    for mode in ("fused", "tiled", "torch"):
        monkeypatch.setenv("DSPINE_CANDIDATES", mode)
        assert choice(32) == choice(8, 480, 4096) == mode


def test_tiled_candidates_with_ties_and_few_tiles():
    """Tile maxima tied across tiles, a ragged last tile, and fewer tiles than K: still the K best values."""
    hidden = torch.ones(2, 4, device=DEV)
    head = torch.zeros(300, 4, device=DEV)
    head[[5, 130, 299, 7]] = torch.tensor([[1.0] * 4, [1.0] * 4, [2.0] * 4, [0.5] * 4], device=DEV)
    ids, vals = tiled_top_candidates(hidden, head, 3)  # tiles of 128: 5, 7 | 130 | 299 (ragged)
    assert ids[0].tolist()[0] == 299 and sorted(ids[0].tolist()[1:]) == [5, 130] and vals[0].tolist() == [8, 4, 4]
    ids, vals = tiled_top_candidates(hidden, head, 4, tile=128)  # 3 tiles < K: torch.topk over the row
    assert sorted(ids[1].tolist()) == [5, 7, 130, 299] and vals[1].tolist() == [8, 4, 4, 2]


def test_transition_switch_is_checked(monkeypatch):
    from dspine.kernels.transition import LOWRANK_MIN_BLOCKS, lowrank_wanted

    monkeypatch.delenv("DSPINE_TRANSITION", raising=False)
    assert not lowrank_wanted(LOWRANK_MIN_BLOCKS - 1) and lowrank_wanted(LOWRANK_MIN_BLOCKS)
    monkeypatch.setenv("DSPINE_TRANSITION", "lowrank")
    assert lowrank_wanted(1)
    monkeypatch.setenv("DSPINE_TRANSITION", "eager")
    assert not lowrank_wanted(10**6)
    monkeypatch.setenv("DSPINE_TRANSITION", "fast")
    with pytest.raises(ValueError, match="DSPINE_TRANSITION"):
        lowrank_wanted(1)


def test_sampled_walk_takes_each_candidate_with_its_probability():
    """Inverse-CDF draws over many uniforms reproduce q (the kernel's sampler is exact, not just consistent)."""
    K, V = 4, 10
    S = torch.tensor([[[[0.0, 1.0, 2.0, 0.5]] * K]], device=DEV)  # (1, 1, K, K): same row for every predecessor
    cand = torch.tensor([[[0, 1, 2, 3], [4, 5, 6, 7]]], device=DEV)
    u = torch.rand(2000, 1, generator=torch.Generator().manual_seed(0)).to(DEV)
    params = SamplingParams(temperature=1.0)
    toks, q = fused_walk_sample(
        cand.expand(2000, -1, -1),
        S.expand(2000, -1, -1, -1),
        torch.zeros(2000, dtype=torch.long, device=DEV),
        params,
        V,
        u,
    )
    freq = torch.bincount(toks[:, 0].cpu(), minlength=V).float() / 2000
    assert (freq - q[0, 0].cpu()).abs().max() < 0.04


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="compares the engine's fused CUDA path with its eager path")
def test_engine_fused_path_equals_eager_and_ar_on_cuda(monkeypatch):
    """fp32 on the GPU: speculative decoding through the kernels gives AR's tokens, as the eager path does."""
    from conftest import perturb_writes, tiny_target

    from dspine.drafter import DSpineDraftModel
    from dspine.engine import Engine

    target = tiny_target("qwen3", vocab=256, hidden=128)
    target.model.to("cuda")
    drafter = perturb_writes(DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2)).to("cuda")
    drafter.bind(target)
    prompts = [
        [int(x) for x in torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(i))] for i in range(4)
    ]
    ar = [Engine(target).generate(p, SamplingParams(max_tokens=40, ignore_eos=True)).token_ids for p in prompts]
    for flag in ("1", "0"):
        monkeypatch.setenv("DSPINE_KERNELS", flag)
        spec = [
            Engine(target, drafter).generate(p, SamplingParams(max_tokens=40, ignore_eos=True)).token_ids
            for p in prompts
        ]
        assert spec == ar, flag
