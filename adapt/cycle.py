"""The closed loop (`adapt/loop.py`): the proxy's recorded traffic -> traces -> fine-tune -> replay and gate ->
deploy, on a schedule.

Each iteration exports every request the proxy recorded with token ids (all traffic so far: offline
distillation on the collected traffic, from the same base each time), fine-tunes the base on it
(adapt/finetuning.py — Ray Train when `finetune.workers` > 0, on the cluster the job runs in), replays the
held-out episodes and gates (adapt/evaluation.py), and deploys what passes (adapt/deployment.py: swap, live
check, roll-back). An iteration with fewer than `min_rows` new trace rows since the last fine-tune is skipped.
Every iteration's outcome is appended to WORK/loop.json; decisions to WORK/deploys.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from dspine.adapt.deployment import DeployConfig
from dspine.adapt.evaluation import EvalConfig
from dspine.adapt.finetuning import FinetuneConfig
from dspine.config import ConfigError


@dataclass
class LoopConfig:
    store: str = ""  # the proxy's SQLite store (dspine proxy --db)
    work: str = ""  # one folder per iteration, loop.json, deploys.jsonl
    every_s: float = 3600.0  # from the start of one iteration to the next
    iterations: int = 1  # 0: until stopped
    min_rows: int = 8  # new trace rows needed for a fine-tune
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    evaluate: EvalConfig = field(default_factory=EvalConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)

    def validate(self) -> None:
        if not self.store or not self.work:
            raise ConfigError("store and work are required")
        if not Path(self.store).is_file():
            raise ConfigError(f"{self.store}: no such store (the proxy's --db)")
        if self.every_s <= 0 or self.iterations < 0 or self.min_rows < 1:
            raise ConfigError("every_s > 0, iterations >= 0 and min_rows >= 1")


def _log(work: Path) -> list[dict]:
    f = work / "loop.json"
    return json.loads(f.read_text()) if f.is_file() else []


def run_iteration(cfg: LoopConfig, progress: bool = True) -> dict:
    """One pass: export, fine-tune, evaluate and gate, deploy -> its outcome (appended to WORK/loop.json)."""
    from dspine.adapt.deployment import deploy
    from dspine.adapt.evaluation import evaluate_adaptation
    from dspine.adapt.finetuning import finetune
    from dspine.agents.traces import export_store
    from dspine.io import atomic_write_text

    work = Path(cfg.work)
    log = _log(work)
    n = len(log)
    it = work / f"iter-{n:03d}"
    t0 = time.time()
    rows = export_store(cfg.store, str(it / "traces"))
    total = sum(rows.values())
    trained = next((e["rows_total"] for e in reversed(log) if e.get("action") != "skipped"), 0)
    out: dict = {"iteration": n, "ts": t0, "rows": rows, "rows_total": total}
    if total - trained < cfg.min_rows:
        out.update(action="skipped", reason=f"{total - trained} new trace rows < min_rows {cfg.min_rows}")
    else:
        ft = dataclasses.replace(cfg.finetune, traces=str(it / "traces"), out=str(it / "finetune"))
        res = finetune(ft, progress=progress)
        ev = dataclasses.replace(cfg.evaluate, finetune=ft.out, out=str(it / "adapt.json"))
        doc = evaluate_adaptation(ev, progress=progress)
        dep = dataclasses.replace(cfg.deploy, evaluation=ev.out, history=str(work / "deploys.jsonl"))
        entries = []
        for g in res["groups"]:
            entries.append(deploy(dataclasses.replace(dep, group=g)))
        out.update(
            action="adapted",
            per_cell={c: {k: v[k] for k in ("base", "adapted", "ratio")} for c, v in doc["per_cell"].items()},
            general_regression=doc["general_regression"],
            deploys=[{k: e.get(k) for k in ("group", "action", "live", "reasons")} for e in entries],
        )
    out["seconds"] = time.time() - t0
    atomic_write_text(work / "loop.json", json.dumps([*log, out], indent=1))
    return out


def run_loop(cfg: LoopConfig, progress: bool = True) -> list[dict]:
    """Iterations every `every_s` (0 iterations: until stopped) -> their outcomes."""
    cfg.validate()
    done = []
    while not cfg.iterations or len(done) < cfg.iterations:
        start = time.time()
        done.append(run_iteration(cfg, progress))
        if cfg.iterations and len(done) >= cfg.iterations:
            break
        time.sleep(max(0.0, cfg.every_s - (time.time() - start)))
    return done
