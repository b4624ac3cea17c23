"""Drafter training losses (DESIGN.md §1) and held-out simulated τ.

Losses (each variant switches off what it lacks):
- CE on slots 1..B-1 weighted w_k = exp(-(k-1)/γ); with `soft_labels` = a > 0 its target is (1 - a)·onehot(y) +
  a·p_target, the target's own distribution at that position (SpecForge's soft labels: under sampling a draft is
  accepted with Σ min(p, q), which hard labels — greedy answers most of all — teach only through the argmax);
- layer-wise cosine between each readout f_t^l and the code T[y_t] (weights w_t), averaged over layers; with
  `scale_weight` also the squared log ratio of their norms (the transition cache feeds codes where training fed
  readouts: the cosine alone leaves the readouts' scale free);
- CE of the redone last write with the true predecessor's code (slots >= 2), so training sees what the
  transition cache computes at decode time (soft labels alike): added on top at `redo_weight` (its own
  normalisation, so slot 1 holds a smaller share of the whole CE than in DFlash), or with `redo_split` = ρ > 0 in
  place of part of the plain CE — slots 2.. put 1 − ρ of their weight on the plain CE and ρ on the redone one,
  every slot's share equal to DFlash's.
Random anchors inside the response; every block of every sequence in one drafter forward under a block mask;
the frozen target's teacher-forced features come from one `FeatureSource` forward per batch for all drafters.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dspine.config import ConfigError
from dspine.drafter import DSpineDraftModel, block_attention_mask
from dspine.stats import simulated_tau

if TYPE_CHECKING:
    from dspine.train.loop import TrainConfig


@dataclass
class Batch:
    ids: torch.Tensor  # (Bs, S) token ids, right-padded
    label_mask: torch.Tensor  # (Bs, S) bool: positions that are response tokens
    anchors: torch.Tensor  # (Bs, nb) anchor positions


def make_batch(
    samples: list[tuple[list[int], int]],
    anchors_per_seq: int,
    block_size: int,
    max_len: int,
    rng: random.Random,
    device="cpu",
) -> Batch:
    """samples: (token ids, index of the first response token). Anchors are drawn from positions whose
    next token is a response token (the last prompt token included)."""
    seqs = [(ids[:max_len], start) for ids, start in samples]
    S = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    lab = torch.zeros(len(seqs), S, dtype=torch.bool)
    anchors = torch.zeros(len(seqs), anchors_per_seq, dtype=torch.long)
    for i, (s, start) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, start : len(s)] = True
        lo, hi = max(0, start - 1), len(s) - 2
        if hi < lo:
            raise ValueError(f"sample {i} has no response tokens to train on")
        choices = list(range(lo, hi + 1))
        pick = (
            rng.sample(choices, anchors_per_seq)
            if len(choices) >= anchors_per_seq
            else [rng.choice(choices) for _ in range(anchors_per_seq)]
        )
        anchors[i] = torch.tensor(sorted(pick))
    return Batch(ids.to(device), lab.to(device), anchors.to(device))


@dataclass
class HeadCE:
    loss: torch.Tensor  # () Σ_r w_r · CE_r, differentiable in x
    argmax: torch.Tensor  # (R,) each row's full-vocabulary pick
    topk: torch.Tensor | None  # (R, K) each row's top-K token ids, when asked
    walk: torch.Tensor | None  # (R,) the best-scoring of each row's given candidates, when given


class _HeadCE(torch.autograd.Function):
    """Chunks of rows: logits, log-sum-exp, the weighted CE, the picks and — when x needs one — the gradient
    d loss / d x, computed at once, so that no (R, V) logits (nor their fp32 copies, softmax and gradient) ever
    exist whole; backward only scales the stored gradient."""

    @staticmethod
    def forward(ctx, x, W, y, w, topk: int, cand, chunk: int, need_grad: bool, soft, alpha: float):
        R = x.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        am = torch.empty(R, dtype=torch.long, device=x.device)
        ti = torch.empty(R, topk, dtype=torch.long, device=x.device)
        wk = torch.empty(R if cand.numel() else 0, dtype=torch.long, device=x.device)
        grad = torch.empty_like(x) if need_grad else x.new_empty(0)
        for s in range(0, R, chunk):
            e = min(R, s + chunk)
            logits = (x[s:e] @ W.t()).float()  # (c, V); under autocast the matmul runs in its dtype
            lse = torch.logsumexp(logits, -1)
            hit = logits.gather(1, y[s:e, None])[:, 0]
            pt = (soft[s:e] @ W.t()).float().softmax(-1) if alpha else None  # (c, V) the target's distribution
            if pt is not None:
                hit = (1 - alpha) * hit + alpha * (pt * logits).sum(-1)
            loss += (w[s:e] * (lse - hit)).sum()
            am[s:e] = logits.argmax(-1)
            if topk:
                ti[s:e] = logits.topk(topk, dim=-1).indices
            if cand.numel():
                c = cand[s:e]
                wk[s:e] = c.gather(1, logits.gather(1, c).argmax(-1, keepdim=True))[:, 0]
            if need_grad:  # softmax - label, weighted: the gradient of the weighted CE in the logits
                p = logits.sub_(lse[:, None]).exp_()
                if pt is not None:
                    p.sub_(pt, alpha=alpha)
                p[torch.arange(e - s, device=x.device), y[s:e]] -= 1 - alpha
                grad[s:e] = (p.mul_(w[s:e, None]).to(W.dtype) @ W).to(x.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(am, ti, wk)
        return loss, am, ti, wk

    @staticmethod
    def backward(ctx, g, *_):
        (grad,) = ctx.saved_tensors
        return grad * g.to(grad.dtype), None, None, None, None, None, None, None, None, None


def head_ce(
    x: torch.Tensor,
    W: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    topk: int = 0,
    cand: torch.Tensor | None = None,
    chunk_elems: int = 1 << 28,
    soft: torch.Tensor | None = None,
    alpha: float = 0.0,
) -> HeadCE:
    """The weighted cross-entropy of a frozen head, chunked: x (R, d) normed hidden rows, W (V, d) the head,
    y (R,) labels, w (R,) row weights -> Σ_r w_r · CE(x_r W^T, y_r), each row's argmax, its top-`topk` ids, and
    for `cand` (R, K) the candidate of highest logit. With `soft` (R, d), the target's final hidden rows, and
    `alpha` > 0 each row's label is (1 - alpha)·onehot(y) + alpha·softmax(soft_r W^T). Chunks of about
    `chunk_elems` logits. Reference: `head_ce_reference` (the whole logits at once, as F.cross_entropy does it)."""
    rows = max(1, chunk_elems // W.shape[0])
    need = torch.is_grad_enabled() and x.requires_grad
    c = cand if cand is not None else y.new_empty(0, 1)
    soft = soft.to(W.dtype) if alpha else x.new_empty(0, x.shape[1])
    loss, am, ti, wk = _HeadCE.apply(x, W, y, w, topk, c, rows, need, soft, float(alpha))
    return HeadCE(loss, am, ti if topk else None, wk if cand is not None else None)


def head_ce_reference(x, W, y, w, topk: int = 0, cand=None, soft=None, alpha: float = 0.0) -> HeadCE:
    """`head_ce` through materialized logits and F.cross_entropy (what training did before; the parity tests'
    reference)."""
    logits = F.linear(x, W).float()
    label = F.one_hot(y, W.shape[0]).float()
    if alpha:
        label = (1 - alpha) * label + alpha * F.linear(soft.to(W.dtype), W).float().softmax(-1)
    loss = (F.cross_entropy(logits, label, reduction="none") * w).sum()
    ti = logits.topk(topk, dim=-1).indices if topk else None
    wk = cand.gather(1, logits.gather(1, cand).argmax(-1, keepdim=True))[:, 0] if cand is not None else None
    return HeadCE(loss, logits.argmax(-1), ti, wk)


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)  # (B-1,)


def drafter_losses(
    drafter: DSpineDraftModel,
    feats: torch.Tensor,
    batch: Batch,
    gamma: float = 7.0,
    cos_weight: float = 0.5,
    redo_weight: float = 1.0,
    soft_labels: float = 0.0,
    redo_split: float = 0.0,
    scale_weight: float = 0.0,
    host: bool = True,
    chunked_head: bool = False,
    target_final: torch.Tensor | None = None,
) -> dict:
    """feats (Bs, S, m*d) target features of batch.ids -> {"loss", "ce", "cos", "redo", "tau_sim", ...}.
    `soft_labels` > 0 needs target_final (Bs, S, d): the target's final normed hidden states (FeatureSource.final).

    `host=False`: {"loss", "stats"} with the statistics left on the device (`read_stats` reads them, several
    drafters' at once: one device-to-host copy per training step instead of one per number). `chunked_head`: the
    head's cross-entropy through `head_ce` (row chunks, no whole logits) instead of `head_ce_reference`."""
    cfg = drafter.config
    B = cfg.block_size
    ids, anchors = batch.ids, batch.anchors
    Bs, S = ids.shape
    nb = anchors.shape[1]
    dev = ids.device
    pos = anchors[..., None] + torch.arange(B, device=dev)  # (Bs, nb, B)
    lab_pos = pos[..., 1:].clamp(max=S - 1)
    y = ids.gather(1, lab_pos.reshape(Bs, -1)).reshape(Bs, nb, B - 1)
    valid = batch.label_mask.gather(1, lab_pos.reshape(Bs, -1)).reshape(Bs, nb, B - 1) & (pos[..., 1:] < S)
    w = slot_weights(B, gamma, dev) * valid  # (Bs, nb, B-1)
    wsum = w.sum().clamp_min(1e-6)

    ctx_kv = drafter.context_kv(feats, torch.arange(S, device=dev).expand(Bs, -1))
    ctx_visible = torch.arange(S, device=dev)[None, None, :] < anchors[..., None]  # (Bs, nb, S)
    mask = block_attention_mask(ctx_visible, B, cfg.is_causal)
    out = drafter(drafter.block_inputs(ids.gather(1, anchors), B), pos, ctx_kv, mask)
    ce_fn = head_ce if chunked_head else head_ce_reference
    h = out.hidden[:, :, 1:]  # (Bs, nb, B-1, d)
    W = drafter.head.to(h.dtype)
    walks = cfg.uses_injection and B > 2
    K = min(cfg.top_k, W.shape[0]) if walks else 0
    teacher = None
    if soft_labels:
        if target_final is None:
            raise ValueError("soft_labels needs the target's final hidden states (target_final)")
        teacher = teacher_states(target_final, pos)

    def soft(slots: slice) -> dict:  # head_ce's soft-label arguments for those slots' rows
        return {} if teacher is None else {"soft": teacher[:, :, slots].flatten(0, 2), "alpha": soft_labels}

    wn = w / wsum
    if walks and redo_split:  # slots 2.. whose predecessor is a label keep 1 - redo_split here, the rest in the redo
        keep = 1 - redo_split * valid[:, :, :-1].to(wn.dtype)
        wn = torch.cat([wn[:, :, :1], wn[:, :, 1:] * keep], dim=2)
    main = ce_fn(drafter.norm(h).flatten(0, 2), W, y.flatten(), wn.flatten(), topk=K, **soft(slice(None)))
    ce = main.loss
    total = ce
    stats = {"ce": ce.detach()}
    pred = main.argmax.view_as(y)

    if cfg.uses_injection:
        codes = drafter.transfer_codes
        tgt_code = codes[y]  # (Bs, nb, B-1, r)
        cos_terms = [
            ((1 - F.cosine_similarity(f[:, :, 1:].float(), tgt_code.float(), dim=-1)) * w).sum() / wsum
            for f in out.feats.values()
        ]
        cos = torch.stack(cos_terms).mean()
        stats["cos"] = cos.detach()
        if cos_weight:
            total = total + cos_weight * cos
        if scale_weight:  # the readouts' norm matched to the codes' (the cosine only matches their direction)
            code_norm = tgt_code.float().norm(dim=-1).clamp_min(1e-6)
            scale_terms = [
                ((f[:, :, 1:].float().norm(dim=-1).clamp_min(1e-6) / code_norm).log().square() * w).sum() / wsum
                for f in out.feats.values()
            ]
            scale = torch.stack(scale_terms).mean()
            stats["scale"] = scale.detach()
            total = total + scale_weight * scale
        if walks:  # redone last write with the true predecessor's code, slots 2..B-1
            last = cfg.num_hidden_layers - 1
            inj = drafter.injections[str(last)]
            f_last = out.feats[last]
            h_redo = out.h_pre[:, :, 2:] + inj.delta(f_last[:, :, 2:], tgt_code[:, :, :-1].to(f_last.dtype))
            wr = w[:, :, 1:] * valid[:, :, :-1]
            wr = wr * (redo_split / wsum) if redo_split else wr / wr.sum().clamp_min(1e-6)
            # what the walk picks: the best redone score among the slot's top-K unconditioned candidates C_t
            # (a full-vocabulary argmax would credit tokens the walk can never reach)
            cand = main.topk.view(*y.shape, K)[:, :, 1:]  # (Bs, nb, B-2, K)
            r = ce_fn(
                drafter.norm(h_redo).flatten(0, 2),
                W,
                y[:, :, 1:].flatten(),
                wr.flatten(),
                cand=cand.flatten(0, 2),
                **soft(slice(1, None)),
            )
            redo = r.loss
            stats["redo"] = redo.detach()
            if redo_split:  # already weighted: its slots' share of the one CE
                total = total + redo
            elif redo_weight:
                total = total + redo_weight * redo
            walk = r.walk.view(*y.shape[:2], B - 2)
            stats["slot_acc_full_vocab"] = _slot_acc(torch.cat([pred[:, :, :1], r.argmax.view_as(walk)], 2), y, valid)
            stats["slot_acc_unconditioned"] = _slot_acc(pred, y, valid)  # each slot's own argmax, no walk
            pred = torch.cat([pred[:, :, :1], walk], dim=2)
    stats["slot_acc"] = _slot_acc(pred, y, valid)
    return {"loss": total, **read_stats({"": stats})[""]} if host else {"loss": total, "stats": stats}


def teacher_states(target_final: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """target_final (Bs, S, d), block positions pos (Bs, nb, B) -> (Bs, nb, B-1, d): for each label (slots 1..B-1)
    the target's final state at the position before it, where the target predicted it."""
    Bs, nb, B = pos.shape
    rows = pos[..., :-1].clamp(max=target_final.shape[1] - 1).reshape(Bs, -1)
    out = target_final.gather(1, rows[..., None].expand(-1, -1, target_final.shape[-1]))
    return out.view(Bs, nb, B - 1, -1)


def _slot_acc(pred: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Conditional per-slot accuracy along the label chain, (B-1,) on the device. pred, y, valid (Bs, nb, B-1)."""
    chain = ((pred == y) & valid).long().cumprod(-1).bool()
    reach = torch.cat([torch.ones_like(chain[..., :1]), chain[..., :-1]], dim=-1) & valid
    return chain.flatten(0, -2).sum(0) / reach.flatten(0, -2).sum(0).clamp_min(1)


def read_stats(stats: dict[str, dict]) -> dict[str, dict]:
    """{drafter: device statistics of `drafter_losses(host=False)`} -> the same as numbers, all drafters in one
    device-to-host copy: 0-d tensors as floats, slot_acc* as lists, and the simulated τ of each slot_acc*
    (SpecForge's 1 + Σ_k Π_{i<=k} acc_i: tau_sim, tau_sim_full_vocab, tau_sim_unconditioned)."""
    flat = [(n, k, v) for n, st in stats.items() for k, v in st.items()]
    values = torch.cat([v.detach().float().reshape(-1) for _, _, v in flat]).tolist()
    out: dict[str, dict] = {n: {} for n in stats}
    i = 0
    for n, k, v in flat:
        out[n][k] = values[i] if v.dim() == 0 else values[i : i + v.numel()]
        i += v.numel()
    for st in out.values():
        for k in [k for k in st if k.startswith("slot_acc")]:
            st[k.replace("slot_acc", "tau_sim")] = simulated_tau(st[k])
    return out


class FeatureSource:
    """One teacher-forced target forward per batch serves drafters that read different target layers."""

    def __init__(self, target, drafters, final: bool = False):
        """`final`: the target's final normed hidden states come along as the last d columns (soft labels)."""
        self.target, self.final_too = target, final
        self.layers = sorted({i for d in drafters for i in d.config.target_layer_ids})
        d = target.info.hidden_size
        self._cols = {}
        for dr in drafters:
            idx = [self.layers.index(i) for i in dr.config.target_layer_ids]
            self._cols[id(dr)] = (
                None
                if idx == list(range(len(self.layers))) and not final
                else torch.cat([torch.arange(j * d, (j + 1) * d) for j in idx]).to(target.device)
            )

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (N, S) -> (N, S, len(union) * d), + d with `final`. TF32 matmuls on CUDA (soft labels' target
        distributions included: they are labels, not outputs)."""
        if self.target.device.type != "cuda":
            return self.target.features(ids, self.layers, self.final_too)
        prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            return self.target.features(ids, self.layers, self.final_too)
        finally:
            torch.set_float32_matmul_precision(prev)

    def select(self, feats: torch.Tensor, drafter) -> torch.Tensor:
        cols = self._cols[id(drafter)]
        return feats if cols is None else feats.index_select(-1, cols)

    def final(self, feats: torch.Tensor) -> torch.Tensor | None:
        """(N, S, d) the target's final normed hidden states, when asked for."""
        return feats[..., -self.target.info.hidden_size :] if self.final_too else None


@torch.no_grad()
def evaluate_tau_sim(drafter, target, samples, cfg: TrainConfig, seed: int = 1234) -> float:
    return evaluate_tau_sims({"d": drafter}, target, samples, cfg, seed)["d"]


@torch.no_grad()
def evaluate_tau_sims(
    drafters: dict, target, samples, cfg: TrainConfig, seed: int = 1234, losses: dict | None = None
) -> dict[str, float]:
    """Held-out simulated τ of each drafter on the same batches and anchors."""
    return {n: st["tau_sim"] for n, st in heldout_stats(drafters, target, samples, cfg, seed, losses).items()}


def heldout_stats(
    drafters: dict, target, samples, cfg: TrainConfig, seed: int = 1234, losses: dict | None = None
) -> dict[str, dict]:
    """Each drafter on the same held-out batches and anchors -> {name: {"tau_sim", "slot_acc"}}: the simulated τ
    and the conditional per-slot accuracy of its proposal (the walk for DSpine), each a mean over sequences."""
    rng = random.Random(seed)
    kws = {name: loss_kw(cfg, (losses or {}).get(name)) for name in drafters}
    src = FeatureSource(target, list(drafters.values()), final=any(kw["soft_labels"] for kw in kws.values()))
    block = {d.config.block_size for d in drafters.values()}
    if len(block) != 1:
        raise ValueError("drafters evaluated together must share a block size")
    taus = dict.fromkeys(drafters, 0.0)
    accs: dict = {}
    n = 0
    for i in range(0, len(samples), cfg.batch_size):
        batch = make_batch(
            samples[i : i + cfg.batch_size], cfg.anchors_per_seq, next(iter(block)), cfg.max_len, rng, target.device
        )
        feats = src(batch.ids)
        for name, d in drafters.items():
            kw = {**kws[name], "chunked_head": cfg.chunked_head_ce, "target_final": src.final(feats)}
            res = drafter_losses(d, src.select(feats, d), batch, **kw)
            taus[name] += res["tau_sim"] * len(batch.ids)
            acc = [a * len(batch.ids) for a in res["slot_acc"]]
            accs[name] = [a + b for a, b in zip(accs[name], acc)] if name in accs else acc
        n += len(batch.ids)
    return {k: {"tau_sim": taus[k] / max(1, n), "slot_acc": [a / max(1, n) for a in accs.get(k, [])]} for k in taus}


LOSS_KEYS = ("gamma", "cos_weight", "redo_weight", "soft_labels", "redo_split", "scale_weight")


def loss_kw(cfg: TrainConfig, override: dict | None) -> dict:
    kw = {k: getattr(cfg, k) for k in LOSS_KEYS}
    bad = set(override or {}) - set(LOSS_KEYS)
    if bad:
        raise ConfigError(f"unknown loss override(s) {sorted(bad)}; known: {list(LOSS_KEYS)}")
    kw.update(override or {})
    if not 0 <= kw["soft_labels"] <= 1:
        raise ConfigError(f"soft_labels is a weight in [0, 1] (0: hard labels only), got {kw['soft_labels']}")
    if not 0 <= kw["redo_split"] <= 1:
        raise ConfigError(f"redo_split is a share in [0, 1] (0: the redo CE added on top), got {kw['redo_split']}")
    if kw["scale_weight"] < 0:
        raise ConfigError(f"scale_weight must be >= 0, got {kw['scale_weight']}")
    return kw
