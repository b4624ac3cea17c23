"""The acceptance recipe: regenerate data once, train DFlash, post-backbone and DSpine drafters with identical
data, steps, layers, block size and seed, then evaluate all three and AR on the seven benchmarks.

All drafters (the three methods and any ablations) train in lockstep: the same batches and anchors, one
target forward per batch, the same schedule — "identical data and steps" by construction. Ablations are
named variants (method + drafter-config and loss overrides) measured by held-out simulated τ in the same
run, and through the engine with `eval_ablations`. Decode-time variants need no training: `eval_top_k`
adds rows for the dspine checkpoint decoded with other transition-cache widths, `eval_trees` rows for every
method decoded through draft trees (the same tree for each: the DSpine/DFlash comparison through trees).

Stages, each one GPU command: `regen`, `train` (regen is resumable, so it is a no-op after `regen`),
`eval` (the benchmark table, JSON, `bench/results/summary.json`'s acceptance section).
`RecipeConfig.cpu_tiny()` is the same recipe at CPU-test size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dspine.checkpoint import load_models
from dspine.decoding import DraftTree
from dspine.drafter import DSpineConfig
from dspine.eval.acceptance import evaluate, write_results
from dspine.io import atomic_write_text
from dspine.methods import VARIANTS
from dspine.plots import line_panels
from dspine.target import load_target
from dspine.train.data import RegenReport, existing_ids, load_samples, regenerate_dataset, workload_items
from dspine.train.loop import TrainConfig, init_distributed
from dspine.train.losses import loss_kw
from dspine.train.run import DrafterSpec, run
from dspine.workloads import BENCHMARKS

Ablation = DrafterSpec  # a named variant of the recipe: method + drafter-config and loss overrides


@dataclass
class RecipeConfig:
    target: str = "smollm2-135m-instruct"
    device: str = "cuda"
    dtype: str = "float32"
    workload: str = "sharegpt_3k+gsm8k_train+mbpp_train"  # chat + math + code training prompts (no eval items)
    num_prompts: int = 4000  # per pool
    max_new_tokens: int = 256
    regen_batch: int = 512
    # the target's dtype while regenerating ("": dtype): bfloat16 answers at about twice fp32's pace on a GPU, for
    # training data only (training's features and every evaluation stay in `dtype`)
    regen_dtype: str = ""
    # a second answer to these pools' prompts, sampled (more data, and the T > 0 distribution); "" = none
    sampled_workload: str = ""
    sampled_num_prompts: int = 4000  # per pool
    sampled_temperature: float = 1.0
    # pools joined after the held-out split was drawn (a continued run's new data): answered like the pools
    # above (greedy, and sampled when sampled_workload is set) into data_added*, all of it for training, so
    # the held-out set, and τ_sim across continued runs, stay what they were
    added_workload: str = ""
    warm_from: str = ""  # a folder with <drafter name>/ checkpoints: each drafter starts from its weights
    heldout: int = 64  # regenerated samples (a seeded random choice) kept out of training for simulated τ
    layers: int = 5
    block_size: int = 16
    methods: list[str] = field(default_factory=lambda: list(VARIANTS))
    ablations: dict[str, Ablation] = field(
        default_factory=lambda: {
            "dspine_r64": Ablation(drafter={"transfer_rank": 64, "message_size": 64}),
            "dspine_nocos": Ablation(loss={"cos_weight": 0.0}),
        }
    )
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            steps=100_000,
            time_budget_s=420,
            batch_size=16,
            anchors_per_seq=64,
            max_len=768,
            lr=1e-3,
            warmup_steps=100,
            eval_every=250,
        )
    )
    eval_benchmarks: list[str] = field(default_factory=lambda: list(BENCHMARKS))
    eval_limit: int = 10
    eval_max_new_tokens: int = 96
    eval_temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    eval_workers: int = 8
    eval_ablations: bool = False
    eval_top_k: list[int] = field(default_factory=list)  # extra rows: dspine decoded with these walk widths
    eval_trees: dict[str, str] = field(default_factory=dict)  # label -> draft tree: rows <method>_<label>
    # "generate": every drafter decodes every item at eval_temperatures (evaluate); "replay": T = 0 only, every
    # drafter replayed on the target's greedy answers (identical text, batched: 30+ items x 512 tokens in minutes),
    # each pair's ratio with a bootstrap interval over items, the held-out per-slot accuracy on identical anchors
    eval_mode: str = "generate"
    eval_pairs: dict[str, str] = field(default_factory=dict)  # replay: drafter -> its twin ({}: DSpine ones -> dflash)
    eval_batch: int = 32  # replay: answers and replays decoded together
    # replay: no drafter's replay starts once this many seconds have passed since the stage began (0: no limit);
    # the answers and each replayed drafter are kept in WORK/eval_cache, so the stage run again goes on from there
    eval_budget_s: float = 0.0

    def validate(self) -> None:
        from dspine.config import ConfigError

        clash = set(self.methods) & set(self.ablations)
        if clash:
            raise ConfigError(f"recipe: ablation names {sorted(clash)} clash with the methods")
        bad = [m for m in [*self.methods, *(a.method for a in self.ablations.values())] if m not in VARIANTS]
        if bad:
            raise ConfigError(f"recipe: unknown method(s) {bad}; known: {list(VARIANTS)}")
        if self.eval_top_k and ("dspine" not in self.methods or min(self.eval_top_k) < 1):
            raise ConfigError("recipe.eval_top_k: widths >= 1 for the dspine drafter (methods must include dspine)")
        for label, spec in self.eval_trees.items():
            try:
                DraftTree.parse(spec)
            except ValueError as e:
                raise ConfigError(f"recipe.eval_trees.{label}: {e}") from None
        if self.eval_budget_s < 0:
            raise ConfigError(f"recipe.eval_budget_s {self.eval_budget_s}: seconds, 0 for no limit")
        if self.eval_mode not in ("generate", "replay"):
            raise ConfigError(f"recipe.eval_mode {self.eval_mode!r}: generate or replay")
        if self.eval_mode == "replay" and (self.eval_trees or self.eval_top_k):
            raise ConfigError("recipe.eval_mode=replay replays chains: eval_trees and eval_top_k need generate")
        names = {*self.methods, *self.ablations}
        bad = {k: v for k, v in self.eval_pairs.items() if k not in names or v not in names}
        if bad:
            raise ConfigError(f"recipe.eval_pairs {bad}: both sides must be methods or ablations of the recipe")
        known = {f.name for f in dataclasses.fields(DSpineConfig)} - {"method"}
        for name, a in self.ablations.items():
            if set(a.drafter) - known:
                raise ConfigError(f"recipe.ablations.{name}.drafter: unknown key(s) {sorted(set(a.drafter) - known)}")
            loss_kw(self.train, a.loss)  # rejects unknown loss keys

    def variants(self) -> dict[str, Ablation]:
        """Every drafter the recipe trains: the methods, then the ablations."""
        return {**{m: Ablation(method=m) for m in self.methods}, **self.ablations}

    @classmethod
    def base_drafter(cls) -> RecipeConfig:
        """The shipped base drafter's recipe: every training pool (chat, math, code, tool calling) answered
        greedily, plus a sampled (T = 1) answer to up to 3000 prompts per pool; DSpine and DFlash in
        lockstep; continued across GPU runs by `warm_from` (the previous run's shipped drafters)."""
        pools = "sharegpt_3k+sharegpt+gsm8k_train+mbpp_train+bfcl"
        return cls(
            workload=pools,
            num_prompts=100_000,
            sampled_workload=pools,
            added_workload="mbpp_fn+mbpp_io+swe_issues",  # from gpu5 on: code asked as HumanEval / LCB ask, issues
            sampled_num_prompts=3000,
            regen_batch=1536,  # halved where a batch does not fit (_generate_fitting)
            heldout=128,
            methods=["dspine", "dflash"],
            ablations={},
            eval_workers=16,
        )

    @classmethod
    def levers(cls) -> RecipeConfig:
        """Issue 50's levers, each a drafter trained in lockstep beside DSpine and its DFlash twin on the same
        data and steps: slot 1's CE share restored (`redo_split` 0.5 and 1), no cosine term, a heavier cosine
        term, slot 1 without the anchor's write (`anchor_write`: SmolLM2 ties its embeddings), the readouts'
        scale matched to the codes (`scale_weight`), and 8 drafter layers (against an 8-layer DFlash).
        Evaluated by replay: 30 items per benchmark, 512 new tokens, each variant's pooled ratio over its twin
        with a bootstrap interval; run it with two `train.seed`s."""
        return cls(
            workload="sharegpt_3k+gsm8k_train+mbpp_train+bfcl",
            num_prompts=3000,
            methods=["dspine", "dflash"],
            ablations={
                "dspine_split": Ablation(loss={"redo_split": 0.5}),
                "dspine_split1": Ablation(loss={"redo_split": 1.0}),
                "dspine_nocos": Ablation(loss={"cos_weight": 0.0}),
                "dspine_cos1": Ablation(loss={"cos_weight": 1.0}),
                "dspine_noanchor": Ablation(drafter={"anchor_write": False}),
                "dspine_scale": Ablation(loss={"scale_weight": 0.5}),
                "dspine_l8": Ablation(drafter={"num_hidden_layers": 8}),
                "dflash_l8": Ablation(method="dflash", drafter={"num_hidden_layers": 8}),
            },
            eval_ablations=True,
            eval_mode="replay",
            eval_limit=30,
            eval_max_new_tokens=512,
            eval_temperatures=[0.0],
            eval_batch=256,
            eval_pairs={
                "dspine": "dflash",
                "dspine_split": "dflash",
                "dspine_split1": "dflash",
                "dspine_nocos": "dflash",
                "dspine_cos1": "dflash",
                "dspine_noanchor": "dflash",
                "dspine_scale": "dflash",
                "dspine_l8": "dflash_l8",
            },
        )

    @classmethod
    def cpu_tiny(cls) -> RecipeConfig:
        return cls(
            device="cpu",
            workload="sharegpt",
            num_prompts=40,
            max_new_tokens=32,
            regen_batch=20,
            heldout=8,
            layers=1,
            block_size=8,
            ablations={"dspine_nocos": Ablation(loss={"cos_weight": 0.0})},
            train=TrainConfig(
                steps=40,
                batch_size=4,
                anchors_per_seq=8,
                max_len=256,
                lr=3e-3,
                warmup_steps=5,
                gamma=3.5,
                eval_every=20,
            ),
            eval_benchmarks=["gsm8k", "mt_bench"],
            eval_limit=1,
            eval_max_new_tokens=16,
            eval_temperatures=[0.0],
            eval_workers=1,
        )


def run_regen_stage(cfg: RecipeConfig, work: str | Path, target=None, progress: bool = True) -> dict:
    """Answer every prompt of the regen sets not yet answered (resumable); the target is loaded at
    `regen_dtype` (or `dtype`) only when something is left to answer and `target` is not already in it."""
    work = Path(work)
    t0 = time.time()
    sets = [
        (folder, workload_items(workload, limit=limit, max_chars=2000, suffix=f"@T{temp:g}" if temp else ""), temp)
        for folder, workload, limit, temp in _regen_sets(cfg)
    ]
    left = [not {i for i, _ in items} <= existing_ids(work / folder) for folder, items, _ in sets]
    dtype = getattr(torch, cfg.regen_dtype or cfg.dtype)
    if any(left) and (target is None or target.dtype != dtype):
        target = load_target(cfg.target, dtype=dtype, device=cfg.device)
    load_s = time.time() - t0  # ~0 when the caller loaded the target (run_train_stage reports its own)
    t0 = time.time()
    out = {"load_s": load_s}
    for (folder, items, temp), todo in zip(sets, left):
        if not todo:
            rep = RegenReport(input=len(items), ok=0, error=0, skipped=len(items))
        else:
            rep = regenerate_dataset(
                target,
                items,
                work / folder,
                max_new_tokens=cfg.max_new_tokens,
                batch_size=cfg.regen_batch,
                temperature=temp,
                progress=progress,
            )
        out["regen" if folder == "data" else f"regen_{folder}"] = asdict(rep)
    out["regen_s"] = time.time() - t0
    return out


def _regen_sets(cfg: RecipeConfig, added: bool | None = None) -> list[tuple[str, str, int, float]]:
    """(folder, workload, prompts per pool, temperature) of each regenerated set; `added`: only the sets of
    added_workload (True) or only the others (False)."""
    t = cfg.sampled_temperature
    sets = [("data", cfg.workload, cfg.num_prompts, 0.0)]
    if cfg.sampled_workload:
        sets.append((f"data_t{t:g}", cfg.sampled_workload, cfg.sampled_num_prompts, t))
    more = []
    if cfg.added_workload:
        more.append(("data_added", cfg.added_workload, cfg.num_prompts, 0.0))
        if cfg.sampled_workload:
            more.append((f"data_added_t{t:g}", cfg.added_workload, cfg.sampled_num_prompts, t))
    if added is None:
        return sets + more
    return more if added else sets


def training_samples(cfg: RecipeConfig, work: str | Path) -> tuple[list, list]:
    """(samples the held-out split is drawn from, samples added to training only) of a regenerated work folder."""
    load = lambda added: [s for f, *_ in _regen_sets(cfg, added) for s in load_samples(Path(work) / f)]
    return load(False), load(True)


def run_train_stage(cfg: RecipeConfig, work: str | Path, progress: bool = True, resume: bool = False) -> dict:
    """Regen (a no-op when done), then all drafters in lockstep (train.run). `resume` continues every drafter
    from work/<name>/last (a run paused by train.stop_after_s, or extended with more steps / time).
    Under torchrun the training is data parallel (dspine.train.loop); rank 0 loads the target first (so only it
    converts a GGUF), regenerates, evaluates and writes the report; the other ranks return {}."""
    work = Path(work)
    rank, world = init_distributed(cfg.device)
    t0 = time.time()
    if rank > 0:
        _barrier()
    target = load_target(cfg.target, dtype=getattr(torch, cfg.dtype), device=cfg.device)
    load_s = time.time() - t0
    previous = json.loads((work / "train_report.json").read_text()) if resume else {}
    out = {**run_regen_stage(cfg, work, target, progress), "load_s": load_s} if rank == 0 else {}
    if rank == 0 and world > 1:
        _barrier()
    variants = cfg.variants()
    before = {n: previous["methods"][n]["tau_sim_before"] for n in variants} if resume else None
    samples, added = training_samples(cfg, work)
    warm = {n: Path(cfg.warm_from) / n for n in variants} if cfg.warm_from and not resume else None
    rep = run(
        target,
        samples,
        variants,
        {n: work / n for n in variants},
        cfg.train,
        layers=cfg.layers,
        block_size=cfg.block_size,
        heldout=cfg.heldout,
        train_only=added,
        resume=resume,
        warm_from=warm,
        before=before,
        rank=rank,
        progress=progress,
        extra={"recipe": True},
    )
    if rank > 0:
        return {}
    steps = rep["steps"]
    ran = steps - (previous.get("train", {}).get("steps", 0) if resume else 0)
    out.update(samples=rep["samples"], added_samples=len(added), heldout=rep["heldout"], methods=rep["methods"])
    out["train"] = {
        "steps": steps,
        "seconds": rep["seconds"],
        "s_per_step": rep["seconds"] / max(1, ran),
        "drafters": len(variants),
        "processes": world,
        "elapsed_total_s": rep["elapsed_total_s"],
        "invocations": previous.get("train", {}).get("invocations", 0) + 1 if resume else 1,
        "sequences": steps * cfg.train.batch_size,
        "blocks_per_drafter": steps * cfg.train.batch_size * cfg.train.anchors_per_seq,
    }
    atomic_write_text(work / "train_report.json", json.dumps(out, indent=1))
    return out


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def run_eval_stage(cfg: RecipeConfig, work: str | Path, out_json: str | Path, progress: bool = True) -> dict:
    work = Path(work)
    names = [*cfg.methods, *(cfg.ablations if cfg.eval_ablations else [])]
    specs: dict = {m: str(work / m / "best") for m in names}
    if cfg.eval_mode == "replay":
        return _replay_eval(cfg, work, specs, out_json, progress)
    specs.update({f"dspine_k{k}": (specs["dspine"], {"top_k": k}) for k in cfg.eval_top_k})
    trees = {}
    for label, tree in cfg.eval_trees.items():
        for m in cfg.methods:
            specs[f"{m}_{label}"], trees[f"{m}_{label}"] = specs[m], tree
    target, drafters = load_models(cfg.target, cfg.dtype, cfg.device, specs)
    doc = evaluate(
        target,
        drafters,
        cfg.eval_benchmarks,
        cfg.eval_limit,
        cfg.eval_temperatures,
        cfg.eval_max_new_tokens,
        progress=progress,
        workers=cfg.eval_workers,
        target_spec=(cfg.target, cfg.dtype, cfg.device),
        drafter_paths=specs,
        trees=trees,
    )
    write_results(_with_run(doc, cfg, work), out_json)
    return doc


def _with_run(doc: dict, cfg: RecipeConfig, work: Path) -> dict:
    """An evaluation document with the recipe it ran and the training run's report (when there is one)."""
    doc["recipe"] = asdict(cfg)
    rep = work / "train_report.json"
    if rep.is_file():
        doc["train_report"] = json.loads(rep.read_text())
    return doc


def _replay_eval(cfg: RecipeConfig, work: Path, specs: dict, out_json: str | Path, progress: bool) -> dict:
    """eval_mode=replay: the benchmarks replayed at T = 0 (eval.replay.replay_benchmarks), each pair's ratio
    with its interval, and every drafter on the training run's own held-out anchors (the split `run` drew)."""
    from dspine.eval.replay import pair_ratios, replay_benchmarks, write_replay_results
    from dspine.train.losses import heldout_stats
    from dspine.train.run import split_heldout

    deadline = time.time() + cfg.eval_budget_s if cfg.eval_budget_s > 0 else None
    target, drafters = load_models(cfg.target, cfg.dtype, cfg.device, specs)
    doc = replay_benchmarks(
        target,
        drafters,
        cfg.eval_benchmarks,
        cfg.eval_limit,
        cfg.eval_max_new_tokens,
        cfg.eval_batch,
        progress,
        cache=work / "eval_cache",
        deadline=deadline,
    )
    variants = cfg.variants()
    pairs = cfg.eval_pairs or {n: "dflash" for n in specs if variants[n].method == "dspine" and "dflash" in specs}
    doc["pairs"] = pair_ratios(doc, {v: t for v, t in pairs.items() if v in specs and t in specs})
    samples, added = training_samples(cfg, work)
    if samples:
        _, held = split_heldout(samples, cfg.heldout, cfg.train.seed, cfg.train.max_len, added)
        losses = {n: variants[n].loss for n in specs}
        doc["heldout"] = heldout_stats(drafters, target, held, cfg.train, losses=losses)
    write_replay_results(_with_run(doc, cfg, work), out_json)
    return doc


def ship_drafters(cfg: RecipeConfig, work: str | Path, dest: str | Path, which: str = "best") -> dict[str, Path]:
    """Each method's best drafter (`which="last"`: where training stopped — the lockstep pair at one step, for
    a run whose cosine the next warm start continues) as it ships (dest/<name>/): bf16 weights without what the
    target recomputes (checkpoint.DERIVED), its training record in config.json's dspine_training."""
    from dspine.checkpoint import load_drafter, save_drafter

    if which not in ("best", "last"):
        raise ValueError(f"ship_drafters: which={which!r}; 'best' or 'last'")
    work, out = Path(work), {}
    for m in cfg.methods:
        src = work / m / which
        record = json.loads((src / "config.json").read_text()).get("dspine_training")
        out[m] = save_drafter(load_drafter(src), Path(dest) / m, extra=record, dtype=torch.bfloat16, derived=False)
    return out


def acceptance_summary(doc: dict) -> dict:
    """The `acceptance` section of bench/results/summary.json (a replay document, or several seeds' combined: T = 0
    figures, every pair's ratio, and at the top the best pair's `ratio_pooled` and `ratio_ci`)."""
    if doc.get("mode") in ("replay", "replay_seeds"):
        pairs = doc.get("pairs") or {}
        best = max(pairs, key=lambda v: pairs[v]["ratio_pooled"], default=None)
        return {
            "T0": dict(doc["mean"]),
            "T0_pooled": {n: p["tau_pooled"] for n, p in doc["pooled"].items()},
            "per_benchmark": {b: {"T0": {n: r["tau_pooled"] for n, r in c.items()}} for b, c in doc["results"].items()},
            "pairs": pairs,
            "best_pair": best,
            "ratio_pooled": pairs[best]["ratio_pooled"] if best else None,
            "ratio_ci": pairs[best]["ratio_ci"] if best else None,
            "items_per_benchmark": doc["limit"],
            "max_new_tokens": doc["max_new_tokens"],
            "mode": doc["mode"],
            **({"seeds": doc["seeds"]} if "seeds" in doc else {}),
            "git_sha": doc["git_sha"],
            "command": doc["command"],
            "hardware": doc["hardware"],
        }
    return {
        **{k: dict(v) for k, v in doc["means"].items()},
        "per_benchmark": {
            b: {k: {m: r["tau_mean"] for m, r in c.items()} for k, c in by_t.items()}
            for b, by_t in doc["results"].items()
        },
        "git_sha": doc["git_sha"],
        "command": doc["command"],
        "hardware": doc["hardware"],
    }


def lineage_curve(reports: list[dict], methods: tuple[str, ...] = ("dspine", "dflash")) -> dict:
    """Train reports of runs that continued one another, oldest first -> {"x": training sequences seen
    (thousands, summed across the runs; each run's sequences per step from its own report), method: held-out
    τ_sim at those points} — the curve across warm starts, whose batch sizes may differ."""
    out: dict = {"x": [], **{m: [] for m in methods}}
    seen = 0
    for rep in reports:
        per_step = rep["train"]["sequences"] / max(1, rep["train"]["steps"])
        curves = {m: {int(s): t for s, t in rep["methods"][m]["eval_curve"]} for m in methods}
        for step in sorted(set.intersection(*(set(c) for c in curves.values()))):
            out["x"].append((seen + step * per_step) / 1000)
            for m in methods:
                out[m].append(curves[m][step])
        seen += rep["train"]["sequences"]
    return out


def lineage_chart(reports: list[dict], labels: list[str] | None = None) -> str:
    """lineage_curve as an SVG (one panel; the runs named in its title)."""
    cur = lineage_curve(reports)
    series = {m: v for m, v in cur.items() if m != "x"}
    top = math.ceil(max(max(v) for v in series.values()))
    title = "held-out τ_sim" + (f" ({' → '.join(labels)})" if labels else "")
    return line_panels([(title, series)], "training sequences seen (thousands)", y_max=top, width=520, x=cur["x"])
