"""The lockstep training loop: several drafters on identical batches, anchors and schedule, checkpoints
(out/last with optimizer, RNG and data position for an exact resume; out/best by held-out simulated τ),
time budgets across resumes.

Data parallel under torchrun (`init_distributed`): every process draws the same global batch (same RNG,
so data order, anchors, resume and warm start are those of one process), trains on its share of the
sequences and averages gradients; rank 0 evaluates, saves and decides when time is up.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dspine.config import ConfigError
from dspine.drafter import DSpineDraftModel
from dspine.train.losses import (
    Batch,
    FeatureSource,
    drafter_losses,
    evaluate_tau_sims,
    loss_kw,
    make_batch,
    read_stats,
)


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
    # > 0: slots 2.. split their CE weight, (1 - redo_split) on the plain CE and redo_split on the redone write's, so
    # each slot's share of the CE is DFlash's (slot 1's is not halved by a redo CE added on top); redo_weight unused
    redo_split: float = 0.0
    scale_weight: float = 0.0  # > 0: the readouts' norms pulled to their codes' (squared log ratio), beside the cosine
    # > 0: the head's CE targets (1 - a)·the label + a·the target's own distribution there (losses.py); needs the
    # target's final hidden states from the teacher forward (one more (rows, d) slice, and (rows, V) per chunk)
    soft_labels: float = 0.0
    seed: int = 0
    eval_every: int = 50
    save_every: int = 0  # 0: only at the end (and at each new best)
    time_budget_s: float = 0.0  # > 0: training time in all (across resumes); the cosine follows it; 0: off
    stop_after_s: float = 0.0  # > 0: this invocation stops (saving out/last) after so long; resume continues
    # a warm start that continues an earlier run's cosine (its weights, not its optimizer): the training seconds
    # that run spent of the same time_budget_s, so the schedule picks up where it stopped (after a new warm-up)
    schedule_offset_s: float = 0.0
    # the head's cross-entropy in row chunks with its gradient at once (losses.head_ce): no whole (rows, vocab)
    # logits — a fraction of the peak memory, for large vocabularies — at a somewhat slower step (bench/results/
    # train_step_compare)
    chunked_head_ce: bool = False
    # the target's features of every training sample kept (on the target's device, by each process for the rows it
    # trains on) and reused from the second epoch on, when all of them fit in this many MiB and the run sees its
    # samples more than once — a small trace set fine-tuned for many steps pays for the target's forward once per
    # sample, not once per step; each sample's features then come from its own forward (whatever it is batched
    # with), in one process or several alike; 0: recomputed every step
    feature_cache_mb: float = 1024.0

    def validate(self) -> None:
        for k in ("steps", "batch_size", "anchors_per_seq", "max_len"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"train.{k} must be positive")
        if self.time_budget_s < 0 or self.stop_after_s < 0:
            raise ConfigError("train.time_budget_s and train.stop_after_s must be >= 0 (0 turns them off)")
        if self.feature_cache_mb < 0:
            raise ConfigError(f"train.feature_cache_mb must be >= 0 (0 turns it off), got {self.feature_cache_mb:g}")
        if self.lr <= 0 or self.gamma <= 0:
            raise ConfigError("train.lr and train.gamma must be positive")
        if not 0 <= self.soft_labels <= 1:
            raise ConfigError(f"train.soft_labels is a weight in [0, 1] (0: hard labels only), got {self.soft_labels}")
        if self.scale_weight < 0:
            raise ConfigError(f"train.scale_weight must be >= 0, got {self.scale_weight}")
        if not 0 <= self.redo_split <= 1:
            raise ConfigError(
                f"train.redo_split is a share in [0, 1] (0: the redo CE added on top), got {self.redo_split}"
            )
        if self.schedule_offset_s and not 0 < self.schedule_offset_s < self.time_budget_s:
            raise ConfigError(
                f"train.schedule_offset_s ({self.schedule_offset_s:g}) continues a time budget's cosine: it must be "
                f"> 0 and below train.time_budget_s ({self.time_budget_s:g})"
            )


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
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()


def _from_rank0(x: float, device) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.broadcast(t, 0)
    return float(t.item())


def lr_at(step: int, cfg: TrainConfig, progress: float | None = None) -> float:
    """Linear warm-up over `warmup_steps`, then cosine to `min_lr_ratio` over the run's progress (step
    fraction, or the larger of step and time fraction under a time budget)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps) if progress is None else progress
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _save_state(
    out: Path,
    drafter,
    opt,
    step: int,
    order: list[int],
    rng: random.Random,
    best: float,
    history: list[dict],
    extra: dict,
    elapsed_s: float = 0.0,
) -> None:
    """out/last: the drafter checkpoint + optimizer / RNG / data position, all safetensors + JSON."""
    from safetensors.torch import save_file

    from dspine.checkpoint import save_drafter

    tensors, meta = (
        {},
        {
            "step": step,
            "order": order,
            "best": best,
            "history": history,
            "py_rng": _jsonable(rng.getstate()),
            "param_groups": [],
            "elapsed_s": elapsed_s,
        },
    )
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

    from dspine.checkpoint import CheckpointError, read_config

    if not (ckpt / "trainer_state.json").is_file():
        raise CheckpointError(f"{ckpt}: no trainer state to resume from (trainer_state.json)")
    if read_config(ckpt) != drafter.config:
        raise CheckpointError(f"{ckpt}: the saved drafter's config differs from this run's")
    # the module's own state, whatever its names (a LoRA-injected drafter included); strict
    drafter.load_state_dict(load_file(str(ckpt / "model.safetensors")))
    meta = json.loads((ckpt / "trainer_state.json").read_text())
    tensors = load_file(str(ckpt / "trainer_state.safetensors"))
    dev = next(drafter.parameters()).device
    for gi, g in enumerate(opt.param_groups):
        g.update(meta["param_groups"][gi])
        for pi, p in enumerate(g["params"]):
            st = {k.split(".", 3)[3]: v for k, v in tensors.items() if k.startswith(f"opt.{gi}.{pi}.")}
            if st:  # a fused optimizer keeps its step counts on the device too
                steps_on_device = g.get("fused") or g.get("capturable")
                opt.state[p] = {k: (v.to(dev) if v.dim() or steps_on_device else v) for k, v in st.items()}
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    rng.setstate(_tuplify(meta["py_rng"]))
    return meta["step"], meta["order"], meta["best"], meta["history"], meta.get("elapsed_s", 0.0)


def train_drafter(
    drafter: DSpineDraftModel,
    target,
    samples: list[tuple[list[int], int]],
    cfg: TrainConfig,
    eval_samples=None,
    progress: bool = True,
    log=None,
    out: str | Path | None = None,
    resume: bool = False,
    extra: dict | None = None,
) -> list[dict]:
    """Train one drafter in place; with `out`, checkpoints go to out/last and out/best (see train_drafters)."""
    return train_drafters(
        {drafter.config.method: drafter},
        target,
        samples,
        cfg,
        eval_samples,
        progress,
        log,
        None if out is None else {drafter.config.method: out},
        resume,
        extra,
    )[drafter.config.method]


def train_drafters(
    drafters: dict[str, DSpineDraftModel],
    target,
    samples: list[tuple[list[int], int]],
    cfg: TrainConfig,
    eval_samples=None,
    progress: bool = True,
    log=None,
    outs: dict[str, str | Path] | None = None,
    resume: bool = False,
    extra: dict | None = None,
    losses: dict[str, dict] | None = None,
) -> dict[str, list[dict]]:
    """Train several drafters in lockstep on target-generated samples: identical batches, anchors and
    schedule; one target forward per batch serves them all. Returns each drafter's per-step log.

    `losses` overrides gamma / cos_weight / redo_weight per drafter (ablations). With `outs`: each drafter
    saves outs[name]/last (weights + optimizer, RNG and data position: `resume=True` continues exactly, when
    no time budget cut the run) and outs[name]/best (best held-out simulated τ so far). `cfg.time_budget_s`
    stops all drafters at the same step once the budget is spent (counted across resumes); the cosine
    schedule then follows time. `cfg.stop_after_s` pauses this invocation (saving out/last) so that a run
    longer than one command can continue with `resume=True`.
    """
    trainer = Trainer(drafters, target, samples, cfg, eval_samples, outs, extra, losses)
    if resume:
        trainer.resume()
    return trainer.run(progress, log)


@dataclass
class Clock:
    """Where one step stands in time: elapsed across invocations, schedule progress, stop or pause."""

    elapsed: float
    progress: float | None  # None: the cosine follows steps
    out_of_time: bool
    pause: bool


class Trainer:
    """The parts of a lockstep run: setup, resume, the clock, one step, evaluate-and-keep-best, save."""

    def __init__(
        self,
        drafters: dict[str, DSpineDraftModel],
        target,
        samples,
        cfg: TrainConfig,
        eval_samples=None,
        outs: dict[str, str | Path] | None = None,
        extra: dict | None = None,
        losses: dict[str, dict] | None = None,
    ):
        cfg.validate()
        self.rank, self.world = _world()
        if cfg.batch_size % self.world:
            raise ValueError(f"train.batch_size {cfg.batch_size} is not a multiple of the {self.world} processes")
        block = {d.config.block_size for d in drafters.values()}
        if len(block) != 1:
            raise ValueError("drafters trained in lockstep must share a block size")
        self.block_size = block.pop()
        self.drafters, self.target, self.samples, self.cfg = drafters, target, samples, cfg
        self.eval_samples, self.losses = eval_samples, losses
        self.names = list(drafters)
        self.kws = {n: loss_kw(cfg, (losses or {}).get(n)) for n in self.names}
        self.rng = random.Random(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.params, self.opts = {}, {}
        for n, d in drafters.items():
            d.bind(target).train()
            self.params[n] = [p for p in d.parameters() if p.requires_grad]
            if self.world > 1:  # every process starts from rank 0's weights
                import torch.distributed as dist

                for p in d.state_dict().values():
                    dist.broadcast(p, 0)
            self.opts[n] = torch.optim.AdamW(  # fused on CUDA: one launch per step, not one per tensor group
                self.params[n],
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                betas=(0.9, 0.95),
                fused=target.device.type == "cuda",
            )
        self.src = FeatureSource(target, list(drafters.values()), any(kw["soft_labels"] for kw in self.kws.values()))
        self.feature_cache = {} if self._cache_fits() else None
        self.batch_idx: list[int] = []
        self.history: dict[str, list[dict]] = {n: [] for n in self.names}
        self.best = dict.fromkeys(self.names, float("-inf"))
        self.order: list[int] = []
        # spent: training time of earlier invocations (budgets are cumulative) or of the run a warm start continues
        self.start, self.spent = 0, cfg.schedule_offset_s
        self.outs = {n: Path(o) for n, o in outs.items()} if outs else None
        self.extra = {**(extra or {}), "train": asdict(cfg)}
        self.amp = dict(device_type="cuda", dtype=torch.bfloat16, enabled=target.device.type == "cuda")

    def resume(self) -> None:
        """Continue every drafter from outs[name]/last: weights, optimizer, RNG, data position, history."""
        if self.outs is None:
            raise ValueError("resume needs an output folder")
        starts = set()
        for n in self.names:
            st, self.order, self.best[n], self.history[n], self.spent = _load_state(
                self.outs[n] / "last", self.drafters[n], self.opts[n], self.rng
            )
            starts.add(st)
        if len(starts) != 1:
            raise ValueError(f"drafters were saved at different steps {sorted(starts)}; cannot resume in lockstep")
        self.start = starts.pop()

    def next_batch(self) -> Batch:
        cfg = self.cfg
        if len(self.order) < cfg.batch_size:
            more = list(range(len(self.samples)))
            self.rng.shuffle(more)
            self.order += more
        idx, self.order = self.order[: cfg.batch_size], self.order[cfg.batch_size :]
        self.batch_idx = idx[self.rank :: self.world]  # the samples of this process's rows
        batch = make_batch(
            [self.samples[i] for i in idx],
            cfg.anchors_per_seq,
            self.block_size,
            cfg.max_len,
            self.rng,
            self.target.device,
        )
        if self.world > 1:  # this process's share of the global batch
            r, w = self.rank, self.world
            batch = Batch(batch.ids[r::w], batch.label_mask[r::w], batch.anchors[r::w])
        return batch

    def _cache_fits(self) -> bool:
        """Whether the training samples' features are kept (train.feature_cache_mb): samples seen more than once,
        and all their features within the budget (each process keeps those of the rows it trains on)."""
        cfg, tgt = self.cfg, self.target
        if not cfg.feature_cache_mb or cfg.steps * cfg.batch_size <= len(self.samples):
            return False
        width = (len(self.src.layers) + self.src.final_too) * tgt.info.hidden_size
        tokens = sum(min(len(ids), cfg.max_len) for ids, _ in self.samples)
        return tokens * width * torch.finfo(tgt.dtype).bits / 8 / 2**20 <= cfg.feature_cache_mb

    def features(self, batch: Batch) -> torch.Tensor:
        """The target's features of the batch (FeatureSource): with the feature cache, each sample's from its own
        forward, computed once and kept, padded with zeros past its length (positions no loss reads)."""
        if self.feature_cache is None:
            return self.src(batch.ids)
        feats = None
        for row, i in enumerate(self.batch_idx):
            if i not in self.feature_cache:
                ids = self.samples[i][0][: self.cfg.max_len]
                self.feature_cache[i] = self.src(torch.tensor([ids], device=self.target.device))[0]
            f = self.feature_cache[i]
            if feats is None:  # as wide as the (global) batch: a process's rows may all be shorter than its longest
                feats = f.new_zeros(len(self.batch_idx), batch.ids.shape[1], f.shape[-1])
            feats[row, : len(f)] = f
        return feats

    def clock(self, step: int, this_call: float) -> Clock:
        cfg = self.cfg
        if self.world > 1 and (cfg.time_budget_s or cfg.stop_after_s):  # one clock: all stop at the same step
            this_call = _from_rank0(this_call, self.target.device)
        elapsed = self.spent + this_call
        progress = None
        if cfg.time_budget_s:
            progress = max(
                (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), elapsed / cfg.time_budget_s
            )
        out_of_time = bool(cfg.time_budget_s) and elapsed >= cfg.time_budget_s
        pause = bool(cfg.stop_after_s) and this_call >= cfg.stop_after_s and not out_of_time
        return Clock(elapsed, progress, out_of_time, pause)

    def step(self, step: int, batch: Batch, feats: torch.Tensor, clock: Clock, log=None) -> None:
        """One optimizer step of every drafter on the same batch and target features (N, S, m*d). The step's
        numbers are read from the device once, after every drafter's work is queued."""
        lr = lr_at(step, self.cfg, clock.progress)
        stats = {}
        for n, d in self.drafters.items():
            with torch.autocast(**self.amp):
                res = drafter_losses(
                    d,
                    self.src.select(feats, d),
                    batch,
                    **self.kws[n],
                    host=False,
                    chunked_head=self.cfg.chunked_head_ce,
                    target_final=self.src.final(feats),
                )
            opt = self.opts[n]
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            res["loss"].backward()
            if self.world > 1:
                _average_grads(self.params[n], self.world)
            gnorm = torch.nn.utils.clip_grad_norm_(self.params[n], self.cfg.grad_clip)
            opt.step()
            stats[n] = {**res["stats"], "loss": res["loss"].detach(), "grad_norm": gnorm}
        for n, st in read_stats(stats).items():
            row = {
                "step": step + 1,
                "loss": st["loss"],
                "ce": st["ce"],
                "tau_sim": st["tau_sim"],
                "grad_norm": st["grad_norm"],
                "lr": lr,
                "elapsed_s": round(clock.elapsed, 3),
            }
            for k in ("cos", "redo"):
                if k in st:
                    row[k] = st[k]
            if "tau_sim_full_vocab" in st:  # the walk restricted to top-K vs an unrestricted pick: the gap
                row["tau_sim_full_vocab"] = st["tau_sim_full_vocab"]
            self.history[n].append(row)
            if log is not None:
                log({"drafter": n, **row} if len(self.names) > 1 else row)

    def evaluate(self, step: int) -> None:
        """Held-out simulated τ of every drafter (rank 0); a new best is saved to outs[name]/best."""
        from dspine.checkpoint import save_drafter

        for d in self.drafters.values():
            d.eval()
        taus = evaluate_tau_sims(self.drafters, self.target, self.eval_samples, self.cfg, losses=self.losses)
        for n, d in self.drafters.items():
            d.train()
            self.history[n][-1]["eval_tau_sim"] = taus[n]
            if self.outs is not None and taus[n] > self.best[n]:
                self.best[n] = taus[n]
                save_drafter(d, self.outs[n] / "best", extra={**self.extra, "step": step + 1, "eval_tau_sim": taus[n]})

    def save(self, step: int, elapsed: float) -> None:
        for n, d in self.drafters.items():
            _save_state(
                self.outs[n],
                d,
                self.opts[n],
                step + 1,
                self.order,
                self.rng,
                self.best[n],
                self.history[n],
                self.extra,
                elapsed,
            )

    def run(self, progress: bool = True, log=None) -> dict[str, list[dict]]:
        from tqdm.auto import tqdm

        cfg = self.cfg
        label = self.names[0] if len(self.names) == 1 else f"{len(self.names)} drafters"
        bar = tqdm(
            range(self.start, cfg.steps),
            desc=f"train {label}",
            disable=not progress or self.rank > 0,
            initial=self.start,
            total=cfg.steps,
        )
        t_start = time.perf_counter()
        first = self.names[0]
        for step in bar:
            batch = self.next_batch()
            feats = self.features(batch)
            clock = self.clock(step, time.perf_counter() - t_start)
            last = step + 1 == cfg.steps or clock.out_of_time
            self.step(step, batch, feats, clock, log)
            if self.eval_samples and self.rank == 0 and ((step + 1) % cfg.eval_every == 0 or last or clock.pause):
                self.evaluate(step)
            bar.set_postfix(
                loss=f"{self.history[first][-1]['loss']:.3f}", tau=f"{self.history[first][-1]['tau_sim']:.2f}"
            )
            save = last or clock.pause or (cfg.save_every and (step + 1) % cfg.save_every == 0)
            if self.outs is not None and self.rank == 0 and save:
                self.save(step, self.spent + time.perf_counter() - t_start)
            if clock.out_of_time or clock.pause:
                break
        for d in self.drafters.values():
            d.eval()
        return self.history
