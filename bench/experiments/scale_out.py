"""Scale-out on several GPUs, one document: Ray Train fine-tunes at 1..N GPUs, SGLang under tensor parallelism
with the dspine plugin, and trace collection through several replicas behind the proxy.

    # 1. on the machine with the GPUs: the same fine-tune at each worker count (one GPU per Ray Train worker)
    python bench/experiments/scale_out.py finetune --traces runs/traces --gpus 1,2,4,8 --per-gpu-batch 16 \\
        --steps 60 --device cuda --out bench/results/scale_out.json
    # 2. the TP shapes (bench/experiments/sglang_scale.py --tp-size N --group 1) and the replicas stage of
    #    bench/experiments/gpu_loop.py, folded in beside it; the summary's `scale_out` section
    python bench/experiments/scale_out.py combine --out bench/results/scale_out.json \\
        --tp /tmp/scale/sglang_scale_tp.json --replicas bench/results/gpu_loop.json --summary bench/results/summary.json

Fine-tune scaling is weak scaling, as data-parallel users run it: each worker keeps --per-gpu-batch sequences
a step (the global batch grows with the workers), the same traces, steps and settings otherwise. Throughput is
sequences per second of training (the trainer's own clock, without Ray's start or the target's load); the
efficiency at N is throughput(N) / (N × throughput(1)). That N workers train what one process trains on the
same global batch is tested on CPU workers in CI (tests/test_finetune.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dspine.adapt.finetuning import FinetuneError
from dspine.checkpoint import CheckpointError
from dspine.config import ConfigError
from dspine.io import atomic_write_text, comma_ints, md_table, provenance, update_summary


def finetune_point(traces: str, out: Path, workers: int, per_gpu_batch: int, steps: int, device: str, overrides):
    """One fine-tune at `workers` data-parallel workers -> its figures (steps, seconds, sequences/s)."""
    from dspine.adapt.finetuning import FinetuneConfig, finetune
    from dspine.config import configure

    batch = per_gpu_batch * max(workers, 1)
    cfg = configure(
        FinetuneConfig,
        [
            "per=all",
            "validation_fraction=0",  # no evaluation inside the timed steps
            f"train.steps={steps}",
            f"train.batch_size={batch}",
            f"train.eval_every={steps + 1}",
            *overrides,
        ],
        traces=traces,
        out=str(out / f"workers{workers}"),
        workers=workers,
        device=device,
    )
    t0 = time.time()
    res = finetune(cfg, progress=False)
    last = next(iter(res["groups"].values()))["last"]
    secs = float(last["elapsed_s"])
    return {
        "workers": workers,
        "batch": batch,
        "steps": int(last["step"]),
        "train_s": round(secs, 3),
        "wall_s": round(time.time() - t0, 1),
        "steps_per_s": round(last["step"] / secs, 4),
        "sequences_per_s": round(last["step"] * batch / secs, 3),
        "loss": last.get("loss"),
        "processes": last.get("processes"),
    }


def scaling(points: list[dict]) -> dict:
    """The points by worker count -> each one's speed-up over one worker and its efficiency (speed-up / N)."""
    by = {p["workers"]: p for p in points}
    one = by.get(1, {}).get("sequences_per_s")
    out = {}
    for n in sorted(by):
        p = dict(by[n])
        if one:
            p["speedup"] = round(p["sequences_per_s"] / one, 3)
            p["efficiency"] = round(p["speedup"] / n, 3)
        out[str(n)] = p
    return out


def tp_figures(doc: dict) -> dict:
    """A bench/experiments/sglang_scale.py document -> per tensor-parallel shape (key `<shape>-tpN`) and concurrency:
    the DSpine round over DFlash's and both × AR, at each forced τ."""
    out = {}
    for name, shape in doc.get("shapes", {}).items():
        if "-tp" not in name:
            continue
        table, ratio = shape.get("table", {}), shape.get("dspine_over_dflash", {})
        taus = sorted({v.split("@")[1] for v in table if "@" in v})
        out[name] = {
            "tp": int(name.rsplit("-tp", 1)[1]),
            "dspine_round_over_dflash": {t: {c: r["gpu_round"] for c, r in by.items()} for t, by in ratio.items()},
            "vs_ar": {
                f"{m}@{t}": {c: row.get("vs_ar") for c, row in table.get(f"{m}@{t}", {}).items()}
                for m in ("dspine", "dflash")
                for t in taus
            },
            **{k: shape.get(k) for k in ("git_sha", "command", "hardware", "sglang_version")},
        }
    return out


def markdown(doc: dict) -> str:
    parts = ["# Scale-out\n"]
    ft = doc.get("finetune")
    if ft:
        parts.append(
            f"## Ray Train fine-tune (weak scaling: {ft['per_gpu_batch']} sequences per GPU a step, "
            f"{ft['steps']} steps, device {ft['device']})\n"
        )
        rows = [
            [
                n,
                p["batch"],
                p["steps"],
                f"{p['train_s']:.1f}",
                f"{p['sequences_per_s']:.1f}",
                p.get("speedup", "-"),
                p.get("efficiency", "-"),
            ]
            for n, p in ft["points"].items()
        ]
        parts.append(
            md_table(["GPUs", "global batch", "steps", "train s", "sequences/s", "speed-up", "efficiency"], rows)
        )
        parts.append(f"\n{ft.get('git_sha', '')} · {ft.get('hardware', '')} · `{ft.get('command', '')}`\n")
    for name, t in (doc.get("tp") or {}).items():
        parts.append(f"## SGLang {name} (plugin under --tp-size {t['tp']}; random weights, forced τ)\n")
        rows = [[tau, c, f"{r:.3f}"] for tau, by in t["dspine_round_over_dflash"].items() for c, r in by.items()]
        parts.append(md_table(["forced τ", "concurrency", "DSpine round / DFlash round"], rows))
        rows = [[v, *(f"{x:.2f}" if x else "-" for x in by.values())] for v, by in t["vs_ar"].items() if by]
        if rows:
            conc = next(by for by in t["vs_ar"].values() if by)
            parts.append("\n" + md_table(["variant", *(f"× AR c={c}" for c in conc)], rows))
    rep = doc.get("replicas")
    if rep:
        parts.append(f"## Collection through {rep['replicas']} replicas behind the proxy\n")
        rows = [[k, v.get("episodes"), v.get("episodes_per_min")] for k, v in rep.get("runs", {}).items()]
        parts.append(md_table(["backends", "episodes", "episodes/min"], rows))
        parts.append(f"\nspeed-up {rep.get('speedup')}, efficiency {rep.get('efficiency')}\n")
    return "\n".join(parts) + "\n"


def summary_section(doc: dict) -> dict:
    ft = (doc.get("finetune") or {}).get("points", {})
    return {
        "finetune_sequences_per_s": {n: p["sequences_per_s"] for n, p in ft.items()},
        "finetune_efficiency": {n: p.get("efficiency") for n, p in ft.items()},
        "tp_round_over_dflash": {n: t["dspine_round_over_dflash"] for n, t in (doc.get("tp") or {}).items()},
        "tp_vs_ar": {n: t["vs_ar"] for n, t in (doc.get("tp") or {}).items()},
        "replicas": {k: (doc.get("replicas") or {}).get(k) for k in ("replicas", "speedup", "efficiency")},
        **{k: doc.get(k) for k in ("git_sha", "command", "hardware")},
    }


def write(doc: dict, out: Path, summary: str | None) -> None:
    atomic_write_text(out, json.dumps(doc, indent=1))
    atomic_write_text(out.with_suffix(".md"), markdown(doc))
    if summary:
        update_summary(summary, "scale_out", summary_section(doc))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    f = sub.add_parser("finetune", help="the same fine-tune at each GPU count (Ray Train workers)")
    f.add_argument("--traces", required=True, help="a collection directory (adapt/collect.py)")
    f.add_argument("--gpus", type=comma_ints, default=[1, 2, 4, 8], help="worker counts, comma-separated (1 first)")
    f.add_argument("--per-gpu-batch", type=int, default=16, help="sequences per worker a step")
    f.add_argument("--steps", type=int, default=60, help="training steps at every count")
    f.add_argument("--device", default="cuda", help="cuda (one GPU per worker) or cpu (a rehearsal)")
    f.add_argument("--work", default="/tmp/dspine-scale-out", help="the fine-tunes' output folders")
    f.add_argument("overrides", nargs="*", help="more FinetuneConfig settings, dotted (e.g. mode=lora)")
    c = sub.add_parser("combine", help="fold the TP shapes and the replicas' figures in; the summary section")
    c.add_argument("--tp", help="bench/experiments/sglang_scale.py JSON with <shape>-tpN shapes")
    c.add_argument("--replicas", help="bench/experiments/gpu_loop.py JSON with a replicas section")
    for p in (f, c):
        p.add_argument("--out", required=True, help="scale_out JSON (a .md beside it); kept sections stay")
        p.add_argument("--summary", help="summary.json whose `scale_out` section is rewritten")
    a = ap.parse_args(argv)
    out = Path(a.out)
    doc = json.loads(out.read_text()) if out.is_file() else {}
    try:
        if a.stage == "finetune":
            if a.gpus[0] != 1 or a.per_gpu_batch < 1 or a.steps < 1:
                raise ConfigError("--gpus starts at 1 (the baseline); --per-gpu-batch and --steps >= 1")
            points = []
            for n in a.gpus:
                points.append(
                    finetune_point(a.traces, Path(a.work), n, a.per_gpu_batch, a.steps, a.device, a.overrides)
                )
                print(json.dumps(points[-1]), file=sys.stderr, flush=True)
                doc["finetune"] = {
                    "points": scaling(points),
                    "per_gpu_batch": a.per_gpu_batch,
                    "steps": a.steps,
                    "device": a.device,
                    "traces": a.traces,
                    **provenance(),
                }
                write(doc, out, a.summary)  # after every count: a run cut short keeps what it measured
        else:
            if a.tp:
                doc["tp"] = tp_figures(json.loads(Path(a.tp).read_text()))
            if a.replicas:
                rep = json.loads(Path(a.replicas).read_text()).get("replicas")
                if not rep:
                    raise ConfigError(f"{a.replicas}: no replicas section (gpu_loop.py replicas)")
                doc["replicas"] = rep
            doc.update(provenance())
            write(doc, out, a.summary)
    except (ConfigError, FinetuneError, CheckpointError, OSError, ValueError) as e:
        print(f"scale_out: error: {e}", file=sys.stderr)
        return 2
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
