"""GPU probe (one H200 call): regenerate data with the real target, train DFlash and DSpine drafters the
same way for a fixed wall budget each, report τ_sim and the engine's τ + AR equality on held-out prompts.

A measurement to size the training recipe, not the recipe: prints a table, writes JSON to $OUT.
    python bench/gpu_train_probe.py --target /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf --seconds 150
"""

import argparse
import json
import os
import platform
import subprocess
import time

import torch

from dspine.drafter import DSpineDraftModel
from dspine.engine import Engine
from dspine.sampling import SamplingParams
from dspine.target import load_target
from dspine.train import TrainConfig, evaluate_tau_sim, train_drafter
from workloads import load_prompts


def regen_batched(target, prompts, max_new, bs=128):
    tok = target.tokenizer
    tok.padding_side = "left"
    out = []
    for i in range(0, len(prompts), bs):
        ids = [target.chat_ids([{"role": "user", "content": p}]) for p in prompts[i:i + bs]]
        L = max(map(len, ids))
        x = torch.tensor([[tok.pad_token_id or 0] * (L - len(s)) + s for s in ids], device=target.device)
        am = (torch.arange(L, device=x.device)[None] >= torch.tensor([L - len(s) for s in ids], device=x.device)[:, None]).long()
        with torch.no_grad():
            g = target.model.generate(input_ids=x, attention_mask=am, max_new_tokens=max_new, do_sample=False)
        for s, row in zip(ids, g[:, L:].tolist()):
            resp = []
            for t in row:
                if t in target.eos_token_ids:
                    break
                resp.append(t)
            if resp:
                out.append((s + resp, len(s)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", type=int, default=480)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=150, help="training wall budget per method")
    ap.add_argument("--methods", default="dflash,dspine")
    a = ap.parse_args()
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    target = load_target(a.target, dtype=torch.float32, device="cuda")
    print(f"target loaded {time.time() - t0:.0f}s", flush=True)
    t0 = time.time()
    pairs = regen_batched(target, load_prompts("sharegpt", limit=a.prompts, max_chars=1500), a.max_new)
    print(f"regen {len(pairs)} samples {time.time() - t0:.0f}s", flush=True)
    pairs = [p for p in pairs if p[1] < 384]
    held, train = pairs[:24], pairs[24:]
    res = {"git_sha": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "gpu": torch.cuda.get_device_name(), "host": platform.node(), "methods": {}}
    for m in a.methods.split(","):
        d = DSpineDraftModel.for_target(target, method=m, seed=0).cuda()
        d.bind(target)
        cfg = TrainConfig(steps=100000, batch_size=8, anchors_per_seq=32, max_len=512, lr=6e-4, warmup_steps=50,
                          eval_every=10**9)
        # calibrate steps to the wall budget from a short timed run
        probe = TrainConfig(**{**cfg.__dict__, "steps": 5})
        t = time.time(); train_drafter(d, target, train, probe, progress=False); torch.cuda.synchronize()
        per = (time.time() - t) / 5
        d = DSpineDraftModel.for_target(target, method=m, seed=0).cuda(); d.bind(target)
        cfg.steps = max(20, int(a.seconds / per))
        t = time.time()
        hist = train_drafter(d, target, train, cfg, progress=False)
        secs = time.time() - t
        tau_sim = evaluate_tau_sim(d, target, held, cfg)
        ar, sp = Engine(target), Engine(target, d)
        taus, same = [], 0
        for ids, start in held[:12]:
            p = SamplingParams(max_tokens=96)
            r1, r2 = ar.generate(ids[:start], p), sp.generate(ids[:start], p)
            same += r1.token_ids == r2.token_ids
            taus.append(r2.stats.tau)
        res["methods"][m] = {"steps": cfg.steps, "sec_per_step": per, "train_seconds": secs,
                             "loss_first": hist[0]["loss"], "loss_last": hist[-1]["loss"],
                             "tau_sim_heldout": tau_sim, "engine_tau_mean": sum(taus) / len(taus),
                             "ar_equal": f"{same}/{len(taus)}",
                             "curve": [(h["step"], round(h["loss"], 3), round(h["tau_sim"], 3))
                                       for h in hist[:: max(1, len(hist) // 20)]]}
        print(m, json.dumps({k: v for k, v in res["methods"][m].items() if k != "curve"}), flush=True)
    print(f"{'method':<14}{'steps':>7}{'s/step':>8}{'tau_sim':>9}{'engine_tau':>11}{'AR-equal':>10}")
    for m, r in res["methods"].items():
        print(f"{m:<14}{r['steps']:>7}{r['sec_per_step']:>8.3f}{r['tau_sim_heldout']:>9.3f}"
              f"{r['engine_tau_mean']:>11.3f}{r['ar_equal']:>10}")
    json.dump(res, open(os.path.join(out_dir, "gpu_train_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
