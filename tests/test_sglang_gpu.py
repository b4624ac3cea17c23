"""SGLang with the dspine plugin on the GPU (marker `gpu`; needs CUDA and SGLang, run on the device):
the real target served by SGLang with CUDA graphs, a DSpine drafter through the plugin.

fp32 over a short horizon, where equality with AR is expected: every greedy output of the DSpine server
equals the AR server's, at concurrency 1 and 4. The drafter is untrained but its injection writes are
non-zero, so the injection and the transition-cache walk run on every round."""

import os

import pytest
import torch

from conftest import perturb_writes
from dspine.checkpoint import save_drafter
from dspine.drafter import DSpineDraftModel
from dspine.target import load_target, resolve_target_path
from workloads import load_benchmark

pytestmark = pytest.mark.gpu


def test_sglang_serves_dspine_equal_to_ar_in_fp32(tmp_path):
    from transformers import AutoTokenizer

    from dspine.sglang_bench import sglang_bench

    spec = os.environ.get("DSPINE_TARGET", "smollm2-135m-instruct")
    target = load_target(spec, dtype=torch.float32)
    ckpt = save_drafter(perturb_writes(DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2),
                                       std=0.05), tmp_path / "dspine")
    path = resolve_target_path(spec)
    items = [(b, it) for b in ("gsm8k", "mt_bench") for it in load_benchmark(b, 3)]
    doc = sglang_bench(str(path), AutoTokenizer.from_pretrained(path), {"dspine": str(ckpt)}, items, [1, 4], 32,
                       tmp_path, dtype="float32", progress=False)
    for c in ("1", "4"):
        m = doc["greedy_match_vs_ar_c1"]["dspine"][c]
        assert m["identical"] == m["of"] == len(items), (c, m)
    row = doc["rows"]["dspine"]
    assert 1.0 <= row["tau_mean"] <= 16 and row["round_ms"] > 0
    assert "DSpineDraftModel" in (tmp_path / "logs" / "dspine.log").read_text()
