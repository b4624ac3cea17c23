"""bench/experiments/scale_out.py on the CPU: the fine-tune's weak-scaling arithmetic, a run cut short keeping the
counts it measured, the TP shapes and the replicas folded into one document and the summary's `scale_out`
section, and bad input refused with one line. The measurements themselves need a machine with several GPUs."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "experiments"))  # the lab, not the package
import scale_out
from shape_scale import analyse


def _point(n, seqs):
    return {"workers": n, "batch": 16 * n, "steps": 60, "train_s": 60 * 16 * n / seqs, "sequences_per_s": seqs}


def test_weak_scaling_efficiency_and_a_run_cut_short(tmp_path, monkeypatch):
    pts = scale_out.scaling([_point(1, 100.0), _point(2, 190.0), _point(4, 340.0)])
    assert pts["2"]["speedup"] == pytest.approx(1.9) and pts["2"]["efficiency"] == pytest.approx(0.95)
    assert pts["4"]["efficiency"] == pytest.approx(0.85) and pts["1"]["efficiency"] == 1.0

    seen = []

    def fake(traces, work, n, per, steps, device, overrides):
        seen.append((n, per, steps, device, tuple(overrides)))
        if n == 4:
            raise OSError("worker lost")
        return _point(n, 100.0 * n)

    monkeypatch.setattr(scale_out, "finetune_point", fake)
    out = tmp_path / "so.json"
    rc = scale_out.main(
        ["finetune", "--traces", "t", "--gpus", "1,2,4", "--device", "cpu", "--out", str(out), "mode=lora"]
    )
    assert rc == 2  # the error is reported, the process exits cleanly
    assert seen == [(n, 16, 60, "cpu", ("mode=lora",)) for n in (1, 2, 4)]
    doc = json.loads(out.read_text())
    assert list(doc["finetune"]["points"]) == ["1", "2"]  # what was measured before the failure stays
    assert doc["finetune"]["points"]["2"]["efficiency"] == 1.0 and "git_sha" in doc["finetune"]
    assert "| 2 | 32 |" in out.with_suffix(".md").read_text()
    assert scale_out.main(["finetune", "--traces", "t", "--gpus", "2,4", "--out", str(out)]) == 2  # no baseline


def _row(tps, tau=None, gpu=None, step=None):
    row = {"tokens_per_s": tps, "requests": 8, "tokens": 2048, "seconds": 2048 / tps}
    if tau is not None:
        row.update(
            tau_pooled=tau, gpu_round_ms=gpu, phase_ms_per_round={"draft": 1.0, "verify": gpu - 1.5, "glue": 0.5}
        )
        row["round_ms"] = gpu + 0.3
    if step is not None:
        row["ar_step_ms"] = step
    return row


def _tp_doc():
    var = {"ar": {"method": "ar", "forced_tau": None, "by_concurrency": {"1": _row(100, step=8.0), "4": _row(380)}}}
    for m, extra in (("dflash", 0.0), ("dspine", 0.3)):
        var[f"{m}@3"] = {
            "method": m,
            "forced_tau": 3.0,
            "by_concurrency": {"1": _row(250 - 10 * extra, 3.0, 10 + extra), "4": _row(800, 3.0, 12 + extra)},
        }
    doc = {"settings": {"concurrencies": [1, 4], "flags": ["--tp-size", "4"]}, "variants": var}
    doc.update(analyse(doc, {}, None))
    return {
        "shapes": {"qwen3-8b": {"table": {}}, "qwen3-32b-tp4": {**doc, "git_sha": "abc", "sglang_version": "0.5.17"}}
    }


def test_tp_shapes_and_replicas_fold_into_one_document_and_the_summary(tmp_path):
    tp = tmp_path / "tp.json"
    tp.write_text(json.dumps(_tp_doc()))
    figs = scale_out.tp_figures(json.loads(tp.read_text()))
    assert list(figs) == ["qwen3-32b-tp4"]  # single-GPU shapes are not TP figures
    f = figs["qwen3-32b-tp4"]
    assert f["tp"] == 4 and f["sglang_version"] == "0.5.17"
    assert f["dspine_round_over_dflash"]["3"]["1"] == pytest.approx(10.3 / 10)
    assert f["vs_ar"]["dspine@3"]["1"] == pytest.approx(
        _tp_doc()["shapes"]["qwen3-32b-tp4"]["table"]["dspine@3"]["1"]["vs_ar"]
    )

    rep = tmp_path / "loop.json"
    rep.write_text(
        json.dumps(
            {
                "replicas": {
                    "replicas": 2,
                    "runs": {
                        "1": {"episodes": 8, "episodes_per_min": 4.0},
                        "2": {"episodes": 8, "episodes_per_min": 7.2},
                    },
                    "speedup": 1.8,
                    "efficiency": 0.9,
                }
            }
        )
    )
    out, summ = tmp_path / "so.json", tmp_path / "summary.json"
    out.write_text(
        json.dumps(
            {
                "finetune": {
                    "points": scale_out.scaling([_point(1, 100.0), _point(8, 720.0)]),
                    "per_gpu_batch": 16,
                    "steps": 60,
                    "device": "cuda",
                }
            }
        )
    )
    assert (
        scale_out.main(["combine", "--out", str(out), "--tp", str(tp), "--replicas", str(rep), "--summary", str(summ)])
        == 0
    )
    doc = json.loads(out.read_text())
    assert set(doc) >= {"finetune", "tp", "replicas", "git_sha"}  # the fine-tune measured earlier is kept
    sec = json.loads(summ.read_text())["scale_out"]
    assert sec["finetune_efficiency"]["8"] == pytest.approx(0.9)
    assert sec["tp_round_over_dflash"]["qwen3-32b-tp4"]["3"]["4"] == pytest.approx(12.3 / 12)
    assert sec["replicas"] == {"replicas": 2, "speedup": 1.8, "efficiency": 0.9}
    md = out.with_suffix(".md").read_text()
    assert "qwen3-32b-tp4" in md and "efficiency 0.9" in md and "| 8 | 128 |" in md

    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert scale_out.main(["combine", "--out", str(out), "--replicas", str(empty)]) == 2
    assert json.loads(out.read_text()) == doc  # nothing half-written
