"""The acceptance recipe: regenerate data once, train DFlash, post-backbone and DSpine drafters with identical
data, steps, layers, block size and seed, then evaluate all three and AR on the seven benchmarks.

Two stages so that each fits one GPU command: `train` (regen + the three trainings, drafters kept in a work
folder) and `eval` (the benchmark table, JSON, `bench/results/summary.json`'s acceptance section).
`RecipeConfig.cpu_tiny()` is the same recipe at CPU-test size.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from workloads import BENCHMARKS, load_prompts

from .checkpoint import load_drafter, save_drafter
from .drafter import DSpineDraftModel
from .evaluate import evaluate, write_results
from .io import atomic_write_text
from .regen import load_samples, regenerate_dataset
from .target import load_target
from .train import TrainConfig, evaluate_tau_sim, train_drafter

METHODS = ("dflash", "post_backbone", "dspine")


@dataclass
class RecipeConfig:
    target: str = "smollm2-135m-instruct"
    device: str = "cuda"
    dtype: str = "float32"
    workload: str = "sharegpt_3k"
    num_prompts: int = 3000
    max_new_tokens: int = 256
    regen_batch: int = 256
    heldout: int = 64  # regenerated samples kept out of training for simulated τ
    layers: int = 5
    block_size: int = 16
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=600, batch_size=8, anchors_per_seq=48,
                                                                   max_len=768, lr=1e-3, warmup_steps=40,
                                                                   eval_every=200))
    eval_benchmarks: list[str] = field(default_factory=lambda: list(BENCHMARKS))
    eval_limit: int = 3
    eval_max_new_tokens: int = 96
    eval_temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])

    @classmethod
    def cpu_tiny(cls) -> "RecipeConfig":
        return cls(device="cpu", workload="sharegpt", num_prompts=40, max_new_tokens=32, regen_batch=20, heldout=8,
                   layers=1, block_size=8,
                   train=TrainConfig(steps=40, batch_size=4, anchors_per_seq=8, max_len=256, lr=3e-3, warmup_steps=5,
                                     gamma=3.5, eval_every=20),
                   eval_benchmarks=["gsm8k", "mt_bench"], eval_limit=1, eval_max_new_tokens=16,
                   eval_temperatures=[0.0])


def run_train_stage(cfg: RecipeConfig, work: str | Path, progress: bool = True) -> dict:
    work = Path(work)
    dtype = getattr(torch, cfg.dtype)
    t0 = time.time()
    target = load_target(cfg.target, dtype=dtype, device=cfg.device)
    timings = {"load_s": time.time() - t0}
    prompts = load_prompts(cfg.workload, limit=cfg.num_prompts, max_chars=2000)
    t0 = time.time()
    rep = regenerate_dataset(target, [(f"{cfg.workload}/{i}", p) for i, p in enumerate(prompts)], work / "data",
                             max_new_tokens=cfg.max_new_tokens, batch_size=cfg.regen_batch, progress=progress)
    timings["regen_s"] = time.time() - t0
    pairs = [p for p in load_samples(work / "data") if p[1] < cfg.train.max_len - 16]
    eval_pairs, train_pairs = pairs[: cfg.heldout], pairs[cfg.heldout:]
    out = {"regen": asdict(rep), "samples": len(train_pairs), "heldout": len(eval_pairs), "methods": {}}
    for m in cfg.methods:
        d = DSpineDraftModel.for_target(target, method=m, num_hidden_layers=cfg.layers, block_size=cfg.block_size,
                                        seed=cfg.train.seed).to(device=cfg.device, dtype=dtype).bind(target)
        before = evaluate_tau_sim(d, target, eval_pairs, cfg.train)
        t0 = time.time()
        hist = train_drafter(d, target, train_pairs, cfg.train, eval_samples=eval_pairs, progress=progress,
                             out=work / m, extra={"recipe": True})
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        secs = time.time() - t0
        out["methods"][m] = {"tau_sim_before": before, "tau_sim_after": hist[-1].get("eval_tau_sim"),
                             "best_tau_sim": max(h.get("eval_tau_sim", 0) for h in hist), "train_s": secs,
                             "s_per_step": secs / len(hist), "loss_first": hist[0]["loss"],
                             "loss_last": hist[-1]["loss"]}
    out["timings"] = timings
    atomic_write_text(work / "train_report.json", json.dumps(out, indent=1))
    return out


def run_eval_stage(cfg: RecipeConfig, work: str | Path, out_json: str | Path, progress: bool = True) -> dict:
    work = Path(work)
    dtype = getattr(torch, cfg.dtype)
    target = load_target(cfg.target, dtype=dtype, device=cfg.device)
    drafters = {m: load_drafter(work / m / "best", target, dtype=dtype, device=cfg.device) for m in cfg.methods}
    doc = evaluate(target, drafters, cfg.eval_benchmarks, cfg.eval_limit, cfg.eval_temperatures,
                   cfg.eval_max_new_tokens, progress=progress)
    doc["recipe"] = asdict(cfg)
    rep = work / "train_report.json"
    if rep.is_file():
        doc["train_report"] = json.loads(rep.read_text())
    write_results(doc, out_json)
    return doc


def acceptance_summary(doc: dict) -> dict:
    """The `acceptance` section of bench/results/summary.json."""
    return {**{k: dict(v) for k, v in doc["means"].items()}, "per_benchmark": {b: {k: {m: r["tau_mean"] for m, r in c.items()} for k, c in by_t.items()}
                                     for b, by_t in doc["results"].items()},
            "git_sha": doc["git_sha"], "command": doc["command"], "hardware": doc["hardware"]}


def update_summary(path: str | Path, section: str, value: dict) -> None:
    """Replace one section of summary.json, keeping the others (temp file, then rename)."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[section] = value
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")
