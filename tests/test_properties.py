"""Properties of the method's parts: whitened codes, zero writes = DFlash, transition cache = naive
recomputation, exact checkpoint round trip, acceptance stats, sampling warp, typed configs."""

import dataclasses
import json

import pytest
import torch
from conftest import perturb_writes, tiny_target

from dspine.checkpoint import config_to_json, load_drafter, save_drafter
from dspine.config import ConfigError, apply_overrides, from_dict
from dspine.decoding import DraftTree, propose, propose_tree, transition_scores
from dspine.drafter import DSpineDraftModel
from dspine.sampling import SamplingParams, warp_probs
from dspine.stats import AcceptanceStats, simulated_tau, summarize
from dspine.train.loop import TrainConfig, train_drafter
from dspine.transfer import build_transfer_space


def _block(drafter, target, n_ctx=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    V = target.info.vocab_size
    ids = torch.randint(0, V, (2, n_ctx + 1), generator=g)
    _, feats = target.forward(ids[:, :-1], None, drafter.config.target_layer_ids)
    ctx = drafter.context_kv(feats, torch.arange(n_ctx).expand(2, -1))
    B = drafter.config.block_size
    pos = torch.arange(n_ctx, n_ctx + B).expand(2, -1)[:, None]
    return drafter.block_inputs(ids[:, -1:], B), pos, ctx


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_code_table_is_whitened(which, smollm2):
    target = tiny_target("qwen3") if which == "tiny" else smollm2
    r = 32 if which == "tiny" else 256
    ts = build_transfer_space(target.head_weight, r)
    V = target.info.vocab_size
    assert ts.codes.shape == (V, r)
    c = ts.codes.double()
    assert c.mean(0).abs().max() < 1e-4
    cov = c.T @ c / V
    assert (cov - torch.eye(r, dtype=cov.dtype)).abs().max() < 1e-3


def test_zero_writes_give_dflash_logits():
    target = tiny_target("llama")
    dflash = DSpineDraftModel.for_target(target, method="dflash", num_hidden_layers=3, block_size=8, seed=5)
    for method in ("dspine", "post_backbone"):
        m = DSpineDraftModel.for_target(target, method=method, num_hidden_layers=3, block_size=8, seed=6)
        missing, unexpected = m.load_state_dict(dflash.state_dict(), strict=False)
        assert not unexpected and all(k.startswith(("injections.", "transfer_codes")) for k in missing)
        block, pos, ctx = _block(m, target)
        a = dflash.logits(dflash(block, pos, ctx).hidden)
        b = m.logits(m(block, pos, ctx).hidden)
        assert torch.equal(a, b)
        perturb_writes(m)
        c = m.logits(m(block, pos, ctx).hidden)
        assert not torch.allclose(a[:, :, 1:], c[:, :, 1:])  # the injection path is live once W != 0
        if method == "post_backbone":  # the anchor slot is never written (earlier layers could attend to writes)
            assert torch.equal(a[:, :, 0], c[:, :, 0])


def test_anchor_write_off_leaves_slot_1_without_the_anchor_s_code():
    """anchor_write=False: the anchor's code no longer reaches slot 1 (a different code table row for the anchor
    changes nothing), while with it on it does; the setting travels in the checkpoint's dspine_config."""
    target = tiny_target("llama")
    for on in (True, False):
        d = perturb_writes(
            DSpineDraftModel.for_target(target, num_hidden_layers=2, block_size=6, seed=3, anchor_write=on)
        )
        block, pos, ctx = _block(d, target)
        a = d(block, pos, ctx).hidden
        with torch.no_grad():
            d.transfer_codes[block[..., 0].flatten()] += 3.0  # move the anchors' codes
        b = d(block, pos, ctx).hidden
        assert torch.equal(a, b) != on, on
    assert config_to_json(d.config)["dspine_config"]["anchor_write"] is False


@pytest.mark.parametrize("method", ["dspine", "post_backbone"])
def test_transition_scores_equal_naive_recomputation(method):
    target = tiny_target("qwen3")
    d = perturb_writes(
        DSpineDraftModel.for_target(target, method=method, num_hidden_layers=2, block_size=6, top_k=5, seed=2)
    )
    block, pos, ctx = _block(d, target)
    out = d(block, pos, ctx)
    last = d.config.num_hidden_layers - 1
    inj, f, h_pre = d.injections[str(last)], out.feats[last][:, 0], out.h_pre[:, 0]
    logits = d.logits(out.hidden[:, 0, 1:])
    cand = logits.topk(5, dim=-1).indices
    S = transition_scores(inj, d.norm, d.head, d.transfer_codes, h_pre, f, cand)
    N, B = 2, 6
    assert S.shape == (N, B - 2, 5, 5)
    for n in range(N):
        for t in range(2, B):
            for i, a in enumerate(cand[n, t - 2].tolist()):
                h = h_pre[n, t] + inj.write(
                    torch.sigmoid(inj.gate_f(f[n, t]) + inj.gate_p(d.transfer_codes[a]))
                    * inj.message(d.transfer_codes[a])
                )
                full = d.logits(h)
                for j, b in enumerate(cand[n, t - 1].tolist()):
                    assert torch.allclose(S[n, t - 2, i, j], full[b], atol=1e-4, rtol=1e-4)
    # slot 1 reads its unconditioned logits (its predecessor, the anchor, is already decoded)
    prop = propose(d, out, SamplingParams())
    assert torch.equal(prop.tokens[:, 0], logits[:, 0].argmax(-1))
    # the greedy walk follows the table: slot t's token is the best successor of slot t-1's token
    for n in range(N):
        for t in range(2, B):
            prev = cand[n, t - 2].tolist().index(int(prop.tokens[n, t - 2]))
            assert int(prop.tokens[n, t - 1]) == int(cand[n, t - 1, S[n, t - 2, prev].argmax()])


def test_draft_tree_nodes_follow_the_table_and_verification_walks_the_tree():
    """A tree's nodes are ranked candidates: slot 1 by its own logits, later slots by the transition table after
    the parent's token (its rank-0 chain is the greedy walk's); the greedy tree verifier follows the children
    whose token is the target's argmax at their parent, and names the target's token after the last."""
    from dspine.verify import verify_tree_greedy

    target = tiny_target("qwen3")
    d = perturb_writes(DSpineDraftModel.for_target(target, num_hidden_layers=2, block_size=6, top_k=5, seed=2))
    block, pos, ctx = _block(d, target)
    out = d(block[:1], pos[:1], [(k[:1], v[:1]) for k, v in ctx])
    tree = DraftTree.parse("0000.1.01.2")
    assert tree.paths == ((0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0))
    assert tree.parents == (-1, -1, -1, 0, 0, 3, 5) and tree.depth == 4 and str(tree) == "0000.01.1.2"
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2, 3, 4]
    assert tree.mask[5].tolist() == [True, True, False, False, False, True, False, False]  # (0,1): anchor, (0,), self
    toks, q = propose_tree(d, out, tree)
    assert q == [None] * len(toks)  # greedy: every node ranked
    assert toks[:1] + toks[3:4] + toks[5:] == propose(d, out, SamplingParams(), draft_len=4).tokens[0].tolist()
    last = d.config.num_hidden_layers - 1
    cand = d.logits(out.hidden[:, 0, 1:5]).topk(5, dim=-1).indices
    S = transition_scores(
        d.injections[str(last)], d.norm, d.head, d.transfer_codes, out.h_pre[:, 0, :5], out.feats[last][:, 0, :5], cand
    )[0]
    assert toks[1:3] == cand[0, 0, 1:3].tolist()
    assert toks[4] == int(cand[0, 1, S[0, 0].topk(2).indices[1]])  # second-best successor of slot 1's best
    V = target.info.vocab_size
    logits = torch.zeros(len(toks) + 1, V)
    logits[0, toks[0]] = logits[1, toks[4]] = logits[5, 7] = 1.0  # anchor -> (0,) -> (0,1) -> then token 7
    assert verify_tree_greedy(toks, tree.parents, logits) == ([0, 4], 7)
    logits[0] = 0
    logits[0, toks[2]] = logits[3, 9] = 1  # anchor -> (2,) -> token 9
    assert verify_tree_greedy(toks, tree.parents, logits) == ([2], 9)
    miss = next(t for t in range(V) if t not in toks[:3])
    logits[0] = 0
    logits[0, miss] = 1
    assert verify_tree_greedy(toks, tree.parents, logits) == ([], miss)
    for bad in ("", "0a", "00..1", "0,1"):
        with pytest.raises(ValueError, match="'.'-separated strings of rank digits"):
            DraftTree.parse(bad)
    # sampling: the rank-0 chain is the sampled walk (q kept: it holds each token), a rank r below it the r-th
    # best candidate other than the sampled one, and below a ranked node everything is ranked
    hot = SamplingParams(temperature=1.5)
    for seed in range(8):
        with torch.no_grad():
            toks, q = propose_tree(d, out, tree, hot, torch.Generator().manual_seed(seed))
        chain = propose(d, out, hot, torch.Generator().manual_seed(seed), draft_len=4).tokens[0].tolist()
        assert toks[:1] + toks[3:4] + toks[5:] == chain  # the same draws as the chain's walk
        assert all(q[i] is not None and float(q[i][toks[i]]) > 0 for i in (0, 3, 5, 6))
        assert q[1] is q[2] is q[4] is None
        others = [t for t in cand[0, 0].tolist() if t != toks[0]]
        assert toks[1:3] == others[:2]
        assert toks[4] != toks[3] and toks[4] in cand[0, 1].tolist()


def test_sampled_proposal_reports_its_distribution():
    target = tiny_target("llama")
    d = perturb_writes(DSpineDraftModel.for_target(target, num_hidden_layers=2, block_size=6, top_k=4))
    block, pos, ctx = _block(d, target)
    prop = propose(d, d(block, pos, ctx), SamplingParams(temperature=0.7), torch.Generator().manual_seed(0))
    assert prop.q.shape == (2, 5, target.info.vocab_size)
    assert torch.allclose(prop.q.sum(-1), torch.ones(2, 5), atol=1e-5)
    assert (prop.q.gather(2, prop.tokens[..., None]) > 0).all()  # every draft has q(x) > 0
    assert ((prop.q[:, 1:] > 0).sum(-1) <= 4).all()  # slots >= 2 sample among their K candidates


@pytest.mark.parametrize("method", ["dflash", "post_backbone", "dspine"])
def test_checkpoint_round_trip_is_exact(tmp_path, method):
    target = tiny_target("llama")
    d = perturb_writes(DSpineDraftModel.for_target(target, method=method, num_hidden_layers=2, block_size=8))
    save_drafter(d, tmp_path / "ckpt")
    e = load_drafter(tmp_path / "ckpt", target)
    assert e.config == d.config
    sa, sb = d.state_dict(), e.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    block, pos, ctx = _block(d, target)
    assert torch.equal(d(block, pos, ctx).hidden, e(block, pos, ctx).hidden)
    import json

    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["architectures"] == ["DSpineDraftModel"] and cfg["block_size"] == 8
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    assert cfg["dspine_config"]["method"] == method


def test_acceptance_stats():
    s = AcceptanceStats(4)
    for n in (3, 0, 1, 3):
        s.record(n)
    assert s.rounds == 4 and s.accepted == 7 and s.tau == pytest.approx(11 / 4)
    assert s.per_slot == pytest.approx([3 / 4, 2 / 4, 2 / 4])
    assert s.per_slot_conditional == pytest.approx([3 / 4, 2 / 3, 1.0])
    assert AcceptanceStats(4, [5, 0, 0, 0]).per_slot_conditional == [0.0, 0.0, 0.0]
    meta = s.sglang_meta()
    assert meta["spec_verify_ct"] == 4 and meta["spec_accept_length"] == pytest.approx(2.75)
    assert meta["spec_num_proposed_drafts"] == 12 and meta["spec_correct_drafts_histogram"] == [1, 1, 0, 2]
    t = AcceptanceStats(4)
    t.record(0)
    summ = summarize([s, t])
    assert summ["tau_mean"] == pytest.approx((2.75 + 1) / 2) and summ["tau_pooled"] == pytest.approx(12 / 5)
    assert AcceptanceStats.from_dict(s.to_dict()).accept_hist == s.accept_hist
    with pytest.raises(ValueError):
        s.record(4)
    assert simulated_tau([1.0, 0.5, 0.0]) == pytest.approx(2.5)


def test_warp_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -5.0]])
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and p[0, :2].sum() == pytest.approx(1.0)
    full = torch.softmax(logits, -1)[0]
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    keep = int((p[0] > 0).sum())
    assert full[: keep - 1].sum() < 0.8 <= full[:keep].sum()


def test_typed_config_and_overrides():
    cfg = from_dict(TrainConfig, apply_overrides({}, ["lr=3e-4", "steps=10"]))
    assert cfg.lr == 3e-4 and cfg.steps == 10
    assert apply_overrides({"train": {"lr": 1}}, ["train.lr=0.5"]) == {"train": {"lr": 0.5}}
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(TrainConfig, {"learning_rate": 1e-3})
    with pytest.raises(ConfigError, match="integer"):
        from_dict(TrainConfig, {"steps": "many"})
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_overrides({}, ["train.lr"])


def test_lockstep_training_equals_training_alone(tiny):
    """Drafters trained together (one target forward per batch) end bit-identical to drafters trained alone,
    also beside a drafter reading other target layers and with its own loss weights."""
    from dspine.train.loop import train_drafters

    target, pairs = tiny
    cfg = TrainConfig(steps=8, batch_size=4, anchors_per_seq=6, gamma=4.0, warmup_steps=2, lr=2e-3, eval_every=4)
    make = lambda m, L=2: DSpineDraftModel.for_target(target, method=m, num_hidden_layers=L, block_size=8)
    alone = {m: make(m) for m in ("dflash", "dspine")}
    for d in alone.values():
        train_drafter(d, target, pairs, cfg, eval_samples=pairs[:4], progress=False)
    together = {**{m: make(m) for m in ("dflash", "dspine")}, "dspine_L1": make("dspine", 1)}
    hist = train_drafters(
        together, target, pairs, cfg, eval_samples=pairs[:4], progress=False, losses={"dspine_L1": {"cos_weight": 0.0}}
    )
    for m, d in alone.items():
        a, b = d.state_dict(), together[m].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), m
    assert len(hist["dspine_L1"]) == 8 and "eval_tau_sim" in hist["dspine_L1"][-1]
    with pytest.raises(ConfigError, match="unknown loss override"):
        train_drafters({"d": make("dspine")}, target, pairs, cfg, progress=False, losses={"d": {"cos": 0.0}})


def test_the_feature_cache_runs_the_target_once_per_sample_and_trains_as_recomputing_does(tiny, monkeypatch):
    """train.feature_cache_mb: a small set seen for several epochs pays one target forward per sample (not per
    step); its features are each sample's own, so the run ends where recomputing every step ends (up to the float
    rounding of a differently shaped forward); over the budget, or seen once, nothing is kept."""
    from dspine.train.loop import Trainer, train_drafters

    target, pairs = tiny
    pairs = pairs[:8]
    cfg = TrainConfig(steps=10, batch_size=4, anchors_per_seq=6, gamma=4.0, warmup_steps=2, lr=2e-3, eval_every=10**9)
    make = lambda: {"d": DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2, block_size=8)}
    rows = []
    real = type(target).features
    count = lambda self, ids, *a, **k: rows.append(len(ids)) or real(self, ids, *a, **k)
    monkeypatch.setattr(type(target), "features", count)
    kept = make()
    train_drafters(kept, target, pairs, cfg, progress=False)
    assert sum(rows) == len(pairs)  # 40 sequences trained on, 8 forwards of one row each
    rows.clear()
    fresh = make()
    train_drafters(fresh, target, pairs, dataclasses.replace(cfg, feature_cache_mb=0), progress=False)
    assert sum(rows) == cfg.steps * cfg.batch_size
    a, b, init = kept["d"].state_dict(), fresh["d"].state_dict(), make()["d"].state_dict()
    dist = lambda x, y: sum(float((x[k].float() - y[k].float()).norm()) for k in x)
    assert dist(a, init) > 0 and dist(a, b) < 0.02 * dist(a, init)  # it trained, and as recomputing trains
    uneven = [(ids[: 20 + 3 * j], start) for j, (ids, start) in enumerate(pairs)]
    share = Trainer(make(), target, uneven, cfg)
    share.rank, share.world = 1, 2  # one process of two: its half of each global batch, as wide as the whole
    for _ in range(3):
        batch = share.next_batch()
        feats, direct = share.features(batch), share.src(batch.ids)
        assert feats.shape == direct.shape
        for row, i in enumerate(share.batch_idx):
            n = len(uneven[i][0])
            assert torch.allclose(feats[row, :n], direct[row, :n], atol=1e-5)
    tight = Trainer(make(), target, pairs, dataclasses.replace(cfg, feature_cache_mb=1e-3))
    once = Trainer(make(), target, pairs, dataclasses.replace(cfg, steps=2))  # 8 sequences of 8 samples: no reuse
    assert tight.feature_cache is None and once.feature_cache is None
    with pytest.raises(ConfigError, match="feature_cache_mb"):
        from_dict(TrainConfig, {"feature_cache_mb": -1}).validate()


def test_time_budget_stops_training_and_anneals():
    from dspine.train.loop import lr_at

    cfg = TrainConfig(steps=1000, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, time_budget_s=60)
    assert lr_at(5, cfg, 0.0) == pytest.approx(6e-4)  # warm-up follows steps
    assert lr_at(50, cfg, 1.0) == pytest.approx(1e-4)  # the schedule ends when the time does
    with pytest.raises(ConfigError, match="time_budget_s"):
        from_dict(TrainConfig, {"time_budget_s": -1})


def test_a_warm_start_continues_the_cosine_where_the_earlier_run_stopped(tiny):
    """train.schedule_offset_s: the time budget's cosine picks up after the seconds an earlier run spent of it (a
    warm start across GPU sessions), after its own warm-up; what is left of the budget ends the run."""
    target, pairs = tiny
    kw = dict(steps=50, batch_size=4, anchors_per_seq=6, warmup_steps=1, lr=1e-3, min_lr_ratio=0.1, eval_every=10**9)
    d = lambda: DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=1, block_size=8)
    cfg = TrainConfig(**kw, time_budget_s=1e4, schedule_offset_s=5e3)
    hist = train_drafter(d(), target, pairs, cfg, progress=False)
    assert hist[1]["elapsed_s"] >= 5e3
    assert hist[1]["lr"] == pytest.approx(5.5e-4, rel=1e-3)  # half-way down the cosine, not at its peak
    cfg = TrainConfig(**kw, time_budget_s=10, schedule_offset_s=9.999)
    ended = train_drafter(d(), target, pairs, cfg, progress=False)
    assert len(ended) == 1  # nothing left of the budget after one step
    for bad in ({"schedule_offset_s": 5.0}, {"schedule_offset_s": 60.0, "time_budget_s": 60.0}):
        with pytest.raises(ConfigError, match="schedule_offset_s"):
            from_dict(TrainConfig, bad)


def test_recipe_config_rejects_bad_ablations():
    from dspine.train.recipe import RecipeConfig

    base = {"ablations": {"x": {"method": "dspine", "drafter": {"transfer_rnk": 8}}}}
    with pytest.raises(ConfigError, match="transfer_rnk"):
        from_dict(RecipeConfig, base)
    with pytest.raises(ConfigError, match="unknown method"):
        from_dict(RecipeConfig, {"ablations": {"x": {"method": "medusa"}}})
    with pytest.raises(ConfigError, match="clash"):
        from_dict(RecipeConfig, {"ablations": {"dspine": {}}})
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(RecipeConfig, {"ablations": {"x": {"methd": "dspine"}}})
    with pytest.raises(ConfigError, match="eval_top_k"):
        from_dict(RecipeConfig, {"methods": ["dflash"], "eval_top_k": [16]})


def test_a_checkpoint_decodes_with_another_walk_width(tmp_path):
    """`load_at`: the transition cache's width is a decode-time setting (other settings are refused)."""
    from dspine.checkpoint import load_at

    target = tiny_target("llama")
    path = save_drafter(DSpineDraftModel.for_target(target, num_hidden_layers=1, block_size=4, top_k=8), tmp_path / "d")
    assert load_at(str(path), target, torch.float32, "cpu").config.top_k == 8
    assert load_at((str(path), {"top_k": 3}), target, torch.float32, "cpu").config.top_k == 3
    with pytest.raises(ValueError, match="not decode-time"):
        load_at((str(path), {"block_size": 8}), target, torch.float32, "cpu")


def test_pause_after_a_time_limit_then_resume_equals_a_straight_run(tiny, tmp_path):
    """train.stop_after_s pauses an invocation (saving out/last); resume finishes it exactly as one run would."""
    from dspine.train.loop import train_drafters

    target, pairs = tiny
    kw = dict(steps=12, batch_size=4, anchors_per_seq=6, gamma=4.0, warmup_steps=2, lr=2e-3, eval_every=5)
    make = lambda: {
        m: DSpineDraftModel.for_target(target, method=m, num_hidden_layers=2, block_size=8)
        for m in ("dflash", "dspine")
    }
    straight = make()
    train_drafters(straight, target, pairs, TrainConfig(**kw), eval_samples=pairs[:4], progress=False)
    paused = make()
    outs = {m: tmp_path / m for m in paused}
    h1 = train_drafters(
        paused, target, pairs, TrainConfig(**kw, stop_after_s=1e-9), eval_samples=pairs[:4], progress=False, outs=outs
    )
    assert len(h1["dspine"]) == 1 and (tmp_path / "dspine" / "last" / "trainer_state.json").is_file()
    resumed = make()
    h2 = train_drafters(
        resumed, target, pairs, TrainConfig(**kw), eval_samples=pairs[:4], progress=False, outs=outs, resume=True
    )
    assert len(h2["dspine"]) == 12 and h2["dspine"][-1]["elapsed_s"] >= h1["dspine"][-1]["elapsed_s"]
    for m in straight:
        a, b = straight[m].state_dict(), resumed[m].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), m


def test_simulated_tau_counts_what_the_walk_can_pick(tiny):
    """DSpine's simulated τ takes, for slots >= 2, the best redone score among the slot's top-K unconditioned
    candidates — what the transition-cache walk can pick: with K = 1 that is each slot's own argmax (nothing to
    walk), with K = V the full-vocabulary pick. (In between neither bound holds in general: a correct token can
    be the best of the K candidates while a token outside them scores higher over the whole vocabulary.)"""
    import random

    from dspine.train.losses import FeatureSource, drafter_losses, make_batch

    target, pairs = tiny
    d = perturb_writes(DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2, block_size=8), std=0.3)
    train_drafter(
        d,
        target,
        pairs,
        TrainConfig(steps=30, batch_size=4, anchors_per_seq=6, gamma=4.0, warmup_steps=2, lr=3e-3, eval_every=10**9),
        progress=False,
    )
    batch = make_batch(pairs[:8], 12, 8, 256, random.Random(0))
    src = FeatureSource(target, [d])
    feats = src.select(src(batch.ids), d)
    taus = {}
    with torch.no_grad():
        for k in (1, 2, target.info.vocab_size):
            d.config.top_k = k
            r = drafter_losses(d, feats, batch)
            taus[k] = (r["tau_sim"], r["tau_sim_full_vocab"], r["tau_sim_unconditioned"])
    V = target.info.vocab_size
    assert taus[V][0] == taus[V][1]  # every token a candidate: the same pick
    assert taus[1][0] == taus[1][2]  # one candidate per slot: each slot's own argmax, the walk cannot follow
    assert taus[1][0] < taus[1][1]  # ... the redone write, which the full-vocabulary pick does
    assert all(1.0 <= t[0] <= d.config.block_size for t in taus.values())


def test_result_json_keeps_number_lists_on_one_line():
    from dspine.io import json_text

    doc = {"ids": [[1, 2, 3], [4]], "hist": [0, -1, 2.5e-07], "names": ["a", "b"], "nested": {"x": [7]}}
    text = json_text(doc)
    assert json.loads(text) == doc
    assert "[1, 2, 3]" in text and "[0, -1, 2.5e-07]" in text and '"a",' in text  # strings stay one per line


def test_draft_tree_prune_keeps_parents_and_better_siblings():
    """DraftTree.prune: best rate first among nodes whose parent and next-better sibling are kept; never a node
    without acceptances; rates must match the nodes."""
    tree = DraftTree.parse("000.01.1.2")  # (0) (1) (2) (00) (01) (000)
    rates = dict(zip(["0", "1", "2", "00", "01", "000"], [0.5, 0.1, 0.2, 0.3, 0.0, 0.15]))
    r = [rates["".join(map(str, p))] for p in tree.paths]
    assert str(tree.prune(r, 1)) == "0" and str(tree.prune(r, 3)) == "000"
    assert str(tree.prune(r, 4)) == "000.1"  # rank 2 (0.2) waits for rank 1 (0.1), then comes next
    assert str(tree.prune(r, 5)) == "000.1.2"
    assert tree.prune(r, 99).paths == tuple(p for p in tree.paths if p != (0, 1))  # 01 was never accepted
    with pytest.raises(ValueError, match="one rate per node"):
        tree.prune(r[:-1], 3)
