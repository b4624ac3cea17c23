"""SGLang with the dspine plugin on the GPU (marker `gpu`; needs CUDA and SGLang, run on the device): the real
target served by SGLang (bf16 — SGLang's RMSNorm kernel has no fp32 path — decode CUDA graphs on), a DSpine
drafter through the plugin, AR beside it with the same flags.

Over a short horizon (16 tokens) bf16 greedy outputs are expected to equal AR's up to SGLang's own near-tie
flips: at least 5 of 6 prompts identical and 90% of tokens on the common prefix, at concurrency 1 and 4. The
drafter is untrained but its injection writes are non-zero, so the injection and the transition-cache walk run
on every round; the server log must show the proposal folded into the draft CUDA graph, and the plugin's timing
hooks must split the rounds into draft forward and target verify."""

import os

import pytest
import torch
from conftest import perturb_writes

from dspine.checkpoint import save_drafter
from dspine.drafter import DSpineDraftModel
from dspine.target import load_target, resolve_target_path
from dspine.workloads import load_benchmark

pytestmark = pytest.mark.gpu


def test_sglang_serves_dspine_through_the_plugin(tmp_path):
    from transformers import AutoTokenizer

    from dspine.sglang.bench import sglang_bench

    spec = os.environ.get("DSPINE_TARGET", "smollm2-135m-instruct")
    target = load_target(spec, dtype=torch.float32)
    ckpt = save_drafter(
        perturb_writes(DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2), std=0.05),
        tmp_path / "dspine",
    )
    path = resolve_target_path(spec)
    items = [(b, it) for b in ("gsm8k", "mt_bench") for it in load_benchmark(b, 3)]
    doc = sglang_bench(
        str(path),
        AutoTokenizer.from_pretrained(path),
        {"dspine": str(ckpt)},
        items,
        [1, 4],
        16,
        tmp_path,
        progress=False,
    )
    for c in ("1", "4"):
        m = doc["greedy_match_vs_ar_c1"]["dspine"][c]
        assert m["identical"] >= m["of"] - 1 and m["mean_common_prefix"] >= 0.9, (c, m)
    row = doc["rows"]["dspine"]
    assert 1.0 <= row["tau_mean"] <= 16 and row["round_ms"] > 0
    # the plugin's timing hooks split each round (CUDA events inside SGLang); the parts fit in the round
    split = row["phase_ms_per_round"]
    assert row["timed_rounds"] > 0 and split["draft"] > 0 and split["verify"] > 0, row
    assert split["draft"] + split["verify"] <= row["round_ms"] * 1.05, row
    log = (tmp_path / "logs" / "dspine.log").read_text()
    assert "model=DSpineDraftModel" in log and "transition-cache proposal folded into the draft CUDA graph" in log
