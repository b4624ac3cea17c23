"""Drafter training: the losses of DESIGN.md §1 and an online training loop.

Online: the frozen target runs teacher-forced on each batch to produce the context features; random
anchors inside the response; every block of every sequence in one drafter forward under a block mask.
Losses (each variant switches off what it lacks):
- CE on slots 1..B-1 weighted w_k = exp(-(k-1)/γ);
- layer-wise cosine between each readout f_t^l and the code T[y_t] (weights w_t), averaged over layers;
- CE of the redone last write with the true predecessor's code (slots >= 2), so training sees what the
  transition cache computes at decode time.
Data parallel under torchrun (`init_distributed`): every process draws the same global batch (same RNG,
so data order, anchors, resume and warm start are those of one process), trains on its share of the
sequences and averages gradients; rank 0 evaluates, saves and decides when time is up.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dspine.drafter import DSpineDraftModel, block_attention_mask
from dspine.stats import simulated_tau


@dataclass
class TrainConfig:
    steps: int = 200
    lr: float = 6e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_size: int = 4  # sequences per step
    anchors_per_seq: int = 16
    max_len: int = 512
    gamma: float = 7.0
    cos_weight: float = 0.5
    redo_weight: float = 1.0
    seed: int = 0
    eval_every: int = 50
    save_every: int = 0  # 0: only at the end (and at each new best)
    time_budget_s: float = 0.0  # > 0: training time in all (across resumes); the cosine follows it; 0: off
    stop_after_s: float = 0.0  # > 0: this invocation stops (saving out/last) after so long; resume continues

    def validate(self) -> None:
        from dspine.config import ConfigError

        for k in ("steps", "batch_size", "anchors_per_seq", "max_len"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"train.{k} must be positive")
        if self.time_budget_s < 0 or self.stop_after_s < 0:
            raise ConfigError("train.time_budget_s and train.stop_after_s must be >= 0 (0 turns them off)")
        if self.lr <= 0 or self.gamma <= 0:
            raise ConfigError("train.lr and train.gamma must be positive")


@dataclass
class Batch:
    ids: torch.Tensor  # (Bs, S) token ids, right-padded
    label_mask: torch.Tensor  # (Bs, S) bool: positions that are response tokens
    anchors: torch.Tensor  # (Bs, nb) anchor positions


def make_batch(samples: list[tuple[list[int], int]], anchors_per_seq: int, block_size: int, max_len: int,
               rng: random.Random, device="cpu") -> Batch:
    """samples: (token ids, index of the first response token). Anchors are drawn from positions whose
    next token is a response token (the last prompt token included)."""
    seqs = [(ids[:max_len], start) for ids, start in samples]
    S = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    lab = torch.zeros(len(seqs), S, dtype=torch.bool)
    anchors = torch.zeros(len(seqs), anchors_per_seq, dtype=torch.long)
    for i, (s, start) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, start: len(s)] = True
        lo, hi = max(0, start - 1), len(s) - 2
        if hi < lo:
            raise ValueError(f"sample {i} has no response tokens to train on")
        choices = list(range(lo, hi + 1))
        pick = rng.sample(choices, anchors_per_seq) if len(choices) >= anchors_per_seq else \
            [rng.choice(choices) for _ in range(anchors_per_seq)]
        anchors[i] = torch.tensor(sorted(pick))
    return Batch(ids.to(device), lab.to(device), anchors.to(device))


def init_distributed(device: str) -> tuple[int, int]:
    """Under torchrun (WORLD_SIZE > 1): join the process group — NCCL on CUDA (each process on its
    LOCAL_RANK GPU, so "cuda" means that GPU from here on), gloo on the CPU — and return (rank, world)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        cuda = str(device).startswith("cuda")
        if cuda:
            gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(gpu)
            dist.init_process_group("nccl", device_id=gpu)  # bound: NCCL need not guess rank -> GPU
        else:
            dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _average_grads(params: list[torch.Tensor], world: int) -> None:
    """One all-reduce per drafter over its flattened gradients."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for g in grads:
        g.copy_(flat[off: off + g.numel()].view_as(g))
        off += g.numel()


def _from_rank0(x: float, device) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.broadcast(t, 0)
    return float(t.item())


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)  # (B-1,)


def drafter_losses(drafter: DSpineDraftModel, feats: torch.Tensor, batch: Batch, gamma: float = 7.0,
                   cos_weight: float = 0.5, redo_weight: float = 1.0) -> dict:
    """feats (Bs, S, m*d) target features of batch.ids -> {"loss", "ce", "cos", "redo", "tau_sim", ...}."""
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
    res = {"ce": ce.detach()}
    pred = logits.argmax(-1)

    if cfg.uses_injection:
        codes = drafter.transfer_codes
        tgt_code = codes[y]  # (Bs, nb, B-1, r)
        cos_terms = [((1 - F.cosine_similarity(f[:, :, 1:].float(), tgt_code.float(), dim=-1)) * w).sum() / wsum
                     for f in out.feats.values()]
        cos = torch.stack(cos_terms).mean()
        res["cos"] = cos.detach()
        if cos_weight:
            total = total + cos_weight * cos
        if B > 2:  # redone last write with the true predecessor's code, slots 2..B-1
            last = cfg.num_hidden_layers - 1
            inj = drafter.injections[str(last)]
            f_last = out.feats[last]
            h_redo = out.h_pre[:, :, 2:] + inj.delta(f_last[:, :, 2:], tgt_code[:, :, :-1].to(f_last.dtype))
            redo_logits = drafter.logits(h_redo)  # (Bs, nb, B-2, V)
            wr = w[:, :, 1:] * valid[:, :, :-1]
            redo = (F.cross_entropy(redo_logits.flatten(0, 2), y[:, :, 1:].flatten(), reduction="none")
                    .view_as(wr) * wr).sum() / wr.sum().clamp_min(1e-6)
            res["redo"] = redo.detach()
            if redo_weight:
                total = total + redo_weight * redo
            # what the walk picks: the best redone score among the slot's top-K unconditioned candidates C_t
            # (a full-vocabulary argmax would credit tokens the walk can never reach)
            cand = logits[:, :, 1:].topk(min(cfg.top_k, logits.shape[-1]), dim=-1).indices  # (Bs, nb, B-2, K)
            walk = cand.gather(-1, redo_logits.gather(-1, cand).argmax(-1, keepdim=True))[..., 0]
            res["tau_sim_full_vocab"] = _tau_sim(torch.cat([pred[:, :, :1], redo_logits.argmax(-1)], 2), y, valid)[0]
            pred = torch.cat([pred[:, :, :1], walk], dim=2)
    tau, acc = _tau_sim(pred, y, valid)
    res.update(loss=total, tau_sim=tau, slot_acc=acc)
    return res


def _tau_sim(pred: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> tuple[float, list[float]]:
    """Simulated τ: conditional per-slot accuracy along the label chain (SpecForge's Σ_k Π_{i<=k} acc_i).
    pred, y, valid (Bs, nb, B-1)."""
    chain = ((pred == y) & valid).long().cumprod(-1).bool()
    reach = torch.cat([torch.ones_like(chain[..., :1]), chain[..., :-1]], dim=-1) & valid
    # one device-to-host read for all slots (this runs every training step, twice for transition-cache drafters)
    acc = (chain.flatten(0, -2).sum(0) / reach.flatten(0, -2).sum(0).clamp_min(1)).tolist()
    return simulated_tau(acc), acc


def lr_at(step: int, cfg: TrainConfig, progress: float | None = None) -> float:
    """Linear warm-up over `warmup_steps`, then cosine to `min_lr_ratio` over the run's progress (step
    fraction, or the larger of step and time fraction under a time budget)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps) if progress is None else progress
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


class FeatureSource:
    """One teacher-forced target forward per batch serves drafters that read different target layers."""

    def __init__(self, target, drafters):
        self.target = target
        self.layers = sorted({i for d in drafters for i in d.config.target_layer_ids})
        d = target.info.hidden_size
        self._cols = {}
        for dr in drafters:
            idx = [self.layers.index(i) for i in dr.config.target_layer_ids]
            self._cols[id(dr)] = None if idx == list(range(len(self.layers))) else \
                torch.cat([torch.arange(j * d, (j + 1) * d) for j in idx]).to(target.device)

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
def evaluate_tau_sims(drafters: dict, target, samples, cfg: TrainConfig, seed: int = 1234,
                      losses: dict | None = None) -> dict[str, float]:
    """Held-out simulated τ of each drafter on the same batches and anchors."""
    rng = random.Random(seed)
    src = FeatureSource(target, list(drafters.values()))
    block = {d.config.block_size for d in drafters.values()}
    if len(block) != 1:
        raise ValueError("drafters evaluated together must share a block size")
    taus = dict.fromkeys(drafters, 0.0)
    n = 0
    for i in range(0, len(samples), cfg.batch_size):
        batch = make_batch(samples[i: i + cfg.batch_size], cfg.anchors_per_seq, next(iter(block)), cfg.max_len,
                           rng, target.device)
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
        from dspine.config import ConfigError

        raise ConfigError(f"unknown loss override(s) {sorted(bad)}; known: {list(LOSS_KEYS)}")
    return {**kw, **(override or {})}


def _save_state(out: Path, drafter, opt, step: int, order: list[int], rng: random.Random, best: float,
                history: list[dict], extra: dict, elapsed_s: float = 0.0) -> None:
    """out/last: the drafter checkpoint + optimizer / RNG / data position, all safetensors + JSON."""
    from safetensors.torch import save_file

    from dspine.checkpoint import save_drafter

    tensors, meta = {}, {"step": step, "order": order, "best": best, "history": history,
                         "py_rng": _jsonable(rng.getstate()), "param_groups": [], "elapsed_s": elapsed_s}
    for gi, g in enumerate(opt.param_groups):
        meta["param_groups"].append({k: v for k, v in g.items() if k != "params"})
        for pi, p in enumerate(g["params"]):
            for k, v in opt.state.get(p, {}).items():
                tensors[f"opt.{gi}.{pi}.{k}"] = v.detach().cpu().contiguous() if torch.is_tensor(v) else torch.tensor(v)
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    ckpt = save_drafter(drafter, out / "last", extra=extra)
    save_file(tensors, str(ckpt / "trainer_state.safetensors"))
    (ckpt / "trainer_state.json").write_text(json.dumps(meta))


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


def _load_state(ckpt: Path, drafter, opt, rng: random.Random):
    from safetensors.torch import load_file

    from dspine.checkpoint import CheckpointError, load_drafter

    if not (ckpt / "trainer_state.json").is_file():
        raise CheckpointError(f"{ckpt}: no trainer state to resume from (trainer_state.json)")
    saved = load_drafter(ckpt)
    if saved.config != drafter.config:
        raise CheckpointError(f"{ckpt}: the saved drafter's config differs from this run's")
    drafter.load_state_dict(saved.state_dict())
    meta = json.loads((ckpt / "trainer_state.json").read_text())
    tensors = load_file(str(ckpt / "trainer_state.safetensors"))
    dev = next(drafter.parameters()).device
    for gi, g in enumerate(opt.param_groups):
        g.update(meta["param_groups"][gi])
        for pi, p in enumerate(g["params"]):
            st = {k.split(".", 3)[3]: v for k, v in tensors.items() if k.startswith(f"opt.{gi}.{pi}.")}
            if st:
                opt.state[p] = {k: (v.to(dev) if v.dim() else v) for k, v in st.items()}
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    rng.setstate(_tuplify(meta["py_rng"]))
    return meta["step"], meta["order"], meta["best"], meta["history"], meta.get("elapsed_s", 0.0)


def train_drafter(drafter: DSpineDraftModel, target, samples: list[tuple[list[int], int]], cfg: TrainConfig,
                  eval_samples=None, progress: bool = True, log=None, out: str | Path | None = None,
                  resume: bool = False, extra: dict | None = None) -> list[dict]:
    """Train one drafter in place; with `out`, checkpoints go to out/last and out/best (see train_drafters)."""
    return train_drafters({drafter.config.method: drafter}, target, samples, cfg, eval_samples, progress,
                          log, None if out is None else {drafter.config.method: out}, resume, extra)[
        drafter.config.method]


def train_drafters(drafters: dict[str, DSpineDraftModel], target, samples: list[tuple[list[int], int]],
                   cfg: TrainConfig, eval_samples=None, progress: bool = True, log=None,
                   outs: dict[str, str | Path] | None = None, resume: bool = False, extra: dict | None = None,
                   losses: dict[str, dict] | None = None) -> dict[str, list[dict]]:
    """Train several drafters in lockstep on target-generated samples: identical batches, anchors and
    schedule; one target forward per batch serves them all. Returns each drafter's per-step log.

    `losses` overrides gamma / cos_weight / redo_weight per drafter (ablations). With `outs`: each drafter
    saves outs[name]/last (weights + optimizer, RNG and data position: `resume=True` continues exactly, when
    no time budget cut the run) and outs[name]/best (best held-out simulated τ so far). `cfg.time_budget_s`
    stops all drafters at the same step once the budget is spent (counted across resumes); the cosine
    schedule then follows time. `cfg.stop_after_s` pauses this invocation (saving out/last) so that a run
    longer than one command can continue with `resume=True`.
    """
    import time

    from tqdm.auto import tqdm

    from dspine.checkpoint import save_drafter

    cfg.validate()
    rank, world = _world()
    if cfg.batch_size % world:
        raise ValueError(f"train.batch_size {cfg.batch_size} is not a multiple of the {world} processes")
    names = list(drafters)
    kws = {n: loss_kw(cfg, (losses or {}).get(n)) for n in names}
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    params, opts = {}, {}
    for n, d in drafters.items():
        d.bind(target).train()
        params[n] = [p for p in d.parameters() if p.requires_grad]
        if world > 1:  # every process starts from rank 0's weights
            import torch.distributed as dist

            for p in d.state_dict().values():
                dist.broadcast(p, 0)
        opts[n] = torch.optim.AdamW(params[n], lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    src = FeatureSource(target, list(drafters.values()))
    block = {d.config.block_size for d in drafters.values()}
    if len(block) != 1:
        raise ValueError("drafters trained in lockstep must share a block size")
    block_size = block.pop()
    history = {n: [] for n in names}
    best = dict.fromkeys(names, float("-inf"))
    order: list[int] = []
    start, spent = 0, 0.0  # spent: training time of earlier invocations (time budgets are cumulative)
    outs = {n: Path(o) for n, o in outs.items()} if outs else None
    if resume:
        if outs is None:
            raise ValueError("resume needs an output folder")
        starts = set()
        for n in names:
            st, order, best[n], history[n], spent = _load_state(outs[n] / "last", drafters[n], opts[n], rng)
            starts.add(st)
        if len(starts) != 1:
            raise ValueError(f"drafters were saved at different steps {sorted(starts)}; cannot resume in lockstep")
        start = starts.pop()
    extra = {**(extra or {}), "train": asdict(cfg)}
    label = names[0] if len(names) == 1 else f"{len(names)} drafters"
    bar = tqdm(range(start, cfg.steps), desc=f"train {label}", disable=not progress or rank > 0, initial=start,
               total=cfg.steps)
    t_start = time.perf_counter()
    amp = dict(device_type="cuda", dtype=torch.bfloat16, enabled=target.device.type == "cuda")
    for step in bar:
        if len(order) < cfg.batch_size:
            more = list(range(len(samples)))
            rng.shuffle(more)
            order += more
        idx, order = order[: cfg.batch_size], order[cfg.batch_size:]
        batch = make_batch([samples[i] for i in idx], cfg.anchors_per_seq, block_size, cfg.max_len, rng,
                           target.device)
        if world > 1:  # this process's share of the global batch
            batch = Batch(batch.ids[rank::world], batch.label_mask[rank::world], batch.anchors[rank::world])
        feats = src(batch.ids)
        this_call = time.perf_counter() - t_start
        if world > 1 and (cfg.time_budget_s or cfg.stop_after_s):  # one clock, so all stop at the same step
            this_call = _from_rank0(this_call, target.device)
        elapsed = spent + this_call
        frac = None
        if cfg.time_budget_s:
            frac = max((step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps),
                       elapsed / cfg.time_budget_s)
        out_of_time = bool(cfg.time_budget_s) and elapsed >= cfg.time_budget_s
        pause = bool(cfg.stop_after_s) and this_call >= cfg.stop_after_s and not out_of_time
        last = step + 1 == cfg.steps or out_of_time
        do_eval = eval_samples and ((step + 1) % cfg.eval_every == 0 or last or pause)
        for n, d in drafters.items():
            with torch.autocast(**amp):
                res = drafter_losses(d, src.select(feats, d), batch, **kws[n])
            for g in opts[n].param_groups:
                g["lr"] = lr_at(step, cfg, frac)
            opts[n].zero_grad(set_to_none=True)
            res["loss"].backward()
            if world > 1:
                _average_grads(params[n], world)
            gnorm = torch.nn.utils.clip_grad_norm_(params[n], cfg.grad_clip)
            opts[n].step()
            row = {"step": step + 1, "loss": res["loss"].item(), "ce": res["ce"].item(),
                   "tau_sim": res["tau_sim"], "grad_norm": float(gnorm), "lr": opts[n].param_groups[0]["lr"],
                   "elapsed_s": round(elapsed, 3)}
            for k in ("cos", "redo"):
                if k in res:
                    row[k] = res[k].item()
            if "tau_sim_full_vocab" in res:  # the walk restricted to top-K vs an unrestricted pick: the gap
                row["tau_sim_full_vocab"] = res["tau_sim_full_vocab"]
            history[n].append(row)
            if log is not None:
                log({"drafter": n, **row} if len(names) > 1 else row)
        if do_eval and rank == 0:
            for d in drafters.values():
                d.eval()
            taus = evaluate_tau_sims(drafters, target, eval_samples, cfg, losses=losses)
            for n, d in drafters.items():
                d.train()
                history[n][-1]["eval_tau_sim"] = taus[n]
                if outs is not None and taus[n] > best[n]:
                    best[n] = taus[n]
                    save_drafter(d, outs[n] / "best", extra={**extra, "step": step + 1, "eval_tau_sim": best[n]})
        bar.set_postfix(loss=f"{history[names[0]][-1]['loss']:.3f}", tau=f"{history[names[0]][-1]['tau_sim']:.2f}")
        save = last or pause or (cfg.save_every and (step + 1) % cfg.save_every == 0)
        if outs is not None and rank == 0 and save:
            for n, d in drafters.items():
                _save_state(outs[n], d, opts[n], step + 1, order, rng, best[n], history[n], extra,
                            spent + time.perf_counter() - t_start)
        if out_of_time or pause:
            break
    for d in drafters.values():
        d.eval()
    return history
