"""Suffix drafting (dspine/suffix.py) and the hybrid round: the structures (match, scoring, adaptive depth,
eviction within a budget), the merge into a drafter's tree, greedy output equal to AR's for suffix alone and for
the hybrid (tiny Llama/Qwen3 and SmolLM2; single and batched; chains and trees), χ² against the exact AR marginals
at T > 0 for suffix-only and hybrid proposals, and bad corpus files refused with one clear error."""

import dataclasses
import json

import pytest
import torch
from conftest import CHAT_PROMPTS, brief_train, perturb_writes, tiny_target
from test_distribution import PROMPT, SAMPLES, V, chi2_pvalues, exact_ar_marginals

from dspine.decoding import DraftTree, merge_drafts, tree_depths
from dspine.drafter import DSpineDraftModel
from dspine.engine import Engine, generate_batch
from dspine.reference import speculative_tree_step
from dspine.sampling import SamplingParams, sample, warp_probs
from dspine.suffix import RequestSuffix, SuffixConfig, SuffixCorpus, SuffixDraft, SuffixIndex, draft_from

CFG = SuffixConfig(min_match=1, max_depth=8, max_nodes=12, min_score=0.05)


def test_index_finds_the_longest_match_and_its_recent_continuations():
    idx = SuffixIndex(max_match=4)
    s = idx.add([1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 5, 2, 3, 8])
    n, conts = idx.continuations([4, 1, 2, 3], SuffixConfig(min_match=1, max_depth=3))
    assert n == 3 and conts == [[7, 7, 5], [9, 9, 1]]  # "1 2 3" twice, most recent first; "2 3" alone is shorter
    assert idx.continuations([6, 6], SuffixConfig(min_match=1)) == (0, [])
    idx.extend(s, [1, 2, 3])
    assert idx.continuations([1, 2, 3], SuffixConfig(min_match=1, max_depth=2))[1][0] == [7, 7]  # the end: nothing


def test_draft_scores_by_frequency_and_sizes_by_match_length():
    # 3 of 4 occurrences continue with 5, 6; one with 9
    d = draft_from([(2, [[5, 6, 1], [5, 6, 2], [5, 6, 3], [9]], 1.0)], SuffixConfig(min_score=0.2, depth_per_match=1))
    assert d.tokens[:2] == [5, 9] and d.scores[0] == pytest.approx(0.75) and d.scores[1] == pytest.approx(0.25)
    assert max(tree_depths(d.parents)) == 2  # depth at most 1 × the match length
    assert [d.tokens[i] for i in d.best_path()] == [5, 6] and d.expected_tokens() == pytest.approx(1.5)
    deep = draft_from([(4, [[5, 6, 1, 2, 3, 4, 5, 6, 7]], 1.0)], SuffixConfig(max_depth=6))
    assert len(deep.best_path()) == 6  # capped by max_depth
    assert not draft_from([(2, [[5], [6], [7], [8], [9]], 1.0)], SuffixConfig(min_score=0.3))  # nothing certain enough


def test_corpus_evicts_oldest_within_its_budget_and_bounds_the_index():
    cfg = SuffixConfig(corpus_tokens=100, max_match=3)
    corpus = SuffixCorpus(cfg, vocab_size=50)
    for k in range(40):
        corpus.add([k % 50] * 10 + list(range(10)), workload="tool")
    idx = corpus.indexes["tool"]
    assert corpus.tokens("tool") <= 100 and len(idx.seqs) == 5
    assert idx.entries == sum(len(v) for v in idx.keys.values())  # counted as added and dropped
    assert idx.entries <= 2 * (idx.tokens * cfg.max_match) + 20 * cfg.max_match  # dead entries dropped
    assert corpus.continuations([1, 2, 3], "tool")[1][0][:3] == [4, 5, 6]
    assert corpus.continuations([1, 2, 3], "swe") == corpus.continuations([1, 2, 3], "default")  # no index: nothing
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        corpus.add([1, 99])


def test_corpus_files_are_checked_before_anything_is_indexed(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"token_ids": [1, 2, 3, 4], "workload": "tool"}) + "\n" + json.dumps({"token_ids": [5]}))
    c = SuffixCorpus.load(good, SuffixConfig(min_match=1), vocab_size=10)
    assert c.tokens("tool") == 4 and c.tokens("default") == 1
    cases = {
        "not JSON": "{nope",
        "needs 'token_ids'": json.dumps({"text": "hello"}),
        "integer token ids": json.dumps({"token_ids": ["a"]}),
        "outside the target's vocabulary": json.dumps({"token_ids": [3, 10]}),
    }
    for msg, line in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"token_ids": [1]}) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=msg):
            SuffixCorpus.load(bad, vocab_size=10)
    with pytest.raises(ValueError, match="exceed the budget"):
        SuffixCorpus.load(good, SuffixConfig(corpus_tokens=3), vocab_size=10)
    with pytest.raises(ValueError, match="no such file"):
        SuffixCorpus.load(tmp_path / "missing.jsonl")


def test_merge_shares_prefixes_keeps_sampled_children_first_and_respects_budget():
    tokens, q, parents = [4, 7, 5], [torch.ones(3), None, None], [-1, -1, 0]  # 4 (sampled) -> 5; 7 ranked
    sd = SuffixDraft(tokens=[4, 9, 5, 6, 2], parents=[-1, -1, 0, 2, 3], scores=[0.9, 0.1, 0.9, 0.8, 0.7], match=3)
    t, qq, p = merge_drafts(tokens, q, parents, sd, max_nodes=6, max_depth=4)
    assert t == [4, 7, 5, 9, 6, 2] and p == [-1, -1, 0, -1, 2, 4] and qq[3:] == [None, None, None]
    t2, _, p2 = merge_drafts(tokens, q, parents, sd, max_nodes=4, max_depth=2)  # 4 nodes; depth 3 cut
    assert t2 == [4, 7, 5, 9] and max(tree_depths(p2)) == 2
    for par in set(p):  # siblings keep distinct tokens
        kids = [t[i] for i in range(len(t)) if p[i] == par]
        assert len(kids) == len(set(kids))


def _looping_prompts(target, n=4):
    """Prompts whose AR continuation repeats what they hold (a tiny random target settles into loops)."""
    eng = Engine(target)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        p = torch.randint(0, target.info.vocab_size, (6,), generator=g).tolist()
        cont = eng.generate(p, SamplingParams(max_tokens=30, ignore_eos=True)).token_ids
        out.append(p + cont)  # the prompt holds the loop the target is in
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_suffix_and_hybrid_rounds_equal_ar_on_tiny_targets(arch):
    target = tiny_target(arch)
    prompts = _looping_prompts(target)
    pairs = [(p, 6) for p in prompts]
    drafter = brief_train(DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2), target, pairs, 20)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [Engine(target).generate(p, greedy).token_ids for p in prompts]
    corpus = SuffixCorpus(CFG)
    corpus.add(want[0])  # another request's output, as served traffic would leave it
    engines = {
        "suffix": Engine(target, None, suffix=CFG),
        "suffix+corpus": Engine(target, None, suffix=CFG, corpus=corpus),
        "hybrid-tree": Engine(target, drafter, tree="000.1", suffix=CFG),
        "hybrid-chain": Engine(target, drafter, draft_len=3, suffix=CFG),
        "hybrid-skip": Engine(target, drafter, tree="00", suffix=SuffixConfig(min_match=1, skip_drafter_tokens=0.5)),
    }
    for name, eng in engines.items():
        got = [eng.generate(p, greedy) for p in prompts]
        assert [g.token_ids for g in got] == want, name
        assert sum(g.stats.accepted for g in got) > 0, name  # drafts were accepted
        batched = generate_batch(eng, prompts, greedy)  # chains per row: the suffix's or the drafter's
        assert [g.token_ids for g in batched] == want, name
    assert engines["suffix"].method == "suffix" and engines["hybrid-tree"].method == "dspine+suffix"
    deep = engines["suffix"].generate(prompts[1], greedy).stats
    assert max(i for i, c in enumerate(deep.accept_hist) if c) > 3  # a loop copied several tokens a round


def test_hybrid_equals_ar_on_the_real_target_and_copies_what_the_prompt_holds(smollm2):
    from dspine.checkpoint import load_drafter
    from dspine.drafters import builtin_drafter

    text = "Order ORD-88213-XK shipped to 4417 Maple Avenue, Springfield, tracking 1Z999AA10123456784."
    msgs = [{"role": "user", "content": f"Repeat exactly, then stop:\n{text}"}]
    drafter = load_drafter(builtin_drafter("smollm2-135m-instruct"), smollm2, dtype=torch.float32)
    p = SamplingParams(max_tokens=48)
    want = Engine(smollm2).generate(msgs, p).token_ids
    plain = Engine(smollm2, drafter, tree="0000.1").generate(msgs, p)
    hybrid = Engine(smollm2, drafter, tree="0000.1", suffix=SuffixConfig()).generate(msgs, p)
    assert hybrid.token_ids == plain.token_ids == want
    assert hybrid.stats.tau > plain.stats.tau  # the copied span comes from the prompt
    (batched,) = generate_batch(Engine(smollm2, drafter, draft_len=3, suffix=SuffixConfig()), [msgs], p)
    assert batched.token_ids == want
    others = generate_batch(Engine(smollm2, drafter, draft_len=3, suffix=SuffixConfig()), [msgs, CHAT_PROMPTS[0]], p)
    assert others[0].token_ids == want


@pytest.fixture(scope="module")
def peaked():
    return tiny_target("llama", vocab=V, hidden=32, layers=4, head_scale=25.0, seed=5)


def _corpus_of_samples(target, n=40) -> SuffixCorpus:
    """Continuations the target itself samples after the prompt (plausible drafts) and random ones (not)."""
    g = torch.Generator().manual_seed(7)
    seqs = torch.tensor([PROMPT]).repeat(n, 1)
    for _ in range(8):
        logits, _ = target.forward(seqs, None)
        seqs = torch.cat([seqs, sample(warp_probs(logits[:, -1], SamplingParams(temperature=1.0)), g)[:, None]], 1)
    corpus = SuffixCorpus(SuffixConfig(min_match=1, max_depth=4, max_nodes=8, min_score=0.05))
    for row in seqs.tolist():
        corpus.add(row)
    for _ in range(10):
        corpus.add(torch.randint(0, V, (12,), generator=g).tolist())
    return corpus


def _suffix_samples(target, drafter, tree, corpus, params, seed=0):
    gen = torch.Generator().manual_seed(seed)
    got = [[] for _ in range(SAMPLES)]
    while todo := [i for i, g in enumerate(got) if len(g) < 4]:
        for n in sorted({len(got[i]) for i in todo}):
            rows = [i for i in todo if len(got[i]) == n]
            seqs = torch.tensor([PROMPT + got[i] for i in rows])
            drafts = [RequestSuffix(PROMPT, corpus.cfg, corpus, "default") for _ in rows]
            for d, i in zip(drafts, rows):
                d.push(got[i])
            sd = [d.draft() for d in drafts]
            for i, toks in zip(rows, speculative_tree_step(target, drafter, seqs, tree, params, gen, suffix=sd)):
                got[i] += toks
    return torch.tensor([g[:4] for g in got])


@pytest.mark.parametrize("with_drafter", [False, True], ids=["suffix", "hybrid"])
def test_suffix_and_hybrid_sampling_match_ar(peaked, with_drafter):
    """T = 1: deterministic suffix nodes (alone, or merged below and beside the drafter's sampled chain and ranked
    siblings) verified by recursive rejection give AR's marginals; the drafts were accepted often."""
    params = SamplingParams(temperature=1.0)
    drafter = tree = None
    if with_drafter:
        drafter = DSpineDraftModel.for_target(peaked, method="dspine", num_hidden_layers=2, block_size=6, top_k=4)
        drafter, tree = perturb_writes(drafter, std=0.5, seed=3), DraftTree.parse("00.1")
    corpus = _corpus_of_samples(peaked)
    tokens = _suffix_samples(peaked, drafter, tree, corpus, params)
    assert min(chi2_pvalues(tokens, exact_ar_marginals(peaked, params))) > 0.01
    sd = RequestSuffix(PROMPT, corpus.cfg, corpus, "default").draft()
    assert len(sd) >= 3 and sd.expected_tokens() > 0.5  # the corpus proposes, and plausibly


def test_serving_feeds_the_corpus_and_the_next_request_drafts_from_it(smollm2):
    """A served request's output joins its workload's corpus when it finishes: the same request again is drafted
    from it (τ up, tokens unchanged); another workload's requests do not see it."""
    from dspine.serve.config import ServeConfig
    from dspine.serve.service import Service

    cfg = SuffixConfig()
    eng = Engine(smollm2, None, suffix=cfg, corpus=SuffixCorpus(cfg, smollm2.info.vocab_size))
    svc = Service(eng, ServeConfig(model_name="m"))
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": CHAT_PROMPTS[3]}],
        "max_tokens": 40,
        "temperature": 0,
        "metadata": {"workload": "tool"},
    }
    _, first = svc.run(svc.parse(body, True))
    assert eng.corpus.tokens("tool") == len(first[0].token_ids) > 0 and eng.corpus.tokens("swe") == 0
    _, again = svc.run(svc.parse(body, True))
    _, other = svc.run(svc.parse({**body, "metadata": {"workload": "swe"}}, True))
    assert again[0].token_ids == first[0].token_ids == other[0].token_ids
    assert again[0].stats.tau > 2 * max(first[0].stats.tau, 1.0) and other[0].stats.tau < again[0].stats.tau
    assert eng.method == "suffix"


def test_engine_generate_drafts_from_its_workloads_corpus(smollm2):
    """Engine.generate(workload=W) drafts from W's part of the corpus (the agent race's turns, each under its own
    workload); without a workload only the "default" part is read — a corpus filed under workloads adds nothing."""
    cfg = SuffixConfig()
    eng = Engine(smollm2, None, suffix=cfg, corpus=SuffixCorpus(cfg, smollm2.info.vocab_size))
    prompt = smollm2.chat_ids([{"role": "user", "content": CHAT_PROMPTS[3]}])
    first = eng.generate(prompt, SamplingParams(max_tokens=40))
    eng.corpus.add(list(first.token_ids), "tool")
    tool = eng.generate(prompt, SamplingParams(max_tokens=40), workload="tool")
    plain = eng.generate(prompt, SamplingParams(max_tokens=40))
    assert tool.token_ids == plain.token_ids == first.token_ids
    assert tool.stats.tau > 2 * max(plain.stats.tau, 1.0) and plain.stats.tau == first.stats.tau
    # generate_stream (the race at concurrency > 1, continuous batching) reads each prompt's workload alike
    from dspine.engine import generate_stream

    two = generate_stream(eng, [prompt, prompt], SamplingParams(max_tokens=40), 2, workloads=["tool", "default"])
    assert [r.token_ids for r in two] == [first.token_ids] * 2 and two[0].stats.tau > 2 * max(two[1].stats.tau, 1.0)


def test_bad_drafter_specs_and_corpora_are_one_clear_error(tmp_path, capsys):
    from dspine.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"token_ids": [1, 2, 99999999]}\n')
    cases = [
        (["--drafter", "builtin+lookup"], "CHECKPOINT+suffix"),
        (["--drafter", "suffix+suffix"], "CHECKPOINT+suffix"),
        (["--drafter", "builtin", "--suffix-corpus", str(bad)], "--suffix-corpus needs suffix drafting"),
        (["--drafter", "builtin+suffix", "--suffix-corpus", str(bad)], "outside the target's vocabulary"),
        (["--drafter", "suffix", "--suffix-corpus", str(tmp_path / "none.jsonl")], "no such file"),
    ]
    for args, msg in cases:
        assert main(["generate", "--prompt", "hi", "--max-tokens", "2", *args]) == 2, args
        assert msg in capsys.readouterr().err, args
    assert main(["generate", "--prompt", "Say hi.", "--max-tokens", "8", "--drafter", "suffix", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "suffix" and out["completion_tokens"] > 0


def _policy(line, tree="0000.1", accepted=(80, 60, 40, 20, 5)):
    """A TreePolicy whose cost line was measured as seconds = a + b·rows + c·drafted (every shape seen twice: the
    first of each is not fitted) and whose tree nodes were accepted `accepted` times in 100 rounds each."""
    from dspine.goodput import TreePolicy
    from dspine.state import TreeProfile

    tree = DraftTree.parse(tree)
    prof = TreeProfile(len(tree.paths))
    prof.offered, prof.accepted = [100] * len(tree.paths), list(accepted)
    pol = TreePolicy(tree, prof, SuffixConfig(tree_goodput=True))
    a, b, c = line
    for rows in range(1, 31, 3):
        for drafted in (False, True):
            for _ in range(2):
                pol.observe(rows, drafted, a + b * rows + c * drafted)
    return pol


CHAIN = SuffixDraft(tokens=[1, 2, 3, 4, 5, 6], parents=[-1, 0, 1, 2, 3, 4], scores=[0.95, 0.9, 0.85, 0.3, 0.12, 0.11])


def test_tree_policy_verifies_what_pays_for_its_rows():
    """Nodes cost next to nothing: every suffix node and the drafter's whole tree. Rows cost: the low-scoring
    suffix tail is left out, the likely head kept. A costly drafter beside a confident suffix: the drafter does not
    run. Nothing likely and drafting costly: an AR round. Off (tree_goodput=False): everything, as before."""
    import dataclasses

    from dspine.goodput import KNOWN_ROUNDS

    tree, sd, e = _policy((0.05, 1e-5, 1e-4)).plan(CHAIN, True)
    assert len(sd) == 6 and tree is not None and len(tree.paths) == 5 and e > 3
    tree, sd, _ = _policy((0.05, 0.01, 1e-4)).plan(CHAIN, True)
    assert sd.tokens[:3] == [1, 2, 3] and len(sd) < 6 and sd.scores == sorted(sd.scores, reverse=True)
    assert tree is None or len(tree.paths) < 5  # the drafter's rare nodes go too
    tree, sd, _ = _policy((0.05, 0.001, 0.2)).plan(CHAIN, True)
    assert tree is None and len(sd) >= 3
    assert _policy((0.05, 0.01, 0.2), accepted=(5, 1, 1, 0, 0)).plan(None, True) == (None, None, 0.0)
    assert _policy((0.05, 0.01, 0.2)).plan(CHAIN, False)[0] is None  # the drafter's slots do not fit
    off = _policy((0.05, 0.01, 0.2))
    off.cfg = dataclasses.replace(off.cfg, tree_goodput=False)
    tree, sd, _ = off.plan(CHAIN, True)
    assert len(sd) == 6 and len(tree.paths) == 5  # the suffix expects 3.23 accepted, below skip_drafter_tokens
    from dspine.goodput import TreePolicy
    from dspine.state import TreeProfile

    fresh = TreePolicy(DraftTree.parse("00"), TreeProfile(2), SuffixConfig(tree_goodput=True))
    assert float(fresh.gram[0, 0]) < KNOWN_ROUNDS and len(fresh.plan(CHAIN, True)[0].paths) == 2  # unknown: all


def test_greedy_order_prefixes_are_subtrees():
    tree = DraftTree.parse("000.01.1.10.2")
    rates = [0.9, 0.3, 0.1, 0.6, 0.5, 0.2, 0.25, 0.05][: len(tree.paths)]
    order = tree.greedy_order(rates)
    for n in range(1, len(order) + 1):
        kept = set(order[:n])
        for p in kept:
            assert len(p) == 1 or p[:-1] in kept  # below its parent
            assert p[-1] == 0 or p[:-1] + (p[-1] - 1,) in kept  # after its next-better sibling
    assert tree.prune(rates, 3).paths == DraftTree.of(order[:3]).paths


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hybrid_rounds_sized_by_goodput_equal_ar(arch):
    """With the cost line measured so that rows cost (the policy leaves nodes out and runs some rounds without the
    drafter), single requests still decode exactly AR's tokens; the profile counts only the nodes verified."""
    import dataclasses

    target = tiny_target(arch)
    prompts = _looping_prompts(target)
    drafter = brief_train(
        DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2), target, [(p, 6) for p in prompts], 20
    )
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [Engine(target).generate(p, greedy).token_ids for p in prompts]
    cfg = dataclasses.replace(CFG, tree_goodput=True)
    eng = Engine(target, drafter, tree="000.1", suffix=cfg, corpus=SuffixCorpus(cfg))
    eng.corpus.add(want[0])
    pol = eng.tree_policy
    for rows in range(1, 20, 2):  # rows cost a tenth of a round each; the drafter half a round
        for drafted in (False, True):
            for _ in range(2):
                pol.observe(rows, drafted, 0.01 + 0.001 * rows + 0.005 * drafted)
    plans, offered = [], []
    real = pol.plan
    pol.plan = lambda sd, can: offered.append(len(sd) if sd else 0) or plans.append(real(sd, can)) or plans[-1]
    pol.observe = lambda *a, **k: None  # keep the measured line (this machine's timings would replace it)
    got = [eng.generate(p, greedy).token_ids for p in prompts]
    assert got == want
    assert any(t is None for t, sd, _ in plans if sd) and any(t is not None for t, _, _ in plans)  # both kinds
    assert any(len(sd or ()) < n for (_, sd, _), n in zip(plans, offered))  # suffix nodes left out
    assert eng.tree_profile.rounds == sum(t is not None for t, _, _ in plans)


def test_padded_suffix_chains_in_a_batch_equal_ar_and_the_policy_pads_only_where_it_pays():
    """Suffix drafts alone, batched: a row whose match is shorter (or absent) is padded to the round's length.
    Forced to the longest length every round, greedy output equals AR row for row; the choice pads once the
    fitted cost of a verified row is small, and drafts only what every row fills while it is dear."""
    from dspine.goodput import SuffixChainPolicy

    target = tiny_target("llama")
    prompts = _looping_prompts(target) + [[3, 1, 4, 1, 5, 9, 2, 6]]  # the last: no loop to copy at first
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [Engine(target).generate(p, greedy).token_ids for p in prompts]
    eng = Engine(target, None, suffix=dataclasses.replace(CFG, pad_batches=True))
    assert eng.suffix_policy.pad and not Engine(target, None, suffix=CFG).suffix_policy.pad  # off by default
    eng.suffix_policy.choose = lambda drafts, batch, cap: cap  # the most padding there can be
    got = generate_batch(eng, prompts, greedy)
    assert [g.token_ids for g in got] == want and sum(g.stats.accepted for g in got) > 0
    sd = lambda n: SuffixDraft(list(range(n)), list(range(-1, n - 1)), [0.9] * n)
    cheap, dear, never = SuffixChainPolicy(), SuffixChainPolicy(), SuffixChainPolicy(pad=False)
    for r in range(2, 40, 3):  # fitted lines: a verified row costs 1% / 100% of a round's fixed cost
        cheap.observe(r, True, 1.0 + 0.01 * r, shape="fit")  # (the first of a shape is not fitted)
        never.observe(r, True, 1.0 + 0.01 * r, shape="fit")
        dear.observe(r, True, 1.0 + 1.0 * r, shape="fit")
    assert SuffixChainPolicy().choose([sd(8), None], 2, 8) == 0  # before any round: what every row fills
    assert never.choose([sd(8), sd(3)], 2, 8) == 3 and never.choose([sd(8), None], 2, 8) == 0  # pad off
    assert cheap.choose([sd(8), None], 2, 8) == 8 and cheap.choose([sd(8), sd(3)], 2, 5) == 5
    assert dear.choose([sd(8), None], 2, 8) == 0


def test_padded_suffix_chains_sample_as_ar(peaked):
    """T = 1: padded rows (certain proposals, pads included) verified by rejection sampling give AR's marginals."""
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    corpus = _corpus_of_samples(peaked)
    eng = Engine(peaked, None, suffix=corpus.cfg, corpus=corpus)
    eng.suffix_policy.choose = lambda drafts, batch, cap: cap
    rows = []
    for seed in range(SAMPLES // 2000):
        got = generate_batch(eng, [PROMPT] * 2000, dataclasses.replace(params, seed=seed))
        rows += [g.token_ids for g in got]
    assert min(chi2_pvalues(torch.tensor(rows), exact_ar_marginals(peaked, params))) > 0.01
    assert sum(g.stats.accepted for g in got) > 500  # the corpus's drafts were taken, pads and all
