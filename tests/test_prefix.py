"""Prefix caching (dspine/prefix.py): a prompt that begins with an earlier one prefills only the rest, and decoding
stays AR's token for token (fp32, T = 0; seeded sampling alike) for AR, DSpine chains and trees and the hybrid,
single and batched; the structure's matching, layer keys, budget and eviction."""

from __future__ import annotations

import random

import torch
from conftest import CHAT_PROMPTS, brief_train, tiny_target

from dspine.drafter import DSpineDraftModel
from dspine.engine import Engine, generate_batch, generate_stream
from dspine.prefix import PrefixCache
from dspine.sampling import SamplingParams
from dspine.suffix import SuffixConfig


def _turns(vocab: int, seed: int = 0) -> list[list[int]]:
    """An agent's conversation as prompts: a shared system prefix, then each turn extends the one before."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(48)]
    turns, cur = [], list(system)
    for _ in range(3):
        cur = cur + [rng.randrange(vocab) for _ in range(rng.randrange(12, 30))]
        turns.append(list(cur))
    other = system + [rng.randrange(vocab) for _ in range(20)]  # another conversation, same system prompt
    return turns + [other, list(turns[1])]  # and the second turn's prompt again


def test_reused_prefills_decode_as_ar_for_every_method_single_and_batched():
    target = tiny_target("llama")
    prompts = _turns(target.info.vocab_size)
    pairs = [(p + Engine(target).generate(p, SamplingParams(max_tokens=24)).token_ids, len(p)) for p in prompts]
    drafter = brief_train(DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2), target, pairs, 20)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [Engine(target).generate(p, greedy).token_ids for p in prompts]
    variants = {
        "ar": lambda c: Engine(target, prefix_cache=c),
        "chain": lambda c: Engine(target, drafter, draft_len=3, prefix_cache=c),
        "tree": lambda c: Engine(target, drafter, tree="000.1", prefix_cache=c),
        "hybrid": lambda c: Engine(target, drafter, tree="000.1", suffix=SuffixConfig(), prefix_cache=c),
    }
    for name, make in variants.items():
        cache = PrefixCache(max_tokens=4096, min_match=16)
        eng = make(cache)
        got = [eng.generate(p, greedy) for p in prompts]
        assert [g.token_ids for g in got] == want, name
        if name != "ar":  # the drafter's context came from the kept features: it drafts as after a full prefill
            ref = [make(None).generate(p, greedy).stats.accept_hist for p in prompts]
            assert [g.stats.accept_hist for g in got] == ref, name
        # turn 1 is new; turns 2, 3 reuse the turn before whole; the other conversation its system prompt; the
        # repeated prompt all but its last token (whose logits start the decode)
        expect = [0, len(prompts[0]), len(prompts[1]), 48, len(prompts[1]) - 1]
        assert [g.cached_tokens for g in got] == expect, name
        assert cache.hits == 4 and cache.reused_tokens == sum(expect)
        # batched: rows with and without a reused prefix prefilled apart and stacked, then decoded together
        fresh = PrefixCache(max_tokens=4096, min_match=16)
        eng = make(fresh)
        eng.generate(prompts[0], greedy)
        batched = generate_batch(eng, [prompts[2], prompts[3], prompts[0]], greedy)
        assert [g.token_ids for g in batched] == [want[2], want[3], want[0]], name
        assert [g.cached_tokens for g in batched] == [len(prompts[0]), 48, len(prompts[0]) - 1], name
        streamed = generate_stream(make(PrefixCache(max_tokens=4096, min_match=16)), prompts, greedy, 2)
        assert [g.token_ids for g in streamed] == want, name


def test_sampled_decoding_with_a_reused_prefill_draws_what_a_full_prefill_draws():
    """T = 1, one seed: the reused columns hold what a full prefill computes, so the same draws follow."""
    target = tiny_target("qwen3")
    prompts = _turns(target.info.vocab_size, seed=1)
    drafter = DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2)
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    for make in (
        lambda c: Engine(target, prefix_cache=c),
        lambda c: Engine(target, drafter, tree="00.1", prefix_cache=c),
    ):
        plain, cached = make(None), make(PrefixCache(min_match=16))
        for q in prompts:
            a, b = plain.generate(q, p), cached.generate(q, p)
            assert a.token_ids == b.token_ids
        assert cached.prefix_cache.hits == 4


def test_real_target_turns_reuse_the_system_prompt_and_the_turn_before(smollm2):
    from dspine.checkpoint import load_drafter
    from dspine.drafters import builtin_drafter

    system = {"role": "system", "content": "You are an agent with a shell. " + " ".join(CHAT_PROMPTS)}
    turn1 = [system, {"role": "user", "content": "List the files, then read README.md."}]
    p = SamplingParams(max_tokens=24)
    drafter = load_drafter(builtin_drafter("smollm2-135m-instruct"), smollm2, dtype=torch.float32)
    ar, hybrid = Engine(smollm2), Engine(smollm2, drafter, tree="0000.1", suffix=SuffixConfig())
    hybrid.prefix_cache = PrefixCache()
    first = ar.generate(turn1, p)
    turn2 = turn1 + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "README.md says: run `make demo`. What next?"},
    ]
    got = [hybrid.generate(m, p) for m in (turn1, turn2)]
    assert got[0].token_ids == first.token_ids and got[1].token_ids == ar.generate(turn2, p).token_ids
    assert got[0].cached_tokens == 0 and got[1].cached_tokens == len(smollm2.chat_ids(turn1))


def test_the_cache_keys_features_by_layers_keeps_its_budget_and_drops_what_a_longer_entry_holds():
    target = tiny_target("llama")
    ar = Engine(target)
    drafter = DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2)
    a, b = _turns(target.info.vocab_size)[:2]
    cache = PrefixCache(max_tokens=2 * len(b) + 23, min_match=8)
    ar.prefix_cache = cache
    ar.generate(a, SamplingParams(max_tokens=2))
    assert len(cache) == 1 and cache.tokens == len(a)
    # a drafter needs the layer features: an AR entry holds none, so it is not reused there (and AR reuses a
    # drafter's entry, whose K/V are the same)
    spec = Engine(target, drafter, draft_len=2, prefix_cache=cache)
    assert spec.generate(b, SamplingParams(max_tokens=2)).cached_tokens == 0
    assert len(cache) == 1 and cache.tokens == len(b)  # b extends a and holds more: a is dropped
    assert ar.generate(b + [1, 2, 3], SamplingParams(max_tokens=2)).cached_tokens == len(b)
    assert len(cache) == 2 and cache.tokens == 2 * len(b) + 3  # the AR extension kept beside b's features
    # over the budget: the least recently used goes first
    other = [5] * 40
    ar.generate(other, SamplingParams(max_tokens=2))
    assert cache.tokens == len(b) + 3 + 40 <= cache.max_tokens and cache.lookup(other)[0] == len(other) - 1
    assert cache.stats()["entries"] == len(cache) == 2 and cache.stats()["lookups"] == 5
    # a prompt longer than the whole budget is not kept; a short match is no match
    ar.generate([7] * (cache.max_tokens + 1), SamplingParams(max_tokens=1))
    assert len(cache) == 2 and cache.lookup(other[:4] + [9] * 10) == (0, None)
