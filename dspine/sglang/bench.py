"""`dspine bench --backend sglang`: AR, DFlash and DSpine served by SGLang (the dspine plugin for DSpine),
each measured in the same run with the same flags, at several concurrencies.

All servers (AR, then each drafter) are launched side by side — `sglang.launch_server` on 127.0.0.1 with the
target and the drafter's SGLang export — and, once all serve, measured one at a time: prefill time per prompt
(max_new_tokens=1, concurrency 1); then the prompt set at each concurrency through `/generate` (token ids in,
so every backend sees the same tokens).
- throughput: completion tokens / wall time, per concurrency;
- τ per request from SGLang's meta_info counts (`spec_num_correct_drafts`, `spec_verify_ct`) with dspine's one
  definition (stats.tau_of), per benchmark at concurrency 1; the concurrency-1 outputs are kept, so dspine's
  engine can replay them (`replay_agreement`: τ on the very same text);
- round cost at concurrency 1: (latency − prefill) / verify rounds, against the AR step (latency − prefill) /
  (tokens − 1) of the AR server;
- per concurrency, the round split into draft forward (drafter layers, injection and proposal: one CUDA graph),
  target verify and glue, the prefills' GPU time and the wall time outside both, from CUDA events inside SGLang
  (the plugin's timing hooks, DSPINE_SGLANG_TIMING; totals read after a one-token marker request);
- greedy outputs: the match rate of each server and concurrency with AR at concurrency 1, AR's own rate
  beside it (bf16 near-ties flip between batch shapes; SGLang's own variance is the yardstick).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dspine.config import ConfigError
from dspine.io import provenance, update_summary
from dspine.process import free_port, wait_http
from dspine.sglang.plugin.timing import split
from dspine.stats import tau_of
from dspine.target import chat_template_ids

# triton attention and torch sampling: FA3 and flashinfer's JIT are not on the H200 image (../shared/GPU.md; FA3 can be
# carried: bench/experiments/sglang_scale_gpu.sh fa3, and bench/experiments/sglang_scale.py --attention-backend fa3)
# decode CUDA graphs for batch 1, 2, 4, ..., 32 (6 captures instead of SGLang's 20); prefill graphs off (their
# capture costs ~2 min per start, GPU.md). The servers of one run start side by side on one GPU (a start is
# ~2 min of mostly CPU work, a run ~1 min), so the KV pool is capped by tokens (--max-total-tokens) instead of
# by a share of the memory, and --mem-fraction-static only keeps SGLang's slack small enough that the others'
# allocations do not fail the check; --sleep-on-idle keeps the waiting servers off the CPU (they wake on a
# request's arrival).
DEFAULT_FLAGS = (
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--disable-radix-cache",
    "--mem-fraction-static",
    "0.9",
    "--max-total-tokens",
    "131072",
    "--sleep-on-idle",
    "--cuda-graph-bs-decode",
    "1",
    "2",
    "4",
    "8",
    "16",
    "32",
    "--max-running-requests",
    "64",
    "--disable-prefill-cuda-graph",
)


def sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def ensure_export(path: str, out_dir: Path, name: str) -> tuple[str, int]:
    """A drafter folder -> (a folder SGLang loads, its block size): used as is when it validates as an SGLang
    export, else exported (bf16) under out_dir/exports/NAME."""
    from dspine.checkpoint import CheckpointError
    from dspine.sglang.export import export_sglang, validate_sglang_export

    block = int(json.loads((Path(path) / "config.json").read_text())["block_size"])
    try:
        validate_sglang_export(path)
        return str(path), block
    except CheckpointError:  # not an export (a dspine checkpoint, or a dflash one under dspine's architecture)
        return export_sglang(path, out_dir / "exports" / name)["path"], block


class SGLangServer:
    """One `sglang.launch_server` child on 127.0.0.1; its log goes to `log_path`. Construction launches it;
    `wait()` blocks until it serves (so several can start side by side)."""

    def __init__(
        self,
        target_path: str,
        draft: str | None,
        block_size: int,
        flags: list[str],
        dtype: str,
        log_path: Path,
        env: dict | None = None,
    ):
        self.port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            target_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            dtype,
            *flags,
        ]
        if draft:
            cmd += [
                "--speculative-algorithm",
                "DFLASH",
                "--speculative-draft-model-path",
                draft,
                "--speculative-num-draft-tokens",
                str(block_size),
            ]
        self.cmd, self.log_path = cmd, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "wb")
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
        self.base = f"http://127.0.0.1:{self.port}"
        self.startup_s: float | None = None

    def wait(self, timeout: float = 600) -> SGLangServer:
        if self.startup_s is not None:  # already serving
            return self
        try:
            wait_http(self.base + "/health_generate", self.proc, max(1.0, timeout - (time.time() - self.t0)))
        except RuntimeError as e:
            self.close()
            raise RuntimeError(f"SGLang did not start ({e}); see {self.log_path}") from None
        self.startup_s = time.time() - self.t0
        return self

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, ignore_eos: bool = False) -> dict:
        """ignore_eos: decode exactly max_new_tokens (random-weight targets for timing)."""
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
        t0 = time.perf_counter()
        doc = json.loads(self.post("/generate", {"input_ids": ids, "sampling_params": sampling}))
        doc["latency_s"] = time.perf_counter() - t0
        return doc

    def post(self, path: str, body: dict | None = None, timeout: float = 600) -> bytes:
        """POST a JSON body to one of the server's endpoints -> the raw reply."""
        req = urllib.request.Request(
            self.base + path, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def close(self):
        """Stop the server and the scheduler/detokenizer processes it spawned (its own process group)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(30)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


def _run_set(
    server: SGLangServer,
    prompts: list[list[int]],
    conc: int,
    max_new_tokens: int,
    temperature: float,
    ignore_eos: bool = False,
):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        docs = list(ex.map(lambda p: server.generate(p, max_new_tokens, temperature, ignore_eos), prompts))
    return docs, time.perf_counter() - t0


def _timing_mark(server: SGLangServer, prompt: list[int], path: Path) -> dict | None:
    """A one-token request (its prefill makes the plugin's timer fold in every finished round), then the
    timer's totals; None where the server writes no timing file (AR)."""
    server.generate(prompt, 1, 0.0)
    return json.loads(path.read_text())["totals"] if path.is_file() else None


def _match(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix.append(n / max(1, max(len(x), len(y))))
    return {"identical": same, "of": len(a), "mean_common_prefix": sum(prefix) / max(1, len(prefix))}


def _spec_figures(row: dict, docs: list[dict], wall: float, before: dict | None, after: dict | None):
    """τ of one set's requests into `row` and, with timing snapshots, the CUDA-event split of its rounds from
    inside SGLang (timing.py) -> (per-request τ, (accepted drafts, verify rounds) per request)."""
    counts = [(d["meta_info"].get("spec_num_correct_drafts", 0), d["meta_info"]["spec_verify_ct"]) for d in docs]
    taus = [tau_of(a, r) for a, r in counts]
    row["tau_mean"] = sum(taus) / len(taus)
    row["tau_pooled"] = tau_of(sum(a for a, _ in counts), sum(r for _, r in counts))
    if after is not None:
        t = split(after, before)
        row["phase_ms_per_round"] = {k: t[f"{k}_ms"] for k in ("draft", "verify", "glue")}
        row["timed_rounds"], row["gpu_round_ms"] = t["rounds"], t["round_ms"]
        # wall time outside the timed rounds and prefills: scheduling, HTTP, idle GPU
        row["outside_rounds_s"] = wall - (t["rounds_total_ms"] + t["extend_total_ms"]) / 1000
        row["prefill_ms_total"] = t["extend_total_ms"]
    return taus, counts


def c1_cost(docs: list[dict], prefill: list[float], counts: list | None) -> dict:
    """Requests decoded one at a time, their prefill times -> {"round_ms"} per verify round (drafters: `counts`
    of (accepted, rounds) per request) or {"ar_step_ms"} per decode step (AR: counts None)."""
    decode = [max(1e-9, d["latency_s"] - p) for d, p in zip(docs, prefill)]
    if counts is None:
        steps = sum(max(1, d["meta_info"]["completion_tokens"] - 1) for d in docs)
        return {"ar_step_ms": 1000 * sum(decode) / steps}
    return {"round_ms": 1000 * sum(decode) / sum(max(1, r) for _, r in counts)}


def _c1_figures(row, docs, prefill, counts, taus, bench_of, per_bench, name) -> None:
    """At concurrency 1: the round time (drafters) or the AR step, and τ per benchmark."""
    row.update(c1_cost(docs, prefill, counts))
    if counts is None:
        return
    per_bench[name] = {}
    for b in dict.fromkeys(bench_of):
        t = [x for x, bb in zip(taus, bench_of) if bb == b]
        per_bench[name][b] = sum(t) / len(t)


def sglang_bench(
    target_path: str,
    tokenizer,
    drafters: dict[str, str],
    items: list,
    concurrencies: list[int],
    max_new_tokens: int,
    out_dir: Path,
    dtype: str = "bfloat16",
    flags: list[str] | None = None,
    temperature: float = 0.0,
    progress: bool = True,
    parallel_start: bool = True,
    server_env: dict[str, dict[str, str]] | None = None,
) -> dict:
    """items: (benchmark, Item) pairs (first turns are sent); drafters {name: checkpoint or export}.
    parallel_start: launch every server first, then measure them one at a time (each closed after its run).
    server_env: {method: {variable: value}} set for that method's server only (kept in the document).
    The document keeps the prompt ids and every drafter's concurrency-1 outputs (for `replay_agreement`)."""
    from tqdm.auto import tqdm

    flags = list(DEFAULT_FLAGS if flags is None else flags)
    server_env = server_env or {}
    prompts = [chat_template_ids(tokenizer, [{"role": "user", "content": it.turns[0]}]) for _, it in items]
    bench_of = [b for b, _ in items]
    variants = {"ar": (None, 1), **{n: ensure_export(p, out_dir, n) for n, p in drafters.items()}}
    by_conc: dict[int, dict] = {c: {} for c in concurrencies}
    outputs: dict[str, dict[int, list[list[int]]]] = {}
    per_bench: dict[str, dict[str, float]] = {}
    servers = {}

    def launch(name: str) -> SGLangServer:
        draft, bsz = variants[name]
        timing = out_dir / "timing" / f"{name}.json"
        timing.unlink(missing_ok=True)
        env = {**({"DSPINE_SGLANG_TIMING": str(timing)} if draft else {}), **server_env.get(name, {})}
        return SGLangServer(target_path, draft, bsz, flags, dtype, out_dir / "logs" / f"{name}.log", env=env)

    started: dict[str, SGLangServer] = {}
    try:
        if parallel_start:  # all up before the first measurement: a starting server loads the GPU and CPUs
            for name in variants:
                started[name] = launch(name)
            for srv in started.values():
                srv.wait()
        bar = tqdm(total=len(variants) * (1 + len(concurrencies)), desc="sglang bench", disable=not progress)
        for name, (draft, _) in variants.items():
            if name not in started:
                started[name] = launch(name)
            srv = started[name].wait()
            timing = out_dir / "timing" / f"{name}.json"
            prefill = [d["latency_s"] for d in _run_set(srv, prompts, 1, 1, temperature)[0]]
            before = _timing_mark(srv, prompts[0], timing) if draft else None  # AR writes no timing file
            bar.update(1)
            outputs[name] = {}
            for c in concurrencies:
                docs, wall = _run_set(srv, prompts, c, max_new_tokens, temperature)
                toks = sum(d["meta_info"]["completion_tokens"] for d in docs)
                row = {"requests": len(docs), "tokens": toks, "seconds": wall, "tokens_per_s": toks / wall}
                outputs[name][c] = [list(d.get("output_ids", [])) for d in docs]
                if draft:
                    after = _timing_mark(srv, prompts[0], timing)
                    taus, counts = _spec_figures(row, docs, wall, before, after)
                    before = after
                if c == 1:
                    _c1_figures(
                        row,
                        docs,
                        prefill,
                        counts if draft else None,
                        taus if draft else None,
                        bench_of,
                        per_bench,
                        name,
                    )
                by_conc[c][name] = row
                bar.update(1)
            servers[name] = {"startup_s": srv.startup_s, "command": " ".join(srv.cmd), "env": server_env.get(name, {})}
            srv.close()
    finally:
        for srv in started.values():
            srv.close()
    bar.close()
    for c, rows in by_conc.items():
        for row in rows.values():
            row["speedup_vs_ar"] = row["tokens_per_s"] / rows["ar"]["tokens_per_s"]
            if c == 1 and "round_ms" in row:
                row["round_over_ar_step"] = row["round_ms"] / rows["ar"]["ar_step_ms"]
    ref = outputs["ar"][concurrencies[0]]
    match = {name: {str(c): _match(outs[c], ref) for c in concurrencies} for name, outs in outputs.items()}
    return {
        "backend": "sglang",
        "concurrency": 1,
        "rows": by_conc[1],
        "by_concurrency": {str(c): r for c, r in by_conc.items()},
        "tau_per_benchmark_c1": per_bench,
        "greedy_match_vs_ar_c1": match if temperature == 0 else None,
        "prompt_ids": prompts,
        "outputs_c1": {n: outs[concurrencies[0]] for n, outs in outputs.items() if n != "ar"},
        "servers": servers,
        "sglang_version": sglang_version(),
        "flags": flags,
        "dtype": dtype,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "prompts": len(prompts),
        "benchmarks": list(dict.fromkeys(bench_of)),
        "benchmark_of": bench_of,
        **provenance(),
    }


def replay_jobs(doc: dict, names: list[str]) -> list[tuple[str, list[int], list[int]]]:
    """(drafter, prompt ids, SGLang's concurrency-1 output) for each drafter in `names` and each request with
    at least one output token — what `eval.replay.replay` decodes with dspine's engine."""
    return [(n, p, o) for n in names for p, o in zip(doc["prompt_ids"], doc["outputs_c1"][n]) if o]


def replay_agreement(doc: dict, jobs: list, results: list[dict], engine_dtype: str) -> dict:
    """τ per benchmark at concurrency 1 from SGLang beside dspine's engine decoding the very same text
    (`eval.replay.replay` on SGLang's outputs): {drafter: {per_benchmark: {sglang, engine, ratio}, max_rel_diff}}.
    Same text, so the rounds face the same targets; what remains is the drafter's numerics in each engine."""
    bench_of = {}
    for b, p in zip(doc["benchmark_of"], doc["prompt_ids"]):
        bench_of.setdefault(tuple(p), b)
    per: dict = {}
    for (name, p, _), r in zip(jobs, results):
        per.setdefault(name, {}).setdefault(bench_of[tuple(p)], []).append(r["tau"])
    out = {}
    for name, by_b in per.items():
        rows = {b: {"sglang": doc["tau_per_benchmark_c1"][name][b], "engine": sum(t) / len(t)} for b, t in by_b.items()}
        for r in rows.values():
            r["ratio"] = r["sglang"] / r["engine"]
        out[name] = {
            "per_benchmark": rows,
            "max_rel_diff": max(abs(r["ratio"] - 1) for r in rows.values()),
            "engine_dtype": engine_dtype,
            "requests": sum(len(t) for t in by_b.values()),
            "method": "the engine replays SGLang's own concurrency-1 outputs (Engine.generate forced=)",
        }
    return out


def speed_section(doc: dict, kernels: dict | None, dspine: str = "dspine", dflash: str = "dflash") -> dict:
    """summary.json's `speed` section from an SGLang bench document (and the kernel bench for the injection
    and transition figures per round)."""
    bc = doc["by_concurrency"]
    ratios = [bc[c][dspine]["tokens_per_s"] / bc[c][dflash]["tokens_per_s"] for c in bc]
    out = {
        "dspine_vs_dflash_throughput_c1_32": sum(ratios) / len(ratios),
        "dspine_vs_dflash_throughput_by_c": {c: r for c, r in zip(bc, ratios)},
        "dspine_vs_ar_c1": doc["rows"][dspine]["speedup_vs_ar"],
        "round_over_ar_step_dspine": doc["rows"][dspine]["round_over_ar_step"],
        "round_over_ar_step_dflash": doc["rows"][dflash]["round_over_ar_step"],
        "tau_c1": {n: r.get("tau_mean", 1.0) for n, r in doc["rows"].items()},
    }
    if kernels:
        out["injection_ms_per_round"] = kernels.get("injection_ms_per_round")
        out["transition_ms_per_round"] = kernels.get("transition_ms_per_round")
    out.update({k: doc[k] for k in ("git_sha", "command", "sglang_version", "flags", "hardware")})
    return out


@dataclass
class SGLangBenchConfig:
    """What `dspine bench --backend sglang` asks for (the engine settings are for --engine-agreement)."""

    target: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    device: str = "cpu"
    limit: int = 4
    max_new_tokens: int = 128
    sglang_dtype: str = "bfloat16"
    flags: list[str] | None = None
    out: str | None = None
    summary: str | None = None
    engine_agreement: int = 0  # worker processes; 0: off
    agreement_drafters: list[str] = field(default_factory=lambda: ["dspine"])
    parallel_start: bool = True
    server_env: list[str] = field(default_factory=list)  # NAME:KEY=VALUE
    progress: bool = True


def parse_server_env(items: list[str], names: list[str]) -> dict[str, dict[str, str]]:
    """NAME:KEY=VALUE options -> {name: {key: value}}, each name one of `names`."""
    env: dict[str, dict[str, str]] = {}
    for item in items:
        name, sep, kv = item.partition(":")
        key, eq, value = kv.partition("=")
        if not (sep and eq and key.isidentifier()):
            raise ConfigError(f"--server-env {item!r} is not NAME:KEY=VALUE")
        if name not in names:
            raise ConfigError(f"--server-env {item!r}: {name!r} is not a measured method ({', '.join(names)})")
        env.setdefault(name, {})[key] = value
    return env


def _check(cfg: SGLangBenchConfig, specs: dict[str, str], conc: list[int]) -> dict[str, dict[str, str]]:
    """Every option checked before anything starts -> the per-server environment."""
    if 1 not in conc:
        raise ConfigError("--concurrency must include 1: τ per benchmark and the round cost are measured there")
    if cfg.summary and not {"dspine", "dflash"} <= set(specs):
        raise ConfigError(
            "--summary needs drafters named dspine and dflash (--drafter dspine=... --drafter dflash=...)"
        )
    agree = cfg.agreement_drafters if cfg.engine_agreement else []
    if set(agree) - set(specs):
        raise ConfigError(f"--agreement-drafters {sorted(set(agree) - set(specs))} are not among the --drafter names")
    env = parse_server_env(cfg.server_env, ["ar", *specs])
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError("--backend sglang needs SGLang: pip install 'dspine[sglang]' (on a CUDA machine)")
    return env


def run_sglang_bench(cfg: SGLangBenchConfig, benches: list[str], specs: dict[str, str], conc: list[int]) -> dict:
    """Start the servers, measure, optionally replay with dspine's engine and rewrite the summary -> the doc."""
    from transformers import AutoTokenizer

    from dspine.checkpoint import load_models
    from dspine.eval.replay import replay
    from dspine.target import resolve_target_path
    from dspine.workloads import load_benchmark

    server_env = _check(cfg, specs, conc)
    path = resolve_target_path(cfg.target)
    out_dir = Path(cfg.out).parent if cfg.out else Path(tempfile.mkdtemp(prefix="dspine-sglang-"))
    items = [(b, it) for b in benches for it in load_benchmark(b, cfg.limit)]
    doc = sglang_bench(
        str(path),
        AutoTokenizer.from_pretrained(path),
        specs,
        items,
        conc,
        cfg.max_new_tokens,
        out_dir,
        dtype=cfg.sglang_dtype,
        flags=cfg.flags,
        progress=cfg.progress,
        parallel_start=cfg.parallel_start,
        server_env=server_env,
    )
    if cfg.engine_agreement:
        sub = {n: specs[n] for n in cfg.agreement_drafters}
        # worker processes load their own models; only a single-process replay needs them here
        single = cfg.engine_agreement <= 1
        target, drafters = load_models(cfg.target, cfg.dtype, cfg.device, sub) if single else (None, {})
        jobs = replay_jobs(doc, list(sub))
        res = replay(
            target,
            drafters,
            jobs,
            progress=cfg.progress,
            workers=cfg.engine_agreement,
            target_spec=(cfg.target, cfg.dtype, cfg.device),
            drafter_paths=sub,
        )
        doc["engine_agreement"] = replay_agreement(doc, jobs, res, cfg.dtype)
    if cfg.summary:
        summary = Path(cfg.summary)
        kernels = json.loads(summary.read_text()).get("kernels") if summary.is_file() else None
        update_summary(summary, "speed", speed_section(doc, kernels))
    return doc
