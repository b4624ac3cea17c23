"""Speculative output equals autoregressive output token for token at temperature 0 (fp32)."""

import pytest
import torch
from conftest import CHAT_PROMPTS, METHODS, brief_train, perturb_writes

from dspine.drafter import DSpineDraftModel
from dspine.engine import Engine
from dspine.sampling import SamplingParams


def _trained(target, pairs, method):
    """A 2-layer, block-8 drafter of `method` briefly trained on the tiny target's later pairs."""
    d = DSpineDraftModel.for_target(target, method=method, num_hidden_layers=2, block_size=8, top_k=4, seed=4)
    return brief_train(d, target, pairs[4:], steps=40)


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
    target, pairs = tiny
    drafter = _trained(target, pairs, method)
    spec, params = Engine(target, drafter), SamplingParams(max_tokens=40, ignore_eos=True)
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
    with pytest.raises(Exception, match="forced continuation needs greedy"):
        spec.generate(pairs[0][0][:4], SamplingParams(temperature=1.0), forced=[1, 2])


@pytest.mark.parametrize("method", ["dflash", "dspine"])
def test_shorter_draft_len_stays_lossless(tiny, method):
    """Verifying only the first D drafts of each block (a decode-time choice) keeps AR's output, single and
    batched, and no round accepts more than D drafts."""
    from dspine.engine import generate_batch

    target, pairs = tiny
    ar = Engine(target)
    drafter = _trained(target, pairs, method)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [ids[:start] for ids, start in pairs[:3]]
    for D in (1, 3):
        eng = Engine(target, drafter, draft_len=D)
        for p in prompts:
            got = eng.generate(p, params)
            assert got.token_ids == ar.generate(p, params).token_ids
            assert not any(got.stats.accept_hist[D + 1 :])  # accept_hist[n]: rounds that accepted n drafts
        assert [g.token_ids for g in generate_batch(eng, prompts, params)] == [
            ar.generate(p, params).token_ids for p in prompts
        ]
    with pytest.raises(ValueError, match="draft_len must be in \\[1, 7\\]"):
        Engine(target, drafter, draft_len=8)
