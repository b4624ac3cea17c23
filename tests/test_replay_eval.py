"""Acceptance at T = 0 by replay (dspine.eval.replay.replay_benchmarks): every drafter replayed on the target's
greedy answers is what decoding with it accepts, pairs get their ratio with an interval over items, and the
recipe's replay evaluation is configured strictly."""

import dataclasses
import time

import pytest
import torch

from dspine.checkpoint import load_drafter, resolve_drafter
from dspine.config import ConfigError
from dspine.engine import Engine
from dspine.eval.replay import (
    combine_seeds,
    greedy_answers,
    greedy_completions,
    pair_ratios,
    replay,
    replay_benchmarks,
    replay_markdown,
    seeds_markdown,
    split_seed_variants,
)
from dspine.sampling import SamplingParams
from dspine.train.recipe import RecipeConfig, acceptance_summary
from dspine.workloads import load_benchmark


def test_replayed_acceptance_is_what_decoding_accepts_and_pairs_get_intervals(smollm2):
    shipped = load_drafter(resolve_drafter("builtin", "smollm2-135m-instruct"), smollm2)
    noisy = load_drafter(resolve_drafter("builtin", "smollm2-135m-instruct"), smollm2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a weaker twin: the shipped weights with noise on the injection writes
        for inj in noisy.injections.values():
            inj.write.weight.add_(torch.randn(inj.write.weight.shape, generator=g) * 0.05)
    drafters = {"shipped": shipped, "noisy": noisy}
    doc = replay_benchmarks(smollm2, drafters, ["gsm8k", "mt_bench"], 2, 24, batch_size=4, progress=False)
    assert doc["items"] == {"gsm8k": 2, "mt_bench": 2} and doc["tokens"] > 40
    # decoding each item with the shipped drafter gives the replayed answer and the same rounds; only the last
    # round's count can differ (decoding also counts drafts accepted past the token limit, cut from its output)
    turns = [it.turns[0] for b in ("gsm8k", "mt_bench") for it in load_benchmark(b, 2)]
    answers = greedy_answers(smollm2, turns, 24, batch_size=4)
    got = [r for b in ("gsm8k", "mt_bench") for r in doc["results"][b]["shipped"]["per_request"]]
    for turn, (prompt, answer), (acc, rounds) in zip(turns, answers, got):
        res = Engine(smollm2, shipped).generate(turn, SamplingParams(max_tokens=24, temperature=0.0))
        assert res.token_ids == answer and rounds == res.stats.rounds
        (rep,) = replay(smollm2, {"s": shipped}, [("s", prompt, answer)], progress=False)
        assert sum(abs(a - b) for a, b in zip(rep["accept_hist"], res.stats.accept_hist)) <= 2
        assert rep["accepted"] == acc <= res.stats.accepted
    pooled = doc["pooled"]["shipped"]["tau_pooled"]
    every = [r for b in doc["results"].values() for r in b["shipped"]["per_request"]]
    assert pooled == pytest.approx(sum(a + r for a, r in every) / sum(r for _, r in every))
    pairs = pair_ratios(doc, {"shipped": "noisy", "noisy": "noisy"}, draws=300)
    p = pairs["shipped"]
    assert p["ratio_pooled"] == pytest.approx(pooled / doc["pooled"]["noisy"]["tau_pooled"])
    assert p["items"] == 4 and p["ratio_ci"][0] <= p["ratio_pooled"] <= p["ratio_ci"][1]
    assert pairs["noisy"]["ratio_pooled"] == 1.0 and pairs["noisy"]["ratio_ci"] == [1.0, 1.0]
    md = replay_markdown({**doc, "pairs": pairs})
    assert "| shipped | noisy |" in md and "ratio pooled" in md
    summary = acceptance_summary({**doc, "pairs": pairs})
    assert summary["mode"] == "replay" and summary["items_per_benchmark"] == 2 and summary["max_new_tokens"] == 24
    assert summary["best_pair"] == max(pairs, key=lambda v: pairs[v]["ratio_pooled"])


def test_the_recipe_replay_evaluation_refuses_what_it_cannot_do():
    levers = RecipeConfig.levers()
    levers.validate()
    variants = levers.variants()
    for v, twin in levers.eval_pairs.items():  # every lever against a DFlash of its own depth
        assert variants[v].method == "dspine" and variants[twin].method == "dflash"
        depth = lambda n: variants[n].drafter.get("num_hidden_layers", levers.layers)
        assert depth(v) == depth(twin), v
    assert set(levers.eval_pairs) == {n for n, a in variants.items() if a.method == "dspine"}
    cfg = RecipeConfig.cpu_tiny()
    dataclasses.replace(cfg, eval_mode="replay", eval_pairs={"dspine": "dflash"}).validate()
    with pytest.raises(ConfigError, match="eval_mode 'fast'"):
        dataclasses.replace(cfg, eval_mode="fast").validate()
    with pytest.raises(ConfigError, match="eval_trees and eval_top_k need generate"):
        dataclasses.replace(cfg, eval_mode="replay", eval_top_k=[2]).validate()
    with pytest.raises(ConfigError, match="eval_pairs"):
        dataclasses.replace(cfg, eval_mode="replay", eval_pairs={"dspine": "medusa"}).validate()
    with pytest.raises(ConfigError, match="eval_budget_s -1"):
        dataclasses.replace(cfg, eval_budget_s=-1).validate()


def test_a_replay_cut_at_its_deadline_goes_on_from_its_cache_and_a_retrained_drafter_is_replayed_again(
    smollm2, tmp_path, monkeypatch
):
    from dspine.eval import replay as replay_module

    first = load_drafter(resolve_drafter("builtin", "smollm2-135m-instruct"), smollm2)
    second = load_drafter(resolve_drafter("builtin", "smollm2-135m-instruct"), smollm2)
    drafters, cache = {"first": first, "second": second}, tmp_path / "cache"
    run = lambda **kw: replay_benchmarks(smollm2, drafters, ["gsm8k"], 2, 16, batch_size=2, progress=False, **kw)
    with pytest.raises(replay_module.ReplayIncomplete, match="0 of 2 drafters") as e:
        run(cache=cache, deadline=time.time() - 1)  # the answers are kept, no replay starts
    assert e.value.done == 0 and (cache / "answers.json").is_file() and not (cache / "replay-first.json").exists()
    whole = run()  # no cache: everything from scratch
    cut = run(cache=cache, deadline=time.time() + 3600)
    assert cut["results"] == whole["results"] and cut["pooled"] == whole["pooled"]
    monkeypatch.setattr(replay_module, "greedy_answers", lambda *a, **k: pytest.fail("answers recomputed"))
    monkeypatch.setattr(replay_module, "replay", lambda *a, **k: pytest.fail("a kept replay recomputed"))
    assert run(cache=cache, deadline=time.time() - 1)["results"] == whole["results"]  # all kept: nothing starts
    with torch.no_grad():  # trained further: same config, other weights -> its replay is stale
        next(iter(second.injections.values())).write.weight.mul_(0.5)
    with pytest.raises(replay_module.ReplayIncomplete, match="1 of 2 drafters"):
        run(cache=cache, deadline=time.time() - 1)


def test_drafters_replaying_the_same_prompts_share_one_prefill(smollm2, monkeypatch):
    """replay(prefix_tokens=N): each batch of prompts is prefilled once for every drafter (the later drafters
    reuse all but the last prompt token, and a later turn extending an earlier prompt reuses it), and every
    drafter's acceptance is what it is without the shared cache."""
    from dspine.target import Target

    shipped = load_drafter(resolve_drafter("builtin", "smollm2-135m-instruct"), smollm2)
    noisy = load_drafter(resolve_drafter("builtin", "smollm2-135m-instruct"), smollm2)
    with torch.no_grad():
        for inj in noisy.injections.values():
            inj.write.weight.mul_(0.5)
    drafters = {"shipped": shipped, "noisy": noisy}
    turns = [it.turns[0] for it in load_benchmark("mt_bench", 3)]
    answers = greedy_answers(smollm2, turns, 16, batch_size=3)
    p0, a0 = answers[0]
    said = smollm2.tokenizer.decode(a0, skip_special_tokens=True)
    talk = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": said}]
    longer = smollm2.chat_ids([*talk, {"role": "user", "content": "Go on."}])  # a later turn of the first one
    assert longer[: len(p0)] == p0
    answers.append((longer, greedy_completions(smollm2, [longer], 16)[0]))
    jobs = [(n, p, a) for p, a in answers for n in drafters]
    fed = []
    real = Target.forward
    monkeypatch.setattr(
        Target, "forward", lambda self, ids, *a, **k: fed.append(ids.numel()) or real(self, ids, *a, **k)
    )
    alone = replay(smollm2, drafters, jobs, progress=False, batch_size=2)
    cost_alone, fed[:] = sum(fed), []
    shared = replay(smollm2, drafters, jobs, progress=False, batch_size=2, prefix_tokens=8192)
    assert shared == alone
    prompts = sum(len(p) for p, _ in answers)
    assert cost_alone - sum(fed) >= prompts - 2 * len(answers)  # one drafter's prefills nearly all saved, or more


def _seed_doc(seed: int, rows: dict) -> dict:
    """A replay document as the recipe writes it, from {benchmark: {drafter: [(accepted, rounds), ...]}}."""
    tau = lambda rs: sum(a + r for a, r in rs) / sum(r for _, r in rs)
    names = list(next(iter(rows.values())))
    doc = {
        "mode": "replay",
        "results": {
            b: {n: {"tau_pooled": tau(rs), "per_request": [list(x) for x in rs]} for n, rs in by.items()}
            for b, by in rows.items()
        },
        "pooled": {n: {"tau_pooled": tau([x for by in rows.values() for x in by[n]])} for n in names},
        "mean": {n: sum(tau(by[n]) for by in rows.values()) / len(rows) for n in names},
        "items": {b: len(next(iter(by.values()))) for b, by in rows.items()},
        "limit": 3,
        "max_new_tokens": 64,
        "target": "t",
        "tokens": 500,
        "recipe": {"train": {"seed": seed}},
        "train_report": {"train": {"steps": 10 + seed, "seconds": 60.0}},
        "heldout": {n: {"tau_sim": 2.0 + seed, "slot_acc": [0.6, 0.4]} for n in names},
        "git_sha": "abc",
        "command": "cmd",
        "hardware": "hw",
    }
    doc["pairs"] = pair_ratios(doc, {"v": "twin"}, draws=300)
    return doc


def test_seeds_combine_into_one_ratio_over_every_seeds_items_with_each_seed_beside():
    s0 = {
        "a": {"v": [(6, 3), (2, 2), (9, 3)], "twin": [(4, 3), (2, 2), (6, 3)]},
        "b": {"v": [(3, 2), (8, 4), (1, 1)], "twin": [(2, 2), (8, 5), (1, 1)]},
    }
    s1 = {
        "a": {"v": [(5, 3), (3, 2), (7, 3)], "twin": [(5, 3), (1, 2), (7, 3)]},
        "b": {"v": [(2, 2), (9, 4), (2, 1)], "twin": [(2, 2), (6, 4), (0, 1)]},
    }
    d0, d1 = _seed_doc(0, s0), _seed_doc(1, s1)
    doc = combine_seeds([d0, d1], draws=300)
    p = doc["pairs"]["v"]
    every = [(a, b) for s in (s0, s1) for by in s.values() for a, b in zip(by["v"], by["twin"])]
    tv = sum(a + r for (a, r), _ in every) / sum(r for (_, r), _ in every)
    tt = sum(a + r for _, (a, r) in every) / sum(r for _, (_, r) in every)
    assert p["ratio_pooled"] == pytest.approx(tv / tt) and p["items"] == 6  # items, not rows: seeds go together
    assert p["ratio_ci"][0] <= p["ratio_pooled"] <= p["ratio_ci"][1]
    assert [x["ratio_pooled"] for x in p["per_seed"]] == [
        d0["pairs"]["v"]["ratio_pooled"],
        d1["pairs"]["v"]["ratio_pooled"],
    ]
    assert doc["seeds"] == [0, 1] and doc["mean"]["v"] == pytest.approx((d0["mean"]["v"] + d1["mean"]["v"]) / 2)
    md = seeds_markdown(doc)
    assert "| v | twin |" in md and "seed 1" in md and "11 steps" in md
    summary = acceptance_summary(doc)
    assert summary["mode"] == "replay_seeds" and summary["seeds"] == [0, 1] and summary["best_pair"] == "v"
    assert summary["ratio_pooled"] == p["ratio_pooled"] and summary["items_per_benchmark"] == 3
    # not comparable: other items, another token limit, other pairs, one seed
    short = _seed_doc(1, {b: {n: rs[:2] for n, rs in by.items()} for b, by in s1.items()})
    with pytest.raises(ValueError, match="items"):
        combine_seeds([d0, short])
    with pytest.raises(ValueError, match="max_new_tokens"):
        combine_seeds([d0, {**d1, "max_new_tokens": 512}])
    with pytest.raises(ValueError, match="pairs"):
        combine_seeds([d0, {**d1, "pairs": {}}])
    with pytest.raises(ValueError, match="two or more"):
        combine_seeds([d0])


def test_second_seeds_trained_in_the_same_lockstep_split_into_documents_that_combine_like_separate_runs():
    s0 = {
        "a": {"v": [(6, 3), (2, 2)], "twin": [(4, 3), (2, 2)]},
        "b": {"v": [(3, 2), (8, 4)], "twin": [(2, 2), (8, 5)]},
    }
    s1 = {
        "a": {"v": [(5, 3), (3, 2)], "twin": [(5, 3), (1, 2)]},
        "b": {"v": [(2, 2), (9, 4)], "twin": [(2, 2), (6, 4)]},
    }
    separate = combine_seeds([_seed_doc(0, s0), _seed_doc(1, s1)], draws=300)
    one = {  # one run: seed 1's drafters as v_s1 and twin_s1 beside them, and a variant of seed 0 only
        b: {**s0[b], "v_s1": s1[b]["v"], "twin_s1": s1[b]["twin"], "w": s0[b]["v"]} for b in s0
    }
    doc = _seed_doc(0, one)
    doc["pairs"] = pair_ratios(doc, {"v": "twin", "v_s1": "twin_s1", "w": "twin"}, draws=300)
    docs = split_seed_variants(doc)
    assert [d["recipe"]["train"]["seed"] for d in docs] == [0, 1]
    assert [sorted(d["pooled"]) for d in docs] == [["twin", "v"], ["twin", "v"]]  # w has no second seed: left out
    assert docs[1]["pairs"]["v"]["twin"] == "twin" and docs[1]["heldout"]["v"] == doc["heldout"]["v_s1"]
    assert docs[1]["results"]["a"]["v"] == doc["results"]["a"]["v_s1"]
    joined = combine_seeds(docs, draws=300)
    assert joined["seeds"] == [0, 1]
    assert joined["pairs"]["v"]["ratio_pooled"] == pytest.approx(separate["pairs"]["v"]["ratio_pooled"])
    assert split_seed_variants(_seed_doc(0, s0)) == [_seed_doc(0, s0)]  # no second seed: the document as it is
