"""Training step time by batch size: the base recipe's lockstep drafters (DSpine and DFlash) on the real target
and a recipe's regenerated data, the same step the recipe runs (one target forward, each drafter's losses,
backward, AdamW), timed after warm-up.

A step that costs nearly the same at twice the sequences is bound by launches and host work, not by the GPU:
then a larger train.batch_size sees more data in the same time. Prints a table; writes JSON with the git sha,
command and hardware; `--pick` prints only the chosen batch size (the largest whose sequences/s beat the next
smaller one's by --gain) for a job script to use.
    python bench/train_step.py --work /tmp/base target=/tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf --out step.json
Overrides: dotted keys of dspine.train.recipe.RecipeConfig (the --base preset).
"""

import argparse
import json
import sys
import time
from dataclasses import asdict, replace

import torch

from dspine.config import apply_overrides, from_dict
from dspine.io import atomic_write_text, md_table, provenance
from dspine.target import load_target
from dspine.train.loop import Trainer
from dspine.train.recipe import RecipeConfig, training_samples
from dspine.train.run import build_drafters, split_heldout


def trainer_for(target, samples, cfg: RecipeConfig, batch_size: int) -> Trainer:
    """The recipe's lockstep trainer (fresh drafters) at this batch size."""
    tc = replace(cfg.train, batch_size=batch_size)
    variants = cfg.variants()
    drafters = build_drafters(target, variants, cfg.layers, cfg.block_size, tc.seed, target.dtype, str(target.device))
    return Trainer(drafters, target, samples, tc, None, None, None, {n: s.loss for n, s in variants.items()})


def time_batch(target, samples, cfg: RecipeConfig, batch_size: int, steps: int, warmup: int) -> dict:
    trainer = trainer_for(target, samples, cfg, batch_size)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    if target.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
        batch = trainer.next_batch()
        trainer.step(i, batch, trainer.src(batch.ids), trainer.clock(i, 0.0))
    sync()
    s = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if target.device.type == "cuda" else 0.0
    del trainer
    return {
        "batch_size": batch_size,
        "s_per_step": s,
        "seqs_per_s": batch_size / s,
        "blocks_per_s": batch_size * cfg.train.anchors_per_seq / s,
        "peak_gib": peak,
    }


# --compare: the step's variants side by side — TrainConfig switches, and the target's attention implementation
VARIANTS = {
    "reference": ({"chunked_head_ce": False}, "sdpa"),
    "chunked head CE": ({"chunked_head_ce": True}, "sdpa"),
    "grouped-KV SDPA": ({"chunked_head_ce": False}, "dspine_sdpa_gqa"),
    "chunked head CE + grouped-KV SDPA": ({"chunked_head_ce": True}, "dspine_sdpa_gqa"),
}


def compare(target, samples, cfg: RecipeConfig, batch_size: int, steps: int, warmup: int) -> list[dict]:
    """One batch size through each of VARIANTS, in one process (one target load)."""
    own = target.model.config._attn_implementation
    rows = []
    try:
        for name, (train, attn) in VARIANTS.items():
            if attn == "dspine_sdpa_gqa" and own != attn:
                continue  # this target does not attend through dspine's SDPA (e.g. bf16 on CUDA, equal heads)
            target.model.set_attn_implementation(attn)
            c = replace(cfg, train=replace(cfg.train, **train))
            rows.append({"variant": name, **time_batch(target, samples, c, batch_size, steps, warmup)})
            if target.device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        target.model.set_attn_implementation(own)
    for r in rows:
        r["vs_reference"] = rows[0]["s_per_step"] / r["s_per_step"]
    return rows


def profile(target, samples, cfg: RecipeConfig, batch_size: int, steps: int = 3) -> str:
    """torch.profiler over `steps` steps after warm-up -> the ops by total device time, and the wall time
    beside the device's busy time (a step whose device time is far below its wall time waits on the host)."""
    from torch.profiler import ProfilerActivity, profile

    trainer = trainer_for(target, samples, cfg, batch_size)
    cuda = target.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for i in range(2):
        batch = trainer.next_batch()
        trainer.step(i, batch, trainer.src(batch.ids), trainer.clock(i, 0.0))
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for i in range(steps):
            batch = trainer.next_batch()
            trainer.step(i, batch, trainer.src(batch.ids), trainer.clock(i, 0.0))
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    ev = prof.key_averages()
    busy = sum(getattr(e, key) for e in ev) / steps / 1e3
    head = f"batch {batch_size}: {wall:.1f} ms wall per step (profiled), device busy {busy:.1f} ms per step\n"
    return head + ev.table(sort_by=key, row_limit=25)


def pick(rows: list[dict], gain: float) -> int:
    """The largest batch size reached by steps that each raise sequences/s by at least `gain`×."""
    best = rows[0]
    for r in rows[1:]:
        if r["seqs_per_s"] < gain * best["seqs_per_s"]:
            break
        best = r
    return best["batch_size"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="a recipe's folder holding its regenerated data")
    ap.add_argument("--batches", default="16,32,64", help="batch sizes (sequences per step), ascending")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per batch size")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gain", type=float, default=1.25, help="--pick: least sequences/s gain per larger batch")
    ap.add_argument("--pick", action="store_true", help="print only the chosen batch size (stdout's last line)")
    ap.add_argument("--out", help="JSON of the rows")
    ap.add_argument("--profile", action="store_true", help="also profile the first batch size (stderr)")
    ap.add_argument("--compare", action="store_true", help="time the step's variants at the first batch size instead")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = from_dict(RecipeConfig, apply_overrides(asdict(RecipeConfig.base_drafter()), a.overrides), "recipe")
    batches = sorted(int(b) for b in a.batches.split(","))
    target = load_target(cfg.target, dtype=getattr(torch, cfg.dtype), device=cfg.device)
    samples, added = training_samples(cfg, a.work)
    samples, _ = split_heldout(samples, cfg.heldout, cfg.train.seed, cfg.train.max_len, added)
    if a.compare:
        rows = compare(target, samples, cfg, batches[0], a.steps, a.warmup)
        table = [
            [
                r["variant"],
                f"{r['s_per_step']:.3f}",
                f"{r['seqs_per_s']:.1f}",
                f"{r['vs_reference']:.2f}",
                f"{r['peak_gib']:.1f}",
            ]
            for r in rows
        ]
        print(md_table(["variant", "s/step", "sequences/s", "× reference speed", "peak GiB"], table))
        if a.out:
            doc = {"rows": rows, "batch_size": batches[0], "drafters": list(cfg.variants()), **provenance()}
            atomic_write_text(a.out, json.dumps(doc, indent=1))
        return 0
    rows = []
    for b in batches:
        try:
            rows.append(time_batch(target, samples, cfg, b, a.steps, a.warmup))
        except torch.OutOfMemoryError:
            print(f"batch {b}: out of memory", file=sys.stderr)
            break
        if target.device.type == "cuda":
            torch.cuda.empty_cache()
    base = rows[0]["seqs_per_s"]
    table = [
        [
            r["batch_size"],
            f"{r['s_per_step']:.3f}",
            f"{r['seqs_per_s']:.1f}",
            f"{r['seqs_per_s'] / base:.2f}",
            f"{r['peak_gib']:.1f}",
        ]
        for r in rows
    ]
    print(md_table(["batch", "s/step", "sequences/s", "vs first", "peak GiB"], table), file=sys.stderr)
    if a.profile:
        print(profile(target, samples, cfg, batches[0]), file=sys.stderr)
    chosen = pick(rows, a.gain)
    if a.out:
        doc = {"rows": rows, "picked": chosen, "gain": a.gain, "drafters": list(cfg.variants()), **provenance()}
        atomic_write_text(a.out, json.dumps(doc, indent=1))
    print(chosen if a.pick else json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
