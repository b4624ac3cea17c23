"""Speculative output equals autoregressive output token for token at temperature 0 (fp32)."""

import pytest
import torch
from conftest import CHAT_PROMPTS, METHODS, brief_train, perturb_writes, tiny_target

from dspine.drafter import DSpineDraftModel
from dspine.engine import Engine
from dspine.sampling import SamplingParams

_TRAINED: dict = {}


def _trained(target, pairs, method):
    """A 2-layer, block-8 drafter of `method` briefly trained on the tiny target's later pairs (trained once per
    session-wide target and method: the tests only decode with it)."""
    key = (id(target), method)
    if key not in _TRAINED:
        d = DSpineDraftModel.for_target(target, method=method, num_hidden_layers=2, block_size=8, top_k=4, seed=4)
        _TRAINED[key] = (target, brief_train(d, target, pairs[4:], steps=40))  # the target kept: its id stays its own
    return _TRAINED[key][1]


@pytest.mark.parametrize("method", METHODS)
def test_tiny_targets_greedy_equals_ar(tiny, method):
    target, pairs = tiny
    ar = Engine(target)
    fresh = perturb_writes(
        DSpineDraftModel.for_target(target, method=method, num_hidden_layers=2, block_size=8, top_k=4, seed=3)
    )
    trained = _trained(target, pairs, method)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    taus = []
    for drafter in (fresh, trained):
        spec = Engine(target, drafter)
        for ids, start in pairs[:4]:
            want = ar.generate(ids[:start], params)
            got = spec.generate(ids[:start], params)
            assert got.token_ids == want.token_ids
            assert got.stats.rounds >= 1 and 1.0 <= got.stats.tau <= drafter.config.block_size
            taus.append(got.stats.tau)
    # the trained drafter predicts the target's own greedy continuations on its training prompts' family
    assert sum(taus[4:]) > sum(taus[:4])


REAL_PARAMS = SamplingParams(max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def real_ar(smollm2):
    ar = Engine(smollm2)
    return {p: ar.generate(p, REAL_PARAMS) for p in CHAT_PROMPTS}


@pytest.mark.parametrize("method", METHODS)
def test_real_target_greedy_equals_ar(smollm2, smollm2_drafters, real_ar, method):
    for drafter in smollm2_drafters[method]:
        spec = Engine(smollm2, drafter)
        for prompt in CHAT_PROMPTS:
            want = real_ar[prompt]
            got = spec.generate(prompt, REAL_PARAMS)
            assert len(want.token_ids) == 64
            assert got.token_ids == want.token_ids, (method, prompt)
            assert got.text == want.text


def test_stop_conditions_match_ar(smollm2, smollm2_drafters):
    """EOS, stop strings and max_tokens end speculative decoding exactly where AR ends."""
    drafter = smollm2_drafters["dspine"][1]
    ar, spec = Engine(smollm2), Engine(smollm2, drafter)
    cases = [
        SamplingParams(max_tokens=200),
        SamplingParams(max_tokens=80, stop=["."]),
        SamplingParams(max_tokens=7, ignore_eos=True),
    ]
    for params in cases:
        want = ar.generate(CHAT_PROMPTS[0], params)
        got = spec.generate(CHAT_PROMPTS[0], params)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert ar.generate(CHAT_PROMPTS[0], cases[0]).finish_reason == "stop"  # EOS reached before 200
    stopped = ar.generate(CHAT_PROMPTS[0], cases[1])
    assert stopped.finish_reason == "stop" and "." not in stopped.text
    assert len(ar.generate(CHAT_PROMPTS[0], cases[2]).token_ids) == 7


def test_sampled_generation_is_seeded(tiny):
    target, pairs = tiny
    drafter = perturb_writes(DSpineDraftModel.for_target(target, num_hidden_layers=2, block_size=8, top_k=4))
    spec = Engine(target, drafter)
    p = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, top_k=20, seed=7, ignore_eos=True)
    a, b = spec.generate(pairs[0][0][:6], p), spec.generate(pairs[0][0][:6], p)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30
    torch.manual_seed(0)


@pytest.mark.parametrize("method", ["ar", *METHODS])
def test_batched_greedy_equals_single_request_ar(tiny, method):
    """Rows of different prompt lengths decoded together (rejected drafts masked in place, explicit
    positions) give each row's single-request AR output; a briefly trained drafter accepts drafts."""
    from dspine.engine import generate_batch

    target, pairs = tiny
    ar = Engine(target)
    drafter = None
    if method != "ar":
        drafter = _trained(target, pairs, method)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [ids[: start - k] for k, (ids, start) in enumerate(pairs[:4])]  # lengths 6, 5, 4, 3
    got = generate_batch(Engine(target, drafter), prompts, params)
    for p, g in zip(prompts, got):
        assert g.token_ids == ar.generate(p, params).token_ids
    if drafter is not None:
        assert sum(g.stats.accepted for g in got) > 0


def test_batched_real_target_greedy_equals_ar(smollm2, smollm2_drafters, real_ar):
    from dspine.engine import generate_batch

    got = generate_batch(Engine(smollm2, smollm2_drafters["dspine"][1]), CHAT_PROMPTS, REAL_PARAMS)
    assert [g.token_ids for g in got] == [real_ar[p].token_ids for p in CHAT_PROMPTS]
    got = generate_batch(Engine(smollm2), CHAT_PROMPTS[:3], REAL_PARAMS)
    assert [g.token_ids for g in got] == [real_ar[p].token_ids for p in CHAT_PROMPTS[:3]]


@pytest.mark.parametrize("method", ["dflash", "dspine"])
def test_forced_continuation_replays_the_same_rounds(tiny, method):
    """`generate(forced=...)` (how the engine measures τ on SGLang's own outputs): on the target's own greedy
    output it reproduces the speculative run — the tokens and every round's acceptance but the last, where a
    free run may accept drafts past max_tokens (cut off) and the given text has nothing to match them with —;
    on another text it commits that text, drafts accepted only where they match it."""
    from dspine.engine import BatchDecode, generate_batch

    target, pairs = tiny
    drafter = _trained(target, pairs, method)
    spec, params = Engine(target, drafter), SamplingParams(max_tokens=40, ignore_eos=True)
    texts = []
    for ids, start in pairs[:3]:
        free = spec.generate(ids[:start], params)
        forced = spec.generate(ids[:start], params, forced=free.token_ids)
        assert forced.token_ids == free.token_ids and forced.stats.rounds == free.stats.rounds
        diff = [a - b for a, b in zip(free.stats.accept_hist, forced.stats.accept_hist)]
        assert sum(map(abs, diff)) <= 2 and forced.stats.accepted <= free.stats.accepted  # the last round only
        other = list(free.token_ids)
        other[5] = (other[5] + 1) % target.info.vocab_size  # a text the target would not write
        replayed = spec.generate(ids[:start], params, forced=other)
        assert replayed.token_ids == other  # not the target's own choice at index 5
        # every token of the text committed once: the prefill's, then n drafts + 1 per round (the last round's
        # bonus falls past the end when its drafts reach it)
        assert len(other) <= replayed.stats.accepted + replayed.stats.rounds + 1 <= len(other) + 1
        texts += [(ids[:start], free.token_ids), (ids[:start], other[: 20 + start % 10])]
    # replayed together (prompts of different lengths, texts of different lengths): each row as alone
    batched = generate_batch(spec, [p for p, _ in texts], params, forced=[t for _, t in texts])
    for row, (prompt, text) in zip(batched, texts):
        one = spec.generate(prompt, params, forced=text)
        assert row.token_ids == text == one.token_ids
        assert (row.stats.rounds, row.stats.accept_hist) == (one.stats.rounds, one.stats.accept_hist)
    with pytest.raises(Exception, match="forced continuation needs greedy"):
        spec.generate(pairs[0][0][:4], SamplingParams(temperature=1.0), forced=[1, 2])
    with pytest.raises(Exception, match="forced continuation needs greedy"):
        BatchDecode(spec, [pairs[0][0][:4]], SamplingParams(temperature=1.0), forced=[[1, 2]])


@pytest.mark.parametrize("method", ["dflash", "dspine"])
def test_shorter_draft_len_stays_lossless(tiny, method):
    """Verifying only the first D drafts of each block (a decode-time choice), and running only S block slots,
    keeps AR's output, single and batched, and no round accepts more than D drafts."""
    from dspine.engine import generate_batch

    target, pairs = tiny
    ar = Engine(target)
    drafter = _trained(target, pairs, method)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [ids[:start] for ids, start in pairs[:3]]
    for D, S in ((1, None), (3, None), (3, 4), (2, 6)):
        eng = Engine(target, drafter, draft_len=D, draft_block=S)
        for p in prompts:
            got = eng.generate(p, params)
            assert got.token_ids == ar.generate(p, params).token_ids
            assert not any(got.stats.accept_hist[D + 1 :])  # accept_hist[n]: rounds that accepted n drafts
        assert [g.token_ids for g in generate_batch(eng, prompts, params)] == [
            ar.generate(p, params).token_ids for p in prompts
        ]
    with pytest.raises(ValueError, match="draft_len must be in \\[1, 7\\]"):
        Engine(target, drafter, draft_len=8)
    for S in (3, 9):
        with pytest.raises(ValueError, match="draft_block must be in \\[4, 8\\]"):
            Engine(target, drafter, draft_len=3, draft_block=S)


@pytest.mark.parametrize("method", ["dflash", "dspine"])
def test_draft_trees_stay_lossless(tiny, method):
    """Greedy rounds verifying a draft tree (the accepted path's KV entries moved behind the committed ones, the
    rest dropped) keep AR's output and accept at most the tree's depth; so do sampled rounds near T = 0; trees a
    drafter cannot run are refused."""
    from dspine.engine import generate_batch

    target, pairs = tiny
    ar = Engine(target)
    drafter = _trained(target, pairs, method)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [ids[:start] for ids, start in pairs[:3]]
    want = [ar.generate(p, greedy).token_ids for p in prompts]
    for spec, n in (("1", 1), ("00.1.01.10.11.3", 2), ("0000.1.01.2", 3)):
        eng = Engine(target, drafter, tree=spec)
        depth = eng.tree.depth
        assert eng.draft_len == depth
        for p, w in zip(prompts[:n], want):
            got = eng.generate(p, greedy)
            assert got.token_ids == w, (spec, p)
            assert not any(got.stats.accept_hist[depth + 1 :])
    # the tree's profile: each round's accepted path counted per node, matching the round's acceptance
    eng = Engine(target, drafter, tree="00.1.01.10.11.3")
    st = eng.generate(prompts[0], greedy).stats
    prof, paths = eng.tree_profile, eng.tree.paths
    assert prof.rounds == st.rounds and sum(prof.accepted) == st.accepted
    rate = dict(zip(paths, prof.rates))
    for p in [(), *paths]:  # one path a round: a node's children together accepted at most as often as the node
        assert sum(rate[c] for c in paths if c[:-1] == p) <= rate.get(p, 1.0) + 1e-9
    # a batch of one request (serve's rounds) verifies the tree too (the same rounds); two requests verify chains
    (one,) = generate_batch(eng, prompts[:1], greedy)
    assert one.token_ids == want[0] and one.stats.accept_hist == eng.generate(prompts[0], greedy).stats.accept_hist
    assert [g.token_ids for g in generate_batch(eng, prompts[:2], greedy)] == want[:2]
    # logprobs through a tree round are the target's own, from the row each token was chosen at
    lp = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    ((tree_lp,), (ar_lp,)) = generate_batch(eng, prompts[:1], lp), generate_batch(ar, prompts[:1], lp)
    assert tree_lp.token_ids == ar_lp.token_ids and tree_lp.stats.tau > 1.0
    for (x, top_x), (y, top_y) in zip(tree_lp.logprobs, ar_lp.logprobs, strict=True):
        assert abs(x - y) < 1e-4 and [t for t, _ in top_x] == [t for t, _ in top_y]
    # sampled rounds verify the tree too (ranked siblings on the sampled chain; in distribution:
    # test_distribution.py): seeded, they repeat; near T = 0 every draw is the argmax, so the text is greedy AR's
    eng = Engine(target, drafter, tree="0000.1.01")
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    first = eng.generate(prompts[0], sampled)
    assert first.token_ids == eng.generate(prompts[0], sampled).token_ids
    assert not any(first.stats.accept_hist[eng.tree.depth + 1 :])
    cold = SamplingParams(max_tokens=40, temperature=1e-4, seed=3, ignore_eos=True)
    for p, w in zip(prompts[:2], want):
        got = eng.generate(p, cold)
        assert got.token_ids == w and got.stats.tau > 1.0
    (one,) = generate_batch(eng, prompts[:1], cold)
    assert one.token_ids == want[0] and one.stats.rounds < len(want[0])
    for spec, what in (("4", "ranks below the drafter's top_k \\(4\\)"), ("0" * 8, "depth in \\[1, 7\\]")):
        with pytest.raises(ValueError, match=what):
            Engine(target, drafter, tree=spec)
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(target, tree="0")


def test_a_batch_over_spec_max_batch_decodes_ar_rounds_and_drafts_again_when_it_shrinks(tiny):
    """spec_max_batch=2 with 4 rows of different lengths: the first rounds run autoregressively (4, then 3 open
    rows), the last ones draft (the drafter's context followed the AR rounds); every row stays AR's output, and
    only the drafted rounds count in the acceptance stats."""
    from dspine.engine import generate_batch

    target, pairs = tiny
    ar = Engine(target)
    drafter = _trained(target, pairs, "dspine")
    lengths = [40, 6, 12, 30]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    prompts = [ids[:start] for ids, start in pairs[:4]]
    want = [ar.generate(p, q).token_ids for p, q in zip(prompts, params)]
    capped = generate_batch(Engine(target, drafter, draft_len=3, spec_max_batch=2), prompts, params)
    free = generate_batch(Engine(target, drafter, draft_len=3), prompts, params)
    assert [g.token_ids for g in capped] == want == [g.token_ids for g in free]
    rounds = lambda rs: [r.stats.rounds for r in rs]
    assert rounds(capped)[1] == 0  # row 1 finished while 4 rows were open: never drafted
    assert 0 < rounds(capped)[0] < rounds(free)[0]  # row 0 drafted once the batch shrank to 2
    assert sum(r.stats.accepted for r in capped) > 0
    T1 = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, seed=3) for n in lengths]
    assert [len(g.token_ids) for g in generate_batch(Engine(target, drafter, spec_max_batch=1), prompts, T1)] == lengths
    with pytest.raises(ValueError, match="spec_max_batch must be >= 1"):
        Engine(target, drafter, spec_max_batch=0)


@pytest.mark.parametrize("method", ["ar", "dspine"])
def test_rows_join_leave_and_compact_between_rounds_and_stay_ar(tiny, method):
    """Continuous batching: a batch prefilled later joins a running one (another width), rows leave as they
    finish (different max_tokens), every row's columns are squeezed to the front mid-decode — and each row
    still gives its single-request AR output."""
    from dspine.engine import BatchDecode

    target, pairs = tiny
    ar = Engine(target)
    eng = Engine(target, _trained(target, pairs, method) if method != "ar" else None)
    prompts = [ids[: start - k] for k, (ids, start) in enumerate(pairs[:4])]
    lengths = [40, 9, 25, 17]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    run = BatchDecode(eng, prompts[:2], params[:2], tags=["a", "b"])
    got = dict(run.pop_finished())
    for _ in range(3):
        run.step()
        got.update(run.pop_finished())
    late = BatchDecode(eng, prompts[2:], params[2:], tags=["c", "d"])
    assert late.width != run.width
    before = len(run)
    run.merge(late)
    assert before >= 1 and len(run) == before + 2
    rounds = 0
    while not run.done:
        run.step()
        got.update(run.pop_finished())
        rounds += 1
        if rounds == 2 and len(run):
            run.compact(slack=0.0)
            assert run.width == int(run.valid.sum(1).max())
    assert sorted(got) == ["a", "b", "c", "d"]
    for tag, p, sp in zip("abcd", prompts, params):
        assert got[tag].token_ids == ar.generate(p, sp).token_ids, tag
    assert got["c"].batch_size == before + 2  # decoded beside the rows it joined


def _penalized_reference(target, prompt, params):
    """AR with OpenAI's penalties written out: full forward each step, logits minus the output's counts."""
    ids, out = list(prompt), []
    for _ in range(params.max_tokens):
        logits, _ = target.forward(torch.tensor([ids]))
        c = torch.zeros(target.info.vocab_size)
        for t in out:
            c[t] += 1
        z = logits[0, -1] - params.frequency_penalty * c - params.presence_penalty * (c > 0).float()
        out.append(int(z.argmax()))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("method", ["dflash", "dspine"])
def test_penalties_keep_speculative_decoding_lossless(tiny, method):
    """presence/frequency penalties: the speculative batch equals AR with the same penalties, which equals the
    penalties written out by hand — and they change the output."""
    from dspine.engine import generate_batch

    target, pairs = tiny
    drafter = _trained(target, pairs, method)
    prompts = [ids[:start] for ids, start in pairs[:3]]
    pen = SamplingParams(max_tokens=30, ignore_eos=True, presence_penalty=0.6, frequency_penalty=0.9)
    plain = SamplingParams(max_tokens=30, ignore_eos=True)
    want = [_penalized_reference(target, p, pen) for p in prompts]
    assert [g.token_ids for g in generate_batch(Engine(target), prompts, pen)] == want
    spec = generate_batch(Engine(target, drafter), prompts, [pen, plain, pen])
    assert [spec[0].token_ids, spec[2].token_ids] == [want[0], want[2]]
    assert spec[1].token_ids == Engine(target).generate(prompts[1], plain).token_ids  # a plain row beside them
    assert want != [Engine(target).generate(p, plain).token_ids for p in prompts]


def test_logprobs_are_the_targets_own_distribution(tiny):
    """logprobs with a drafter: each committed token's log-probability and the top k, equal to a full forward
    of the prompt and output."""
    from dspine.engine import generate_batch

    target, pairs = tiny
    eng = Engine(target, _trained(target, pairs, "dspine"))
    prompts = [ids[:start] for ids, start in pairs[:2]]
    got = generate_batch(eng, prompts, SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3))
    for p, g in zip(prompts, got):
        assert len(g.logprobs) == len(g.token_ids) == 20
        logits, _ = target.forward(torch.tensor([p + g.token_ids]))
        lsm = logits[0, len(p) - 1 : -1].log_softmax(-1)
        for j, (tok, (lp, top)) in enumerate(zip(g.token_ids, g.logprobs)):
            assert abs(lp - float(lsm[j, tok])) < 1e-4
            ref = lsm[j].topk(3)
            assert [t for t, _ in top] == ref.indices.tolist()
            assert max(abs(v - float(r)) for (_, v), r in zip(top, ref.values)) < 1e-4
    with pytest.raises(Exception, match="logprobs must be in"):
        generate_batch(eng, prompts, SamplingParams(logprobs=21))


def test_decode_forwards_give_the_models_own_logits_and_features(tiny):
    """Target.forward applies the output head itself on decode-sized CPU fp32 forwards (Target._own_head) unless
    its linears are packed (Target.packed):
    logits and layer features equal what the model's own forward returns, through a prefill and a decode
    step on the KV cache, with an attention mask and positions as batched decoding passes them."""
    target, _ = tiny
    assert target._own_head and target.packed
    for packed in (True, False):  # the head through oneDNN's packed linear, or as W @ h^T
        target.packed = packed
        try:
            _decode_forwards_match(target)
        finally:
            target.packed = True


def _decode_forwards_match(target):
    layers = [0, 2, 5]
    ids = torch.randint(0, target.info.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :2] = 0  # row 1: two padded columns in front
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ours, theirs = target.new_cache(), target.new_cache()
    for sl in (slice(0, 9), slice(9, 12)):
        step = ids[:, sl] if sl.start == 0 else torch.randint(0, target.info.vocab_size, (2, 3))
        kw = dict(attention_mask=mask[:, : sl.stop], position_ids=pos[:, sl], use_cache=True)
        kw[target._cache_kw] = theirs
        logits, feats = target.forward(step, ours, layers, attention_mask=kw["attention_mask"], position_ids=pos[:, sl])
        out = target.model(input_ids=step, output_hidden_states=True, **kw)
        torch.testing.assert_close(logits, out.logits.float(), rtol=1e-5, atol=1e-5)
        want = torch.cat([out.hidden_states[i + 1] for i in layers], -1)
        torch.testing.assert_close(feats, want, rtol=0, atol=0)
    # a prefill's logits at one position per row (logits_at): the same values, the same features
    at = torch.tensor([8, 5])
    kw = dict(attention_mask=mask[:, :9], position_ids=pos[:, :9])
    full, feats = target.forward(ids, target.new_cache(), layers, **kw)
    last, feats_at = target.forward(ids, target.new_cache(), layers, **kw, logits_at=at)
    assert last.shape == (2, 1, target.info.vocab_size)
    torch.testing.assert_close(last[:, 0], full[torch.arange(2), at], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feats_at, feats, rtol=0, atol=0)


def test_packed_linears_are_row_invariant_and_follow_their_weights(tiny):
    """A CPU fp32 target decodes through oneDNN's packed linears: a row's output is the same bits whether 1 or
    several rows are computed beside it (a verify row equals a 1-row decode step there), a weight changed in
    place is repacked, and anything autograd must see takes the plain path."""
    from dspine.packing import pack_linears

    target, _ = tiny
    lin = target.model.get_decoder().layers[0].mlp.down_proj
    assert target.packed and "_dspine_plain" in lin.__dict__  # routed through packing._forward
    x = torch.randn(9, lin.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        one = lin(x[:1])
        for n in (2, 4, 6, 9):
            assert torch.equal(lin(x[:n])[:1], one)
        torch.testing.assert_close(one, x[:1] @ lin.weight.t(), rtol=1e-5, atol=1e-5)
        saved = lin.weight.clone()
        lin.weight.mul_(2)
        try:
            torch.testing.assert_close(lin(x[:1]), 2 * one, rtol=1e-5, atol=1e-5)
        finally:
            lin.weight.copy_(saved)
        assert torch.equal(lin(x[:1]), one)
    xg = x[:3].clone().requires_grad_(True)
    lin(xg).sum().backward()
    torch.testing.assert_close(xg.grad, lin.weight.sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)
    assert pack_linears(target.model) == 0  # already routed: nothing wrapped twice


def test_int8_linears_approximate_and_follow_their_weights():
    """Drafts may decode through int8 weights (packing.py): close to fp32 (per-channel weights, per-tensor
    activations), requantised after an in-place change, the plain path under autograd, and routing again
    switches a module back to fp32."""
    from dspine.packing import int8_linears_available, linear, pack_linears, packed_linears_available

    assert int8_linears_available()  # the x86 CPUs CI and users run on
    g = torch.Generator().manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False))
    x = torch.randn(5, 2, 64, generator=g)
    with torch.no_grad():
        want = mod(x)
        assert pack_linears(mod, int8=True) == 2 and pack_linears(mod, int8=True) == 0
        got = mod(x)
        assert got.shape == want.shape and not torch.equal(got, want)
        assert ((got - want).norm() / want.norm()) < 0.03
        mod[1].weight.mul_(2)
        torch.testing.assert_close(mod(x), 2 * got, rtol=0.03, atol=0.03)
        mod[1].weight.div_(2)
        w = torch.randn(1000, 64, generator=g)
        y = linear(x, w, int8=True)
        assert ((y - x @ w.t()).norm() / (x @ w.t()).norm()) < 0.03
        assert y.topk(1).indices.eq((x @ w.t()).topk(5).indices).any(-1).all()  # the best stays among the top 5
    xg = x.clone().requires_grad_(True)
    mod(xg).sum().backward()  # autograd: fp32 weights, exact gradient
    torch.testing.assert_close(xg.grad, (mod[1].weight @ mod[0].weight).sum(0).expand_as(x), rtol=1e-5, atol=1e-5)
    assert pack_linears(mod) == (2 if packed_linears_available() else 0)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), want, rtol=1e-5, atol=1e-5)


def test_multi_row_forwards_keep_kv_head_groups(tiny, monkeypatch):
    """A CPU target with grouped KV heads attends through target._sdpa_gqa: a masked multi-row forward on a
    cache (a verify) never repeats the cache once per head group (transformers' repeat_kv copy, which made a
    verify at long contexts cost far more than a decode step), with the logits of transformers' own SDPA."""
    import transformers.integrations.sdpa_attention as sd

    target, _ = tiny
    assert target.model.config._attn_implementation == "dspine_sdpa_gqa"
    repeats, real = [], sd.repeat_kv
    monkeypatch.setattr(sd, "repeat_kv", lambda *a: repeats.append(a[0].shape) or real(*a))
    ids = torch.randint(target.info.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))

    def verify_logits():
        cache = target.new_cache()
        target.forward(ids[:, :24], cache)
        return target.forward(ids[:, 24:], cache)[0]  # 6 rows on a 24-position cache: a causal mask

    got = verify_logits()
    assert not repeats
    target.model.set_attn_implementation("sdpa")
    try:
        ref = verify_logits()
    finally:
        target.model.set_attn_implementation("dspine_sdpa_gqa")
    assert repeats  # transformers' own path copies the cache per group here
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_fp32_cuda_attention_avoids_the_math_kernel():
    """An fp32 CUDA target with grouped KV heads repeats the heads for SDPA's memory-efficient kernel (transformers
    hands the groups to SDPA, which in fp32 only the math kernel takes): the teacher-forced features and a cached
    decode equal transformers' own, and the math kernel is off for them."""
    from dspine.target import Target

    target = tiny_target("llama")
    target = Target(target.model.to("cuda"), target.tokenizer, name="tiny-cuda")
    assert target.model.config._attn_implementation == "dspine_sdpa_gqa"
    ids = torch.randint(target.info.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0)).cuda()

    def run():
        feats = target.features(ids, [0, 1])
        cache = target.new_cache()
        target.forward(ids[:, :39], cache)
        return feats, target.forward(ids[:, 39:], cache)[0]

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        got = run()
    target.model.set_attn_implementation("sdpa")
    ref = run()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_draft_trees_on_cuda_stay_lossless(tiny):
    """Tree rounds on an fp32 CUDA target (its grouped-KV SDPA path under the 4-D tree mask, the accepted path's
    KV entries moved on the GPU): greedy = AR, in a single request and a one-row batch; sampled rounds near T = 0
    too; sampled rounds at T = 1 accept and stay within the tree."""
    import copy

    from dspine.engine import generate_batch
    from dspine.target import Target

    cpu, pairs = tiny
    target = Target(copy.deepcopy(cpu.model).to("cuda"), cpu.tokenizer, name="tiny-cuda")
    drafter = copy.deepcopy(_trained(cpu, pairs, "dspine")).to("cuda")
    eng, ar = Engine(target, drafter, tree="0000.1.01"), Engine(target)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    cold = SamplingParams(max_tokens=40, temperature=1e-4, seed=1, ignore_eos=True)
    for ids, start in pairs[:3]:
        want = ar.generate(ids[:start], greedy).token_ids
        got = eng.generate(ids[:start], greedy)
        assert got.token_ids == want and got.stats.tau > 1.0
        assert eng.generate(ids[:start], cold).token_ids == want
        assert generate_batch(eng, [ids[:start]], greedy)[0].token_ids == want
        hot = eng.generate(ids[:start], SamplingParams(max_tokens=40, temperature=1.0, seed=2, ignore_eos=True))
        assert len(hot.token_ids) == 40 and not any(hot.stats.accept_hist[eng.tree.depth + 1 :])


def test_goodput_rounds_draft_what_their_cost_allows_and_stay_ar(tiny):
    """Engine(goodput=True): each batched round drafts 0 .. draft_len tokens by goodput (dspine/goodput.py).
    The measured seconds are replaced here by a cost (deterministic, unlike a clock). The first two rounds
    draft all (the first round of a shape is not fitted: its kernels are being built), the next two none (a
    second size of round, to measure the cost's slope); then, where verifying rows is free, the rounds draft
    all, where each row costs more than any acceptance can return, none — and every row is AR's output either
    way; at T = 1 they run their lengths."""
    from dspine.engine import generate_batch

    target, pairs = tiny
    ar = Engine(target)
    drafter = _trained(target, pairs, "dspine")
    prompts = [ids[: start - k] for k, (ids, start) in enumerate(pairs[:4])]
    lengths = [30, 12, 24, 18]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    want = [ar.generate(p, q).token_ids for p, q in zip(prompts, params)]
    for cost, later in ((lambda r, s: 0.02, {5}), (lambda r, s: 0.05 * r + 0.05 * s, {0})):
        eng = Engine(target, drafter, draft_len=5, goodput=True)
        observe, choose, chosen = eng.policy.observe, eng.policy.choose, []
        eng.policy.observe = lambda r, s, sec, shape, observe=observe, cost=cost: observe(r, s, cost(r, s), shape)
        eng.policy.choose = lambda rows, n, choose=choose, chosen=chosen: chosen.append(choose(rows, n)) or chosen[-1]
        got = generate_batch(eng, prompts, params)
        assert [g.token_ids for g in got] == want
        assert chosen[:4] == [5, 5, 0, 0] and set(chosen[4:]) == later
        drafted = sum(g.stats.rounds for g in got)
        assert drafted > 4 * len(prompts) if later == {5} else drafted == 2 * len(prompts)  # the first two rounds
        T1 = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, seed=2) for n in lengths]
        assert [len(g.token_ids) for g in generate_batch(eng, prompts, T1)] == lengths


def test_draft_policy_weighs_acceptance_against_the_cost_of_rows():
    """goodput.DraftPolicy: the fitted cost line reproduces a linear cost; unmeasured slopes look free (so
    drafting is tried); rows that accept their drafts get them all, rows that reject them get none."""
    from dspine.goodput import DraftPolicy

    p = DraftPolicy(3)
    assert p.choose([p.new_row()], 8) == 3  # nothing measured yet: draft all
    p.observe(8, False, 5.0)  # the first round of its shape: not fitted
    assert p.choose([p.new_row()], 8) == 3 and not p.gram.any()
    for _ in range(10):
        p.observe(8, False, 0.05)
    assert p.seconds(32, True) == pytest.approx(0.05, rel=0.02)  # always 8 rows: the slopes unknown, ~0
    assert p.choose([p.new_row() for _ in range(8)], 8) == 3  # so the next round measures 32 rows
    line = lambda r, s: 0.03 + 0.0025 * r + 0.01 * s
    for r, s in [(8, False), (32, True), (16, True), (24, True), (8, False), (4, False), (16, True)] * 5:
        p.observe(r, s, line(r, s))
    for r, s in [(8, False), (32, True), (12, True)]:
        assert p.seconds(r, s) == pytest.approx(line(r, s), rel=0.05)
    good, bad = p.new_row(), p.new_row()
    for _ in range(30):
        p.record(good, 3, 3)
        p.record(bad, 3, 0)
    assert (good.reach, good.acc, bad.reach, bad.acc) == ([30] * 3, [30] * 3, [30, 0, 0], [0, 0, 0])
    e_good, e_bad = p.expected([good]), p.expected([bad])
    assert e_good[0] == e_bad[0] == 1 and e_good[3] > 3.5 and e_bad[3] < 1.2
    assert p.choose([good] * 8, 8) == 3 and p.choose([bad] * 8, 8) == 0
    with pytest.raises(ValueError, match="at least 1"):
        DraftPolicy(0)


@pytest.mark.parametrize("method", ["ar", "dspine"])
def test_stream_keeps_c_in_flight_and_uneven_prompts_prefill_apart(tiny, method, monkeypatch):
    """engine.generate_stream: at most c requests decode together, a finished one replaced at once; each gives
    its single-request AR output; `timings` counts the prefills' seconds and the rounds. Prompts of very uneven
    lengths are prefilled one forward each (no padding to the longest), even ones in one forward, with the same
    outputs."""
    from dspine.engine import BatchDecode, generate_stream

    target, pairs = tiny
    ar = Engine(target)
    eng = Engine(target, _trained(target, pairs, method) if method != "ar" else None)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, target.info.vocab_size, (n,), generator=g).tolist() for n in (48, 3, 40, 5, 7, 30)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 6, 14, 9, 25, 11)]
    want = [ar.generate(p, q).token_ids for p, q in zip(prompts, params)]
    for c in (1, 2, 4):
        timings: dict = {}
        got = generate_stream(eng, prompts, params, c, timings)
        assert [r.token_ids for r in got] == want
        assert max(r.batch_size for r in got) == c
        assert timings["prefill_s"] > 0
        if method == "ar" and c == 1:  # one round per token after the prefill's
            assert timings["rounds"] == sum(q.max_tokens - 1 for q in params)
        else:
            assert 0 < timings["rounds"] < sum(q.max_tokens - 1 for q in params)
    forwards = []
    real = target.forward
    monkeypatch.setattr(target, "forward", lambda ids, *a, **k: forwards.append(ids.shape) or real(ids, *a, **k))
    BatchDecode(eng, prompts[:3], params[:3])  # 48, 3, 40 tokens: padding to 48 would cost more
    BatchDecode(eng, prompts[3:5], params[3:5])  # 5, 7: both shorter than a forward's fixed cost
    assert forwards == [(1, 48), (1, 3), (1, 40), (2, 7)]
    with pytest.raises(ValueError, match="at least 1"):
        generate_stream(eng, prompts, params, 0)


def test_draft_context_projects_waiting_columns_as_if_extended_one_by_one(tiny):
    """engine.DraftContext: columns extended lazily (rounds that do not draft) are projected together when the
    K/V are next read — the same K/V as extending them one round at a time; replacing the K/V while columns
    wait is refused."""
    from dspine.engine import DraftContext

    target, pairs = tiny
    drafter = _trained(target, pairs, "dspine")
    feats = torch.randn(2, 7, drafter.fc.in_features, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(7).expand(2, 7)
    eager, lazy = DraftContext(drafter), DraftContext(drafter)
    for ctx, waits in ((eager, False), (lazy, True)):
        ctx.extend(feats[:, :4], pos[:, :4])
        for j in range(4, 7):
            ctx.extend(feats[:, j : j + 1], pos[:, j : j + 1], lazy=waits)
    assert len(lazy._waiting) == 3
    with pytest.raises(RuntimeError, match="projected before"):
        lazy.kv = eager.kv
    for (k0, v0), (k1, v1) in zip(eager.kv, lazy.kv):
        assert k1.shape[2] == 7
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-6)
    assert not lazy._waiting
