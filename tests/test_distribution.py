"""At temperature > 0 speculative sampling is distributed exactly as AR sampling (χ² against the exact AR
marginals of the first 4 drafted positions, computed by enumerating every prefix on a 16-token vocabulary), by
chains and by draft trees (ranked siblings on the sampled chain); a chain or tree verifier that skips the
min(1, p/q) test fails the same check."""

import pytest
import torch
from conftest import perturb_writes, tiny_target
from scipy.stats import chisquare

import dspine.reference
from dspine.decoding import DraftTree
from dspine.drafter import DSpineDraftModel
from dspine.reference import speculative_step, speculative_tree_step
from dspine.sampling import SamplingParams, sample, warp_probs
from dspine.verify import verify_sampled, verify_tree_sampled

V, POSITIONS, SAMPLES = 16, 4, 20000
PROMPT = [3, 9, 1, 12, 5, 7]


@pytest.fixture(scope="module")
def peaked_target():
    # a large head scale makes the target's distributions far from uniform (and far from the drafter's)
    return tiny_target("llama", vocab=V, hidden=32, layers=4, head_scale=25.0, seed=5)


def exact_ar_marginals(target, params) -> list[torch.Tensor]:
    """Marginal distribution of each of the first POSITIONS sampled tokens after PROMPT."""
    seqs = torch.tensor([PROMPT])
    joint = torch.ones(1)
    out = []
    for _ in range(POSITIONS):
        logits, _ = target.forward(seqs, None)
        p = warp_probs(logits[:, -1].double(), params)  # (n, V)
        step = joint[:, None] * p  # (n, V)
        out.append(step.sum(0))
        joint = step.reshape(-1)
        seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(seqs.shape[0])[:, None]], 1)
    return out


def speculative_samples(target, drafter, params, verifier, seed=0, tree=None) -> torch.Tensor:
    """(SAMPLES, POSITIONS) tokens drawn by speculative rounds from PROMPT (its last token is the anchor); with
    `tree` by rounds through that draft tree (speculative_tree_step)."""
    gen = torch.Generator().manual_seed(seed)
    got = [[] for _ in range(SAMPLES)]
    while True:
        todo = [i for i, g in enumerate(got) if len(g) < POSITIONS]
        if not todo:
            break
        for n in sorted({len(got[i]) for i in todo}):
            rows = [i for i in todo if len(got[i]) == n]
            seqs = torch.tensor([PROMPT + got[i] for i in rows])
            if tree is not None:
                for i, toks in zip(rows, speculative_tree_step(target, drafter, seqs, tree, params, gen)):
                    got[i] += toks
                continue
            n_acc, drafts, nxt = speculative_step(target, drafter, seqs, params, gen, verifier=verifier)
            for j, i in enumerate(rows):
                got[i] += drafts[j, : n_acc[j]].tolist() + [int(nxt[j])]
    return torch.tensor([g[:POSITIONS] for g in got])


def chi2_pvalues(tokens: torch.Tensor, marginals) -> list[float]:
    ps = []
    for k, m in enumerate(marginals):
        obs = torch.bincount(tokens[:, k], minlength=V).double()
        exp = m.double() * SAMPLES
        if obs[exp == 0].sum() > 0:  # a token the target can never emit here (top-k / top-p cut it)
            ps.append(0.0)
            continue
        big, rare = exp >= 5, (exp > 0) & (exp < 5)  # pool the rare cells so the χ² approximation holds
        o = torch.cat([obs[big], obs[rare].sum()[None]]) if rare.any() else obs[big]
        e = torch.cat([exp[big], exp[rare].sum()[None]]) if rare.any() else exp[big]
        o, e = o.numpy(), e.numpy()
        ps.append(float(chisquare(o, e / e.sum() * o.sum()).pvalue))
    return ps


def broken_verifier(draft, q, p, generator):
    """Accepts every draft without the min(1, p/q) test (then takes the bonus from p)."""
    n_acc = torch.full((draft.shape[0],), draft.shape[1], dtype=torch.long)
    return n_acc, sample(p[:, -1], generator)


def make_drafter(target, method):
    d = DSpineDraftModel.for_target(target, method=method, num_hidden_layers=2, block_size=6, top_k=4, seed=11)
    return perturb_writes(d, std=0.5, seed=3)


CASES = [
    ("dflash", SamplingParams(temperature=1.0)),
    ("post_backbone", SamplingParams(temperature=1.0)),
    ("dspine", SamplingParams(temperature=1.0)),
    ("dspine", SamplingParams(temperature=0.8, top_k=6, top_p=0.9)),
]


@pytest.mark.parametrize("method,params", CASES, ids=[f"{m}-T{p.temperature}-k{p.top_k}" for m, p in CASES])
def test_speculative_sampling_matches_ar(peaked_target, method, params):
    marg = exact_ar_marginals(peaked_target, params)
    assert max(float(m.max()) for m in marg) > 0.3  # the target is far from uniform
    tokens = speculative_samples(peaked_target, make_drafter(peaked_target, method), params, verify_sampled)
    ps = chi2_pvalues(tokens, marg)
    assert min(ps) > 0.01, ps


def test_ar_sampler_matches_exact_marginals(peaked_target):
    """The χ² harness itself: plain AR sampling passes it."""
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(1)
    seqs = torch.tensor([PROMPT]).repeat(SAMPLES, 1)
    for _ in range(POSITIONS):
        logits, _ = peaked_target.forward(seqs, None)
        seqs = torch.cat([seqs, sample(warp_probs(logits[:, -1], params), gen)[:, None]], 1)
    assert min(chi2_pvalues(seqs[:, len(PROMPT) :], exact_ar_marginals(peaked_target, params))) > 0.01


def test_broken_verifier_is_caught(peaked_target):
    params = SamplingParams(temperature=1.0)
    tokens = speculative_samples(peaked_target, make_drafter(peaked_target, "dspine"), params, broken_verifier)
    ps = chi2_pvalues(tokens, exact_ar_marginals(peaked_target, params))
    assert min(ps) < 0.01, ps


@pytest.mark.parametrize("method,spec", [("dspine", "00.1.10"), ("dflash", "0.1.2.01")])
def test_sampled_draft_trees_match_ar(peaked_target, method, spec):
    """The rank-0 chain sampled (through the transition table for DSpine), ranked siblings and their ranked
    children beside it, verified by recursive rejection: AR's marginals."""
    params = SamplingParams(temperature=1.0)
    tree = DraftTree.parse(spec)
    tokens = speculative_samples(peaked_target, make_drafter(peaked_target, method), params, None, tree=tree)
    assert min(chi2_pvalues(tokens, exact_ar_marginals(peaked_target, params))) > 0.01


def test_broken_tree_verifier_is_caught(peaked_target, monkeypatch):
    def accepts_the_sampled_child(tokens, q, parents, p, generator):
        """The sampled child passes without the min(1, p/q) test (q read as zero); ranked ones are tested."""
        return verify_tree_sampled(tokens, [x if x is None else 0 * x for x in q], parents, p, generator)

    monkeypatch.setattr(dspine.reference, "verify_tree_sampled", accepts_the_sampled_child)
    params = SamplingParams(temperature=1.0)
    tree = DraftTree.parse("0.1.2.01")
    tokens = speculative_samples(peaked_target, make_drafter(peaked_target, "dflash"), params, None, tree=tree)
    assert min(chi2_pvalues(tokens, exact_ar_marginals(peaked_target, params))) < 0.01
