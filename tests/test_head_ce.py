"""The chunked head cross-entropy training uses (dspine.train.losses.head_ce) against its reference (materialized
logits, F.cross_entropy): loss, gradient and picks, over dtypes, shapes, chunkings and soft-label weights; and
whole drafter losses either way, with hard and with soft labels (each label's teacher state the one the target
predicted it from)."""

import random

import pytest
import torch
from conftest import perturb_writes

from dspine.config import ConfigError
from dspine.drafter import DSpineDraftModel
from dspine.train.loop import TrainConfig
from dspine.train.losses import (
    FeatureSource,
    drafter_losses,
    head_ce,
    head_ce_reference,
    loss_kw,
    make_batch,
    slot_weights,
    teacher_states,
)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,V,chunk_elems", [(37, 101, 1 << 28), (37, 101, 505), (64, 512, 3000), (1, 50, 10)])
def test_head_ce_matches_its_reference(dtype, R, V, chunk_elems, alpha):
    g = torch.Generator().manual_seed(R * V)
    d, K = 24, 5
    x0 = torch.randn(R, d, generator=g).to(dtype)
    W = (torch.randn(V, d, generator=g) / d**0.5).to(dtype)
    y = torch.randint(0, V, (R,), generator=g)
    w = torch.rand(R, generator=g) * (torch.rand(R, generator=g) > 0.2)
    cand = torch.randint(0, V, (R, K), generator=g)
    soft = (3 * torch.randn(R, d, generator=g)).to(dtype)  # the teacher's states: peaked distributions
    res = {}
    for name, fn in (("fused", head_ce), ("ref", head_ce_reference)):
        x = x0.clone().requires_grad_(True)
        kw = {"chunk_elems": chunk_elems} if fn is head_ce else {}
        out = fn(x, W, y, w, topk=K, cand=cand, soft=soft, alpha=alpha, **kw)
        (3.0 * out.loss).backward()
        res[name] = (out, x.grad)
    (a, ga), (b, gb) = res["fused"], res["ref"]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert a.loss.dtype == torch.float32 and a.loss.item() == pytest.approx(b.loss.item(), rel=tol, abs=tol)
    assert ga.dtype == dtype and torch.allclose(ga.float(), gb.float(), rtol=tol, atol=tol)
    assert torch.equal(a.argmax, b.argmax) and torch.equal(a.walk, b.walk)
    assert torch.equal(a.topk.sort(-1).values, b.topk.sort(-1).values)


def test_head_ce_without_grad_or_extras():
    x, W = torch.randn(9, 8), torch.randn(30, 8)
    y, w = torch.randint(0, 30, (9,)), torch.ones(9)
    with torch.no_grad():
        out = head_ce(x.requires_grad_(True), W, y, w, chunk_elems=60)
    assert out.topk is None and out.walk is None and not out.loss.requires_grad
    assert out.loss.item() == pytest.approx(head_ce_reference(x, W, y, w).loss.item(), rel=1e-5)


@pytest.mark.parametrize("method,soft,split", [("dflash", 0.0, 0.0), ("dspine", 0.0, 0.0), ("dspine", 0.7, 0.5)])
def test_drafter_losses_equal_with_the_reference_head(tiny, method, soft, split):
    """The training losses, statistics and gradients are those of the materialized-logits path."""
    target, pairs = tiny
    drafter = perturb_writes(DSpineDraftModel.for_target(target, method=method, num_hidden_layers=2, block_size=8))
    batch = make_batch(pairs[:6], 5, 8, 256, random.Random(0))
    src = FeatureSource(target, [drafter], final=bool(soft))
    both = src(batch.ids)
    feats, final = src.select(both, drafter), src.final(both)
    out = {}
    for chunked in (True, False):
        drafter.zero_grad(set_to_none=True)
        res = drafter_losses(
            drafter,
            feats,
            batch,
            gamma=4.0,
            chunked_head=chunked,
            soft_labels=soft,
            target_final=final,
            redo_split=split,
        )
        res["loss"].backward()
        out[chunked] = (res, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
    (a, ga), (b, gb) = out[True], out[False]
    for k, v in b.items():
        if k != "loss":
            assert a[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert a["loss"].item() == pytest.approx(b["loss"].item(), rel=1e-5)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-4, atol=1e-6), n


def test_soft_labels_read_the_state_the_target_predicted_each_label_from(tiny):
    """The tiny pairs are the target's own greedy answers: the teacher distribution of every response label has
    that label as its argmax (one position off, almost none would). Soft labels change the loss; a weight outside
    [0, 1] or soft labels without the target's final states are refused."""
    target, pairs = tiny
    drafter = perturb_writes(DSpineDraftModel.for_target(target, num_hidden_layers=2, block_size=8))
    batch = make_batch(pairs[:6], 5, 8, 256, random.Random(1))
    src = FeatureSource(target, [drafter], final=True)
    both = src(batch.ids)
    assert torch.equal(src.select(both, drafter), FeatureSource(target, [drafter])(batch.ids))
    pos = batch.anchors[..., None] + torch.arange(8)
    lab = pos[..., 1:].clamp(max=batch.ids.shape[1] - 1)
    y = batch.ids.gather(1, lab.flatten(1)).view_as(lab)
    ok = batch.label_mask.gather(1, lab.flatten(1)).view_as(lab) & (pos[..., 1:] < batch.ids.shape[1])
    pick = (teacher_states(src.final(both), pos) @ drafter.head.t()).argmax(-1)
    assert ok.sum() > 100 and (pick == y)[ok].float().mean() > 0.99
    feats = src.select(both, drafter)
    hard = drafter_losses(drafter, feats, batch, gamma=4.0)["ce"]
    assert drafter_losses(drafter, feats, batch, gamma=4.0, soft_labels=1.0, target_final=src.final(both))["ce"] != hard
    with pytest.raises(ValueError, match="soft_labels needs the target's final hidden states"):
        drafter_losses(drafter, feats, batch, soft_labels=0.5)
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="soft_labels is a weight in \\[0, 1\\]"):
            TrainConfig(soft_labels=bad).validate()
        with pytest.raises(ConfigError, match="soft_labels is a weight in \\[0, 1\\]"):
            loss_kw(TrainConfig(), {"soft_labels": bad})


def test_redo_split_gives_every_slot_dflash_s_share_of_the_ce(tiny):
    """redo_split = ρ: slot 1 keeps its whole weight on the plain CE, slots 2.. put 1 − ρ of theirs there and ρ on
    the redone write's CE, all over one normaliser — the loss equals that sum computed by hand from the per-slot
    CEs, at ρ = 1 the plain CE covers slot 1 alone, and ρ outside [0, 1] is refused."""
    target, pairs = tiny
    drafter = perturb_writes(DSpineDraftModel.for_target(target, num_hidden_layers=2, block_size=6))
    batch = make_batch(pairs[:4], 4, 6, 256, random.Random(2))
    feats = FeatureSource(target, [drafter])(batch.ids)
    base = drafter_losses(drafter, feats, batch, gamma=3.0, cos_weight=0.0, redo_weight=0.0)
    total_ce = base["ce"]  # slots 1..5 over one normaliser
    # the redo CE alone over slots 2.., normalised by its own weights (the "added" mode's term)
    redo_own = drafter_losses(drafter, feats, batch, gamma=3.0, cos_weight=0.0, redo_weight=1.0)["redo"]
    one = drafter_losses(drafter, feats, batch, gamma=3.0, cos_weight=0.0, redo_split=1.0)
    half = drafter_losses(drafter, feats, batch, gamma=3.0, cos_weight=0.0, redo_split=0.5)
    # ρ = 1: the plain CE holds slot 1's share only; ρ = 0.5 is the midpoint of ρ = 0 and ρ = 1, term by term
    assert one["ce"] < total_ce and one["loss"].item() == pytest.approx(one["ce"] + one["redo"], rel=1e-5)
    assert half["ce"] == pytest.approx((total_ce + one["ce"]) / 2, rel=1e-5)
    assert half["redo"] == pytest.approx(one["redo"] / 2, rel=1e-5)
    # the redo term is the own-normalised redo CE scaled by its slots' weight over every slot's weight
    B, S = 6, batch.ids.shape[1]
    pos = batch.anchors[..., None] + torch.arange(B)
    lab = pos[..., 1:].clamp(max=S - 1)
    valid = batch.label_mask.gather(1, lab.flatten(1)).view_as(lab) & (pos[..., 1:] < S)
    w = slot_weights(B, 3.0) * valid
    share = ((w[:, :, 1:] * valid[:, :, :-1]).sum() / w.sum()).item()
    assert 0.3 < share < 1 and one["redo"] == pytest.approx(redo_own * share, rel=1e-5)
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="redo_split is a share in \\[0, 1\\]"):
            TrainConfig(redo_split=bad).validate()
        with pytest.raises(ConfigError, match="redo_split is a share in \\[0, 1\\]"):
            loss_kw(TrainConfig(), {"redo_split": bad})


def test_scale_weight_pulls_the_readouts_norm_to_the_codes(tiny):
    """scale_weight: the squared log ratio of each readout's norm to its label's code norm joins the loss —
    zero where every readout has its code's norm, positive otherwise, with a gradient into the readouts; a
    negative weight is refused."""
    target, pairs = tiny
    drafter = perturb_writes(DSpineDraftModel.for_target(target, num_hidden_layers=2, block_size=6))
    batch = make_batch(pairs[:4], 4, 6, 256, random.Random(3))
    feats = FeatureSource(target, [drafter])(batch.ids)
    plain = drafter_losses(drafter, feats, batch, gamma=3.0)
    res = drafter_losses(drafter, feats, batch, gamma=3.0, scale_weight=2.0)
    assert "scale" not in plain and res["scale"] > 0
    assert res["loss"].item() == pytest.approx(plain["loss"].item() + 2.0 * res["scale"], rel=1e-5)
    drafter.zero_grad(set_to_none=True)
    only = drafter_losses(drafter, feats, batch, gamma=3.0, cos_weight=0.0, redo_weight=0.0, scale_weight=1.0)
    only["loss"].backward()
    assert any(inj.readout.weight.grad.abs().sum() > 0 for inj in drafter.injections.values())
    # codes scaled to each readout's own norm: nothing left to match
    with torch.no_grad():
        drafter.transfer_codes.mul_(0.0).add_(1.0)  # every code the same vector, norm sqrt(r)
        r = drafter.transfer_codes.shape[1]
        for inj in drafter.injections.values():
            inj.readout.weight.zero_()
            inj.readout.bias.fill_(1.0)  # every readout the vector of ones too
    res = drafter_losses(drafter, feats, batch, gamma=3.0, scale_weight=1.0)
    assert res["scale"] == pytest.approx(0.0, abs=1e-9) and r > 1
    with pytest.raises(ConfigError, match="scale_weight must be >= 0"):
        TrainConfig(scale_weight=-1.0).validate()
    with pytest.raises(ConfigError, match="scale_weight must be >= 0"):
        loss_kw(TrainConfig(), {"scale_weight": -1.0})  # an ablation's override too
