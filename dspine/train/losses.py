"""Drafter training losses (DESIGN.md §1) and held-out simulated τ.

Losses (each variant switches off what it lacks):
- CE on slots 1..B-1 weighted w_k = exp(-(k-1)/γ);
- layer-wise cosine between each readout f_t^l and the code T[y_t] (weights w_t), averaged over layers;
- CE of the redone last write with the true predecessor's code (slots >= 2), so training sees what the
  transition cache computes at decode time.
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
    host: bool = True,
) -> dict:
    """feats (Bs, S, m*d) target features of batch.ids -> {"loss", "ce", "cos", "redo", "tau_sim", ...}.

    `host=False`: {"loss", "stats"} with the statistics left on the device (`read_stats` reads them, several
    drafters' at once: one device-to-host copy per training step instead of one per number)."""
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
    logits = drafter.logits(out.hidden[:, :, 1:])  # (Bs, nb, B-1, V)
    ce = (F.cross_entropy(logits.flatten(0, 2), y.flatten(), reduction="none").view_as(w) * w).sum() / wsum
    total = ce
    stats = {"ce": ce.detach()}
    pred = logits.argmax(-1)

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
        if B > 2:  # redone last write with the true predecessor's code, slots 2..B-1
            last = cfg.num_hidden_layers - 1
            inj = drafter.injections[str(last)]
            f_last = out.feats[last]
            h_redo = out.h_pre[:, :, 2:] + inj.delta(f_last[:, :, 2:], tgt_code[:, :, :-1].to(f_last.dtype))
            redo_logits = drafter.logits(h_redo)  # (Bs, nb, B-2, V)
            wr = w[:, :, 1:] * valid[:, :, :-1]
            redo = (
                F.cross_entropy(redo_logits.flatten(0, 2), y[:, :, 1:].flatten(), reduction="none").view_as(wr) * wr
            ).sum() / wr.sum().clamp_min(1e-6)
            stats["redo"] = redo.detach()
            if redo_weight:
                total = total + redo_weight * redo
            # what the walk picks: the best redone score among the slot's top-K unconditioned candidates C_t
            # (a full-vocabulary argmax would credit tokens the walk can never reach)
            cand = logits[:, :, 1:].topk(min(cfg.top_k, logits.shape[-1]), dim=-1).indices  # (Bs, nb, B-2, K)
            walk = cand.gather(-1, redo_logits.gather(-1, cand).argmax(-1, keepdim=True))[..., 0]
            stats["slot_acc_full_vocab"] = _slot_acc(torch.cat([pred[:, :, :1], redo_logits.argmax(-1)], 2), y, valid)
            stats["slot_acc_unconditioned"] = _slot_acc(pred, y, valid)  # each slot's own argmax, no walk
            pred = torch.cat([pred[:, :, :1], walk], dim=2)
    stats["slot_acc"] = _slot_acc(pred, y, valid)
    return {"loss": total, **read_stats({"": stats})[""]} if host else {"loss": total, "stats": stats}


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

    def __init__(self, target, drafters):
        self.target = target
        self.layers = sorted({i for d in drafters for i in d.config.target_layer_ids})
        d = target.info.hidden_size
        self._cols = {}
        for dr in drafters:
            idx = [self.layers.index(i) for i in dr.config.target_layer_ids]
            self._cols[id(dr)] = (
                None
                if idx == list(range(len(self.layers)))
                else torch.cat([torch.arange(j * d, (j + 1) * d) for j in idx]).to(target.device)
            )

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (N, S) -> (N, S, len(union) * d). TF32 matmuls on CUDA: features, not outputs, are needed."""
        if self.target.device.type != "cuda":
            return self.target.features(ids, self.layers)
        prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            return self.target.features(ids, self.layers)
        finally:
            torch.set_float32_matmul_precision(prev)

    def select(self, feats: torch.Tensor, drafter) -> torch.Tensor:
        cols = self._cols[id(drafter)]
        return feats if cols is None else feats.index_select(-1, cols)


@torch.no_grad()
def evaluate_tau_sim(drafter, target, samples, cfg: TrainConfig, seed: int = 1234) -> float:
    return evaluate_tau_sims({"d": drafter}, target, samples, cfg, seed)["d"]


@torch.no_grad()
def evaluate_tau_sims(
    drafters: dict, target, samples, cfg: TrainConfig, seed: int = 1234, losses: dict | None = None
) -> dict[str, float]:
    """Held-out simulated τ of each drafter on the same batches and anchors."""
    rng = random.Random(seed)
    src = FeatureSource(target, list(drafters.values()))
    block = {d.config.block_size for d in drafters.values()}
    if len(block) != 1:
        raise ValueError("drafters evaluated together must share a block size")
    taus = dict.fromkeys(drafters, 0.0)
    n = 0
    for i in range(0, len(samples), cfg.batch_size):
        batch = make_batch(
            samples[i : i + cfg.batch_size], cfg.anchors_per_seq, next(iter(block)), cfg.max_len, rng, target.device
        )
        feats = src(batch.ids)
        for name, d in drafters.items():
            res = drafter_losses(d, src.select(feats, d), batch, **loss_kw(cfg, (losses or {}).get(name)))
            taus[name] += res["tau_sim"] * len(batch.ids)
        n += len(batch.ids)
    return {k: v / max(1, n) for k, v in taus.items()}


LOSS_KEYS = ("gamma", "cos_weight", "redo_weight")


def loss_kw(cfg: TrainConfig, override: dict | None) -> dict:
    kw = {k: getattr(cfg, k) for k in LOSS_KEYS}
    bad = set(override or {}) - set(LOSS_KEYS)
    if bad:
        raise ConfigError(f"unknown loss override(s) {sorted(bad)}; known: {list(LOSS_KEYS)}")
    return {**kw, **(override or {})}
