"""Fine-tuning a base drafter on agent traces (`adapt/finetune.py`), under Ray Train.

Design choices:
- **Samples from token ids, never from text**: each trace row is one model call; its prompt ids then its
  completion ids are one sequence whose loss covers exactly the completion (the tokens the target generated,
  `traces.loss_mask`). A row longer than `train.max_len` keeps its end: the completion and the context nearest it.
- **Three parts, split by task**: in each workload a seeded share of its tasks goes whole (every conversation,
  episode and level of the task) to the **test** part (`heldout_fraction`; what `adapt/evaluate.py` and the gate
  read) and another to the **validation** part (`validation_fraction`; its τ_sim picks the checkpoint during
  training and, among `blend_choices`, the blend is picked by replaying its rows exactly as the test part is
  measured — `select_by=replay`, the default; `tau_sim` the labelled alternative); no test row ever chooses
  anything. `split=episode` (per workload × level cell, by episode) is the labelled alternative for traffic with
  too few tasks.
- **Groups**: one drafter for all traces, per workload, or per workload × thinking level (`per`).
- **Warm start, never resume**: the base's weights only (its config and target checked by `load_drafter`),
  a fresh optimizer at a low learning rate; `mode=lora` injects peft LoRA into `target_modules` (by name) and
  trains the modules LoRA would freeze that a DFlash-style drafter needs (`modules_to_save`: fc, norms,
  injections) in full — left frozen, the drafter silently stops learning. The result is merged into a plain
  checkpoint (LoRA folded into the weights) that serves and exports like any other.
- **Optionally mixed** with general regenerated data (`mix`, `mix_fraction`) to hold the base's skills.
- **Optionally blended** with the base in weight space (`blend` < 1: base + blend · (adapted − base), as in
  WiSE-FT): the served drafter keeps more of the base's general acceptance for part of the adapted gain.
- **Ray Train**: `TorchTrainer` with `workers` processes (gloo on CPU, NCCL on GPU; Ray builds the process
  group); each runs dspine's lockstep trainer on its share of every global batch with averaged gradients, so N
  workers end where one process ends. Every `report_every_s` the trainer pauses and rank 0 reports its state
  (weights, optimizer, RNG, data position) as a Ray checkpoint; a restarted worker group resumes from the last
  one (`ray.train.get_checkpoint`). `workers=0` runs the same loop in this process, without Ray.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dspine.config import ConfigError
from dspine.train.loop import TrainConfig

LEVELS = ("none", "low", "medium", "high", "xhigh")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# what LoRA would leave frozen and a DFlash-style drafter must train: the context projection, norms, injections
HEADS = ["fc", "hidden_norm", "norm", "readout", "gate_f", "gate_p", "message", "write"]


class FinetuneError(ValueError):
    """A fine-tune that cannot start (bad traces, bad settings)."""


@dataclass
class FinetuneConfig:
    traces: str = ""  # a collection directory (adapt/collect.py or `dspine traces export`)
    out: str = ""
    base: str = "builtin"  # a drafter folder, or "builtin" for the built-in target's shipped drafter
    target: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    device: str = "cpu"
    mode: str = "full"  # full | lora
    lora_rank: int = 16
    lora_alpha: int = 32
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    modules_to_save: list[str] = field(default_factory=lambda: list(HEADS))
    per: str = "all"  # all | workload | workload_level
    workloads: list[str] = field(default_factory=list)  # empty: every workload in the traces
    levels: list[str] = field(default_factory=list)
    heldout_fraction: float = 0.2  # the test part's share of the split units
    validation_fraction: float = 0.2  # the validation part's share (picks the checkpoint and the blend)
    split: str = "task"  # the split unit: task (a workload's task whole, every level), or episode (per cell)
    mix: str = ""  # a regenerated-data folder (dspine regen) mixed in
    mix_fraction: float = 0.0  # share of the training samples drawn from `mix`
    blend: float = 1.0  # the saved drafter: base + blend * (adapted - base); 1: the adapted weights as trained
    blend_choices: list[float] = field(default_factory=list)  # non-empty: the blend that validation picks
    # how validation picks the blend: "replay" (pooled τ of the validation rows replayed through the engine from
    # their exact prefixes, as the test is measured) or "tau_sim" (the training loss's simulated acceptance)
    select_by: str = "replay"
    # the blend's general check (select_by=replay): only blend_choices whose general τ — the target's greedy answers
    # to the last `general_validation` items of each gate benchmark (never the gate's own first items), replayed —
    # is at most `max_general_regression` below the base's may be picked; none may: the least regressing one.
    # 0: the agent validation rows alone decide (they favour 1.0, and the gate then refuses on the general τ)
    general_validation: int = 0
    max_general_regression: float = 0.02
    general_max_new_tokens: int = 128
    workers: int = 1  # Ray Train workers; 0: in this process, without Ray
    # CPUs Ray reserves for each training worker — on a CPU run also its torch threads (Ray would give a worker
    # one CPU, so one thread, by default); 0: a CPU run shares the largest node's CPUs among the workers, a GPU
    # run takes Ray's default (where other tasks keep CPUs of that node, e.g. `--entrypoint-num-cpus`, set it:
    # Ray starts a worker only once its CPUs are free)
    cpus_per_worker: int = 0
    report_every_s: float = 0.0  # > 0: a Ray checkpoint every so many seconds of training
    max_failures: int = 1  # Ray Train restarts of the worker group, each from the last reported checkpoint
    seed: int = 0
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=200, lr=1e-4, warmup_steps=10, eval_every=50))

    def validate(self) -> None:  # traces and out may come later (the loop fills them per iteration)
        if self.mode not in ("full", "lora"):
            raise ConfigError(f"mode {self.mode!r}: full or lora")
        if self.split not in ("episode", "task"):
            raise ConfigError(f"split {self.split!r}: episode or task")
        if self.per not in ("all", "workload", "workload_level"):
            raise ConfigError(f"per {self.per!r}: all, workload or workload_level")
        shares = (self.heldout_fraction, self.validation_fraction, self.mix_fraction)
        if not all(0 <= x < 1 for x in shares):
            raise ConfigError("heldout_fraction, validation_fraction and mix_fraction must be in [0, 1)")
        if self.heldout_fraction + self.validation_fraction >= 1:
            raise ConfigError("heldout_fraction + validation_fraction must leave tasks to train on (< 1)")
        if self.select_by not in ("replay", "tau_sim"):
            raise ConfigError(f"select_by {self.select_by!r}: replay or tau_sim")
        if self.general_validation < 0 or self.general_max_new_tokens < 1 or not 0 <= self.max_general_regression < 1:
            raise ConfigError("general_validation >= 0, general_max_new_tokens >= 1, max_general_regression in [0, 1)")
        if self.general_validation and self.select_by != "replay":
            raise ConfigError("general_validation checks blends by replay: it needs select_by=replay")
        if not all(0 < b <= 1 for b in [self.blend, *self.blend_choices]):
            raise ConfigError(f"blend {self.blend}, blend_choices {self.blend_choices}: in (0, 1] (1: as trained)")
        if self.mix_fraction and not self.mix:
            raise ConfigError("mix_fraction > 0 needs mix (a regenerated-data folder)")
        if self.workers < 0 or self.cpus_per_worker < 0 or self.lora_rank < 1 or self.train.max_len < 8:
            raise ConfigError("workers >= 0, cpus_per_worker >= 0, lora_rank >= 1 and train.max_len >= 8")
        if set(self.levels) - set(LEVELS):
            raise ConfigError(f"levels {sorted(set(self.levels) - set(LEVELS))}: one of {LEVELS}")
        self.train.validate()


# --- data ------------------------------------------------------------------------------------------------


def row_sample(row: dict, max_len: int) -> tuple[list[int], int] | None:
    """One trace row -> (ids, index of the first generated token): the loss covers ids[start:], exactly the
    completion; None for a row without token ids or without a completion."""
    from dspine.agents.traces import loss_mask

    if not row.get("has_token_ids") or not row["completion_token_ids"]:
        return None
    ids, mask = loss_mask(row)
    start = mask.index(1)
    if len(ids) > max_len:  # keep the end: the completion and the context nearest it
        cut = len(ids) - max_len
        ids, start = ids[cut:], max(1, start - cut)
    return ids, start


def group_of(row: dict, per: str) -> str:
    return {"all": "all", "workload": row["workload"], "workload_level": f"{row['workload']}-{row['thinking']}"}[per]


def split_unit(row: dict, by: str) -> str:
    return row["episode_id"] if by == "episode" else f"{row['workload']}:{row['task_id']}"


def split_rows(
    rows: list[dict], test: float, validation: float, seed: int, by: str = "task"
) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, validation, test) rows. by="task": in each workload, seeded shares of its tasks go whole — every
    episode of the task at every thinking level — to test and to validation, so no evaluated prompt is a task the
    drafter trained on or was picked on. by="episode": the same per workload × thinking-level cell with episodes.
    Each part that asks for a share gets at least one unit while at least one is left to train on; a part is
    never shared."""
    scope = (lambda r: f"{r['workload']}/{r['thinking']}") if by == "episode" else (lambda r: r["workload"])
    by_scope: dict[str, set[str]] = {}
    for r in rows:
        by_scope.setdefault(scope(r), set()).add(split_unit(r, by))
    part: dict[str, str] = {}
    for key, ids in sorted(by_scope.items()):
        units = sorted(ids)
        random.Random(f"{seed}:{key}").shuffle(units)
        left = len(units) - 1  # one always trains
        n_test = min(left, max(1, round(test * len(units)))) if test > 0 else 0
        n_val = min(left - n_test, max(1, round(validation * len(units)))) if validation > 0 else 0
        part.update({u: "test" for u in units[:n_test]})
        part.update({u: "validation" for u in units[n_test : n_test + n_val]})
    out: dict[str, list[dict]] = {"train": [], "validation": [], "test": []}
    for r in rows:
        out[part.get(split_unit(r, by), "train")].append(r)
    return out["train"], out["validation"], out["test"]


def split_episodes(rows: list[dict], fraction: float, seed: int, by: str = "episode") -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): split_rows without a validation part."""
    train, _, held = split_rows(rows, fraction, 0.0, seed, by)
    return train, held


def load_groups(cfg: FinetuneConfig) -> dict[str, dict]:
    """{group: {"train": samples, "validation": samples, "heldout_episodes": [...] (the test part),
    "validation_episodes": [...], "test_tasks": [...] (what a later run must hold out too), "parts": rows and tasks per
    part, "rows": n}} from the traces."""
    from dspine.agents.traces import Store, load_traces

    if not Store(cfg.traces).exists("traces"):
        raise FinetuneError(f"{cfg.traces}: no traces/ folder (not a collection directory)")
    rows = load_traces(cfg.traces).to_pylist()
    rows = [r for r in rows if (not cfg.workloads or r["workload"] in cfg.workloads)]
    rows = [r for r in rows if (not cfg.levels or r["thinking"] in cfg.levels)]
    usable = [r for r in rows if row_sample(r, cfg.train.max_len) is not None]
    if not usable:
        raise FinetuneError(f"{cfg.traces}: no trace rows with token ids and a completion (of {len(rows)} selected)")
    groups: dict[str, list[dict]] = {}
    for r in usable:
        groups.setdefault(group_of(r, cfg.per), []).append(r)
    out = {}
    for g, grows in sorted(groups.items()):
        train, val, held = split_rows(grows, cfg.heldout_fraction, cfg.validation_fraction, cfg.seed, cfg.split)
        out[g] = {
            "train": [row_sample(r, cfg.train.max_len) for r in train],
            "validation": [row_sample(r, cfg.train.max_len) for r in val],
            # whole rows, for the replay that picks the blend (select_by=replay)
            "validation_rows": [(list(r["prompt_token_ids"]), list(r["completion_token_ids"])) for r in val],
            "heldout_episodes": sorted({r["episode_id"] for r in held}),
            "validation_episodes": sorted({r["episode_id"] for r in val}),
            "test_tasks": sorted({split_unit(r, "task") for r in held}),
            "parts": {
                name: {"rows": len(rs), "tasks": len({split_unit(r, "task") for r in rs})}
                for name, rs in (("train", train), ("validation", val), ("test", held))
            },
            "rows": len(grows),
        }
    return out


def mix_in(samples: list, cfg: FinetuneConfig) -> list:
    """`samples` plus general regenerated ones, so that they make `mix_fraction` of the result."""
    if not cfg.mix_fraction:
        return samples
    from dspine.train.data import load_samples

    n = cfg.train.max_len
    general = [(ids[-n:], max(1, start - max(0, len(ids) - n))) for ids, start in load_samples(cfg.mix)]
    want = round(len(samples) * cfg.mix_fraction / (1 - cfg.mix_fraction))
    rng = random.Random(cfg.seed)
    return samples + [general[i] for i in rng.sample(range(len(general)), min(want, len(general)))]


# --- the drafter -----------------------------------------------------------------------------------------


def prepare_drafter(cfg: FinetuneConfig, target):
    """The base drafter, warm-started (weights only), checked against the target."""
    import torch

    from dspine.checkpoint import load_drafter, resolve_drafter

    path = resolve_drafter(cfg.base, cfg.target)
    return load_drafter(path, target, dtype=getattr(torch, cfg.dtype), device=cfg.device)


def add_lora(drafter, cfg: FinetuneConfig):
    """peft LoRA in `target_modules`; everything else frozen except `modules_to_save` (trained in full)."""
    from peft import LoraConfig, inject_adapter_in_model

    names = {n.rsplit(".", 1)[-1] for n, _ in drafter.named_modules()}
    unknown = sorted(set(cfg.target_modules + cfg.modules_to_save) - names)
    if unknown:
        raise ConfigError(f"no module of the drafter is named {unknown}")
    lc = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=cfg.target_modules, lora_dropout=0.0)
    drafter = inject_adapter_in_model(lc, drafter)
    for n, p in drafter.named_parameters():
        leaf = [part for part in n.split(".") if not part.isdigit()]
        p.requires_grad = "lora_" in n or any(m in leaf for m in cfg.modules_to_save)
    return drafter


def merge_lora(drafter):
    """Fold every LoRA layer into its base weight and put the plain layer back (in place) -> the drafter."""
    from peft.tuners.lora import LoraLayer

    for name, m in list(drafter.named_modules()):
        if isinstance(m, LoraLayer):
            m.merge()
            parent, _, leaf = name.rpartition(".")
            setattr(drafter.get_submodule(parent) if parent else drafter, leaf, m.get_base_layer())
    for p in drafter.parameters():
        p.requires_grad = True
    return drafter


def blend_weights(drafter, base_state: dict, alpha: float):
    """In place: every parameter p <- base + alpha * (p - base) (weight-space interpolation) -> the drafter."""
    import torch

    with torch.no_grad():
        for n, p in drafter.named_parameters():
            b = base_state[n].to(p)
            p.copy_(b + alpha * (p - b))
    return drafter


# --- training --------------------------------------------------------------------------------------------


def train_group(
    cfg: FinetuneConfig,
    group: str,
    data: dict,
    workdir: Path,
    resume_from: Path | None,
    report=None,
    progress: bool = False,
):
    """Train one group's drafter in this process (one of the data-parallel workers, or alone) -> rank 0's
    history. Pauses every `report_every_s` to `report(workdir)` (weights, optimizer, data position in
    workdir/last); `resume_from`: a reported folder to continue from."""
    import torch

    from dspine.checkpoint import save_drafter
    from dspine.target import load_target
    from dspine.train.loop import Trainer

    target = load_target(cfg.target, dtype=getattr(torch, cfg.dtype), device=cfg.device)
    drafter = prepare_drafter(cfg, target)
    blends = cfg.blend_choices or [cfg.blend]
    base_state = {k: v.clone() for k, v in drafter.state_dict().items()} if min(blends) < 1 else None
    drafter = add_lora(drafter, cfg) if cfg.mode == "lora" else drafter
    train = mix_in(data["train"], cfg)
    tcfg = dataclasses.replace(cfg.train, seed=cfg.seed, stop_after_s=cfg.report_every_s)
    extra = {"adapted_from": cfg.base, "group": group, "mode": cfg.mode, "traces": cfg.traces}
    if resume_from is not None and resume_from != workdir:
        shutil.copytree(resume_from, workdir, dirs_exist_ok=True)
    tr = Trainer({group: drafter}, target, train, tcfg, data["validation"] or None, {group: workdir}, extra)
    if resume_from is not None:
        tr.resume()
    while True:  # segments of report_every_s: the trainer pauses (saving workdir/last), reports, continues
        hist = tr.run(progress=progress)[group]
        step, elapsed = hist[-1]["step"], hist[-1]["elapsed_s"]
        done = step >= tcfg.steps or bool(tcfg.time_budget_s and elapsed >= tcfg.time_budget_s)
        if report is not None:
            report(workdir, hist, done)
        if done:
            break
        tr.start, tr.spent = step, elapsed
    if tr.rank == 0:
        best = workdir / "best" / "model.safetensors"
        if best.is_file():  # the best validation τ_sim, else the last step
            from safetensors.torch import load_file

            drafter.load_state_dict(load_file(str(best)))
        plain = merge_lora(drafter) if cfg.mode == "lora" else drafter
        alpha, scores = choose_blend(cfg, plain, base_state, target, data["validation"], data.get("validation_rows"))
        if base_state is not None and alpha < 1:
            blend_weights(plain, base_state, alpha)
        last = {**hist[-1], "processes": tr.world, "threads": torch.get_num_threads()}
        info = {**extra, "history": last, "blend": alpha, "blend_validation": {"by": cfg.select_by, "tau": scores}}
        save_drafter(plain, workdir / "final", extra=info, derived=False)
    return hist


def choose_blend(
    cfg: FinetuneConfig, drafter, base_state: dict | None, target, validation: list, rows: list | None = None
) -> tuple[float, dict]:
    """The blend to save: `blend`, or among `blend_choices` the one whose blended drafter validates best — the
    pooled τ of the validation `rows` (prompt ids, completion ids) replayed through the engine (`select_by=replay`:
    the test part's own measure), else the τ_sim of the validation samples — never on the test part -> (alpha,
    {alpha: its score}). Ties go to the least blended."""
    import copy

    if not cfg.blend_choices:
        return cfg.blend, {}
    if not validation:  # nothing to choose on: the least blended choice
        return max(cfg.blend_choices), {}
    cands = {}
    for a in cfg.blend_choices:
        d = copy.deepcopy(drafter)
        cands[str(a)] = blend_weights(d, base_state, a) if a < 1 else d
    if cfg.select_by == "replay" and rows:
        scores = replay_taus(target, cands, rows)
    else:
        from dspine.train.losses import evaluate_tau_sims

        scores = evaluate_tau_sims(cands, target, validation, cfg.train)
    allowed, report = list(cfg.blend_choices), {k: round(v, 4) for k, v in scores.items()}
    if cfg.general_validation and base_state is not None:
        base = copy.deepcopy(drafter)
        base.load_state_dict(base_state)
        from dspine.eval.replay import replay_grouped

        grows, groups = general_validation_rows(target, cfg.general_validation, cfg.general_max_new_tokens)
        general = replay_grouped(target, {"base": base, **cands}, grows, groups, 16, progress=False)["mean"]
        regression = {a: 1 - general[str(a)] / general["base"] for a in cfg.blend_choices}
        allowed = allowed_blends(regression, cfg.max_general_regression)
        report = {
            "agent": report,
            "general": {k: round(v, 4) for k, v in general.items()},
            "general_regression": {str(a): round(r, 4) for a, r in regression.items()},
            "allowed": [str(a) for a in allowed],
            "general_rows": len(grows),
        }
    best = max(allowed, key=lambda a: (scores[str(a)], a))
    return best, report


def allowed_blends(regression: dict[float, float], limit: float) -> list[float]:
    """The blends whose general regression is at most `limit`; when none is, the least regressing one alone
    (ties: the less blended toward the adapted weights, i.e. the smaller alpha)."""
    ok = [a for a, r in regression.items() if r <= limit]
    return ok or [min(regression, key=lambda a: (regression[a], a))]


def general_validation_rows(target, n: int, max_new_tokens: int) -> tuple[list, list[str]]:
    """The general validation rows: each gate benchmark's last `n` items (adapt/evaluate.py gates on the first
    ones), their first turns rendered by the target's chat template, and the target's greedy answer, decoded in
    one batch -> ([(prompt ids, answer ids)], [benchmark of each row])."""
    from dspine.adapt.evaluation import BENCHMARKS
    from dspine.eval.replay import greedy_answers
    from dspine.workloads import load_benchmark

    items = [(b, it) for b in BENCHMARKS for it in load_benchmark(b)[-n:]]
    return greedy_answers(target, [it.turns[0] for _, it in items], max_new_tokens), [b for b, _ in items]


def replay_taus(target, drafters: dict, rows: list, batch_size: int = 16) -> dict[str, float]:
    """Each drafter's pooled τ over `rows` (prompt ids, completion ids), replayed through the engine from the
    exact prefixes (dspine.eval.replay.replay, as adapt/evaluate.py measures the test part), the candidates
    sharing one prefix cache (each batch's prompts prefilled once for all of them)."""
    from dspine.eval.replay import replay
    from dspine.options import REPLAY_PREFIX_TOKENS
    from dspine.stats import AcceptanceStats

    jobs = [(n, list(p), list(c)) for p, c in rows for n in drafters]
    res = replay(target, drafters, jobs, progress=False, batch_size=batch_size, prefix_tokens=REPLAY_PREFIX_TOKENS)
    pooled: dict = {}
    for (n, _, _), r in zip(jobs, res):
        st = AcceptanceStats(r["block_size"], r["accept_hist"])
        pooled[n] = st if n not in pooled else pooled[n].merge(st)
    return {n: st.tau for n, st in pooled.items()}


def _ray_worker(conf: dict) -> None:
    """Ray Train's train_loop_per_worker: one data-parallel process of one group's fine-tune."""
    import ray.train
    from ray.train import Checkpoint

    from dspine.config import from_dict

    cfg = from_dict(FinetuneConfig, conf["cfg"])
    if conf.get("threads"):  # a CPU run: as many torch threads as CPUs Ray reserved for this worker
        import torch

        torch.set_num_threads(conf["threads"])
    rank = ray.train.get_context().get_world_rank()
    work = Path(tempfile.mkdtemp(prefix=f"dspine-ft-{rank}-"))
    ckpt = ray.train.get_checkpoint()
    resume = None
    if ckpt is not None:
        with ckpt.as_directory() as d:
            resume = work
            shutil.copytree(d, work, dirs_exist_ok=True)

    def report(folder: Path, hist: list[dict], done: bool) -> None:
        m = {"step": hist[-1]["step"], "loss": hist[-1]["loss"], "done": done}
        m["eval_tau_sim"] = next((h["eval_tau_sim"] for h in reversed(hist) if "eval_tau_sim" in h), None)
        ray.train.report(m, checkpoint=Checkpoint.from_directory(str(folder)) if rank == 0 and not done else None)

    train_group(cfg, conf["group"], conf["data"], work, resume, report)
    if rank == 0:  # the merged drafter, as the run's last checkpoint
        ray.train.report({"final": True}, checkpoint=Checkpoint.from_directory(str(work)))
    else:
        ray.train.report({"final": True})


def finetune(cfg: FinetuneConfig, progress: bool = True) -> dict:
    """Every group's fine-tune -> {"groups": {group: {"drafter": out/<group>, "heldout_episodes", ...}}};
    writes out/finetune.json (the configuration, groups, where each drafter is)."""
    from dspine.config import to_dict
    from dspine.io import atomic_write_text

    if not cfg.traces or not cfg.out:
        raise ConfigError("traces and out are required")
    cfg.validate()
    groups = load_groups(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"config": to_dict(cfg), "groups": {}}
    for g, data in groups.items():
        if not data["train"]:
            raise FinetuneError(f"group {g}: every episode is held out (only {data['rows']} rows)")
        if cfg.workers == 0:
            work = out / "work" / g  # last/ best/ final/: the run's own state, beside its result
            shutil.rmtree(work, ignore_errors=True)
            train_group(cfg, g, data, work, None, progress=progress)
            final = work / "final"
        else:
            final = _fit_with_ray(cfg, g, data, out)
        last = json.loads((final / "config.json").read_text())["dspine_training"]["history"]
        dest = out / g
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(final, dest)
        summary["groups"][g] = {
            "drafter": str(dest),
            "train_samples": len(data["train"]),
            "validation_samples": len(data["validation"]),
            "heldout_episodes": data["heldout_episodes"],
            "validation_episodes": data["validation_episodes"],
            "test_tasks": data["test_tasks"],
            "parts": data["parts"],
            "split": cfg.split,
            "blend": json.loads((final / "config.json").read_text())["dspine_training"].get("blend"),
            "last": last,
        }
    atomic_write_text(out / "finetune.json", json.dumps(summary, indent=1))
    return summary


def worker_cpus(workers: int) -> int:
    """CPUs for each of `workers` training workers on a CPU run: the Ray cluster's CPUs shared among them, at
    most one node's (a worker runs on one node), at least one. Joins (or starts) the Ray cluster as
    TorchTrainer would."""
    import ray

    if not ray.is_initialized():
        ray.init()
    total = ray.cluster_resources().get("CPU", 1)
    node = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")), default=total)
    return max(1, int(min(node, total // workers)))


def _fit_with_ray(cfg: FinetuneConfig, group: str, data: dict, out: Path) -> Path:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from dspine.config import to_dict

    gpu = cfg.device.startswith("cuda")
    cpus = cfg.cpus_per_worker or (0 if gpu else worker_cpus(cfg.workers))
    trainer = TorchTrainer(
        _ray_worker,
        train_loop_config={"cfg": to_dict(cfg), "group": group, "data": data, "threads": 0 if gpu else cpus},
        scaling_config=ScalingConfig(
            num_workers=cfg.workers, use_gpu=gpu, resources_per_worker={"CPU": cpus} if cpus else None
        ),
        run_config=RunConfig(
            name=f"finetune-{group}",
            storage_path=str((out / "ray").resolve()),
            failure_config=FailureConfig(max_failures=cfg.max_failures),
        ),
    )
    result = trainer.fit()
    if result.error is not None:
        raise FinetuneError(f"group {group}: Ray Train failed: {result.error}")
    with result.checkpoint.as_directory() as d:
        keep = Path(tempfile.mkdtemp(prefix="dspine-ft-final-"))
        shutil.copytree(Path(d) / "final", keep / "final")
    return keep / "final"
