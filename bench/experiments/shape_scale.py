"""DSpine in SGLang at the size users serve: AR, DFlash and DSpine (the dspine plugin) on a target of a chosen
shape — Qwen3-8B, Qwen3-4B or a config file — at forced acceptance lengths (`bench/experiments/sglang_scale.py`).

No weights of that size exist offline and none are needed for timing:
- SGLang builds the target and both drafters from their configs with random weights (`--load-format dummy`
  reaches the draft model too); the folders written here hold configs and a real tokenizer only (the built-in's,
  49,152 rows; or Qwen3's with `--tokenizer`, 151,936 rows as the paper's targets have), so the prompts are real
  text;
- `SGLANG_SIMULATE_ACC_LEN=τ` makes every verify commit ⌊τ⌋ or ⌈τ⌉ tokens (SGLang's "match-expected": mean τ)
  after the full round ran: drafter forward with the injections, the proposal (DSpine: transition cache + walk
  folded into the draft CUDA graph; DFlash: argmax), the target's verify of the whole block. The round is
  therefore a real round of our code at that τ, whatever the weights;
- requests decode exactly `max_new_tokens` (`ignore_eos`), so every server does the same work.
Per server: prefill per prompt, then the prompt set at each concurrency (throughput), the round's CUDA-event
split from inside SGLang (draft / verify / glue, plugin timing), and at concurrency 1 the round in wall time
against the AR server's step; with `profile_requests`, each drafter's rounds at concurrency 1 under SGLang's own
torch profiler (`/start_profile`), its GPU kernels summed per round, DSpine's set against DFlash's at the same τ
(`kernel_diff`: where DSpine's extra draft time goes). The servers of a run start in groups side by side (a
start is mostly CPU work) and are measured one at a time. `project` combines the round costs with acceptance
lengths measured elsewhere (the real target's, the paper's) into throughput against AR and against DFlash.
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from dspine.checkpoint import config_to_json
from dspine.config import ConfigError
from dspine.drafter import DSpineConfig
from dspine.io import atomic_dir, atomic_write_text, md_table, provenance, update_summary

VOCAB = 49152  # the built-in tokenizer's
QWEN3_VOCAB = 151936  # the Qwen3 output head's rows (its tokenizer has 151,669 tokens)
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}
SHAPES = {
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "vocab_size": QWEN3_VOCAB,
    },
    "qwen3-4b": {
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "vocab_size": QWEN3_VOCAB,
    },
    # the 27B-32B class the paper's agent drafter serves; on one GPU only under tensor parallelism (--tp-size)
    "qwen3-32b": {
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "vocab_size": QWEN3_VOCAB,
    },
}
SHAPE_KEYS = tuple(k for k in SHAPES["qwen3-8b"] if k != "vocab_size")
# the paper's seven-benchmark mean acceptance length at T = 0 with Qwen3-8B (project page)
PAPER_TAU = {"dspine": 4.82, "dflash": 3.77}
# a smaller KV pool than bench.DEFAULT_FLAGS: 16 GB of weights per 8B server, several servers side by side
SCALE_FLAGS = ("--load-format", "dummy", "--max-total-tokens", "32768")
# triton runs from the carried wheels; fa3 (Hopper's default) needs sgl_kernel's flash_ops carried too
ATTENTION_BACKENDS = ("triton", "fa3", "flashinfer")


def shape_config(spec: str, rows: int | None = None) -> tuple[str, dict]:
    """'qwen3-8b' | 'qwen3-4b' | a CONFIG.json path (HF config with the SHAPE_KEYS) -> (name, target config).
    `rows`: the output head the tokenizer in use needs (`tokenizer_rows`); a config file's own vocab_size must
    agree with it. None: the shape's own (Qwen3's 151,936 for the named shapes)."""
    if spec in SHAPES:
        name, shape = spec, dict(SHAPES[spec])
    else:
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"--shape {spec!r} is neither one of {sorted(SHAPES)} nor a config file")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--shape {spec}: not a JSON config ({e})") from None
        missing = [k for k in SHAPE_KEYS if k not in raw]
        if missing:
            raise ConfigError(f"--shape {spec}: missing {missing}")
        own = int(raw.get("vocab_size", rows or VOCAB))
        if rows is not None and own != rows:
            raise ConfigError(f"--shape {spec}: vocab_size {own} — the prompts' tokenizer needs {rows} rows")
        name, shape = path.stem, {**{k: raw[k] for k in SHAPE_KEYS}, "vocab_size": own}
    if shape["num_attention_heads"] % shape["num_key_value_heads"]:
        raise ConfigError(f"shape {name}: num_attention_heads must be a multiple of num_key_value_heads")
    return name, {**QWEN3, **shape, "vocab_size": rows or shape["vocab_size"]}


def tokenizer_rows(tokenizer_dir: str | Path, spec: str) -> int:
    """The output-head rows a shape needs for the prompts of this tokenizer folder: the folder's own model
    vocab_size where it has a config.json (the built-in target: 49,152), else the shape's own when the tokenizer
    fits in it (the Qwen3 tokenizer in a Qwen3 shape: 151,936)."""
    from transformers import AutoTokenizer

    tok = Path(tokenizer_dir)
    if (tok / "config.json").is_file():
        return int(json.loads((tok / "config.json").read_text())["vocab_size"])
    own = shape_config(spec)[1]["vocab_size"]
    n = len(AutoTokenizer.from_pretrained(str(tok)))
    if n > own:
        raise ConfigError(f"{tok}: {n} tokens do not fit the shape's {own}-row output head")
    return own


def drafter_config(target: dict, method: str, layers: int = 5, block: int = 16, top_k: int = 8) -> DSpineConfig:
    """The drafter of the matching shape (the target's width, heads and MLP; `layers` layers)."""
    cfg = DSpineConfig(
        **{k: target[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads")},
        num_key_value_heads=target["num_key_value_heads"],
        head_dim=target["head_dim"],
        vocab_size=target["vocab_size"],
        num_target_layers=target["num_hidden_layers"],
        num_hidden_layers=layers,
        rope_theta=target["rope_theta"],
        max_position_embeddings=target["max_position_embeddings"],  # SGLang refuses a draft shorter than its target
        block_size=block,
        method=method,
        top_k=top_k,
    )
    cfg.validate()
    return cfg


def write_shape(out: str | Path, spec: str, tokenizer_dir: str | Path, layers=5, block=16, top_k=8) -> dict:
    """Folders SGLang serves with `--load-format dummy`: target (config + tokenizer) and one per drafter
    (config only) -> {"name", "target", "dflash", "dspine"} paths."""
    from dspine.sglang.export import ARCHS

    name, target = shape_config(spec, tokenizer_rows(tokenizer_dir, spec))
    tok = Path(tokenizer_dir)
    keep = ("tokenizer", "special_tokens", "vocab", "merges", "chat_template")
    tok_files = [p for p in tok.iterdir() if p.name.startswith(keep)]
    if not any(p.name == "tokenizer.json" for p in tok_files):
        raise ConfigError(f"{tok}: no tokenizer.json (the built-in target's tokenizer folder is expected)")
    tok_cfg = json.loads((tok / "config.json").read_text()) if (tok / "config.json").is_file() else {}
    target.update({k: tok_cfg[k] for k in ("bos_token_id", "eos_token_id") if k in tok_cfg})
    out = Path(out)

    def fill_target(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(target, indent=1))
        for p in tok_files:
            (tmp / p.name).write_bytes(p.read_bytes())

    paths = {"name": name, "target": str(atomic_dir(out / name / "target", fill_target))}
    for method in ("dflash", "dspine"):
        cfg = drafter_config(target, method, layers, block, top_k)
        doc = {**config_to_json(cfg), "architectures": [ARCHS[method]], "torch_dtype": "bfloat16"}
        paths[method] = str(
            atomic_dir(
                out / name / method, lambda tmp, d=doc: (tmp / "config.json").write_text(json.dumps(d, indent=1))
            )
        )
    return paths


# --- projection -------------------------------------------------------------------------------------------


def fit_round(points: dict[float, float]) -> tuple[float, float]:
    """Round time at concurrency 1 against the forced τ, {τ: ms} -> (a, b) of the least-squares line a + b·τ
    (one point: flat)."""
    xs, ys = list(points), list(points.values())
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def project(rounds_c1: dict[str, dict[float, float]], ar_step_ms: float, taus: dict[str, dict[str, float]]) -> dict:
    """rounds_c1 {method: {forced τ: round ms}}; taus {label: {method: τ}} (e.g. the real target's, the
    paper's) -> {label: {method: {tau, round_ms, vs_ar}, dspine_vs_dflash}}: a method's throughput at τ is
    τ tokens per round(τ), AR's one token per step."""
    fits = {m: fit_round(p) for m, p in rounds_c1.items()}
    out = {}
    for label, by_method in taus.items():
        row: dict = {}
        for m, tau in by_method.items():
            if m not in fits:
                continue
            a, b = fits[m]
            r = a + b * tau
            row[m] = {"tau": tau, "round_ms": r, "vs_ar": tau * ar_step_ms / r}
        if "dspine" in row and "dflash" in row:
            row["dspine_vs_dflash"] = row["dspine"]["vs_ar"] / row["dflash"]["vs_ar"]
        out[label] = row
    return out


# --- measurement ------------------------------------------------------------------------------------------


def variant_name(method: str, tau: float | None) -> str:
    return method if tau is None else f"{method}@{tau:g}"


def _requests(conc: int, minimum: int) -> int:
    return max(minimum, 2 * conc)  # two waves at each concurrency above the minimum


def measure_server(srv, prompts: list[list[int]], conc: list[int], max_new_tokens: int, timing, minimum=8) -> dict:
    """One serving SGLang server -> {str(c): row}; a drafter's rows carry τ and the CUDA-event round split,
    the concurrency-1 row the wall-clock round (drafters) or step (AR)."""
    from dspine.sglang.bench import _run_set, _spec_figures, _timing_mark, c1_cost

    spec = timing is not None
    first = prompts[:minimum]
    prefill = [d["latency_s"] for d in _run_set(srv, first, 1, 1, 0.0)[0]]
    before = _timing_mark(srv, prompts[0], timing) if spec else None
    rows = {}
    for c in conc:
        n = _requests(c, minimum)
        batch = [prompts[i % len(prompts)] for i in range(n)]
        docs, wall = _run_set(srv, batch, c, max_new_tokens, 0.0, ignore_eos=True)
        toks = sum(d["meta_info"]["completion_tokens"] for d in docs)
        row = {"requests": n, "tokens": toks, "seconds": wall, "tokens_per_s": toks / wall}
        counts = None
        if spec:
            after = _timing_mark(srv, prompts[0], timing)
            _, counts = _spec_figures(row, docs, wall, before, after)
            before = after
        if c == 1:
            row.update(c1_cost(docs, prefill, counts))
        rows[str(c)] = row
    return rows


def kernel_times(path: str | Path, cats: tuple[str, ...] = ("kernel",)) -> dict[str, dict]:
    """A Chrome trace file as torch.profiler exports it (SGLang's `/start_profile` writes `*.trace.json.gz`; .json
    or .json.gz) -> {name: {"us": summed duration, "n": events}} over its complete ("X") events of the categories
    `cats`, largest first."""
    path = Path(path)
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rt") as f:
        trace = json.load(f)
    out: dict[str, dict] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in cats:
            k = out.setdefault(ev["name"], {"us": 0.0, "n": 0})
            k["us"] += float(ev.get("dur", 0.0))
            k["n"] += 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def kernel_diff(a: dict, b: dict, top: int = 12) -> dict:
    """Two profiles {"rounds", "kernels": {name: {"us", "n"}}} -> per round: the `top` kernels by |a − b| (µs and
    launches per round in each) and the totals; names only one side ran count 0 on the other."""
    ra, rb = max(1, a["rounds"]), max(1, b["rounds"])
    ka, kb = a["kernels"], b["kernels"]
    rows = []
    for name in set(ka) | set(kb):
        x, y = ka.get(name, {"us": 0.0, "n": 0}), kb.get(name, {"us": 0.0, "n": 0})
        ua, ub = x["us"] / ra, y["us"] / rb
        rows.append(
            {"kernel": name, "a_us": ua, "b_us": ub, "diff_us": ua - ub, "a_n": x["n"] / ra, "b_n": y["n"] / rb}
        )
    rows.sort(key=lambda r: -abs(r["diff_us"]))
    total_a = sum(k["us"] for k in ka.values()) / ra
    total_b = sum(k["us"] for k in kb.values()) / rb
    return {"rows": rows[:top], "total_a_us": total_a, "total_b_us": total_b, "total_diff_us": total_a - total_b}


def _trace_in(folder: Path, wait_s: float) -> Path:
    """The trace SGLang's profiler writes into `folder` once it is complete (its size stops changing)."""
    deadline, last = time.time() + wait_s, None
    while time.time() < deadline:
        found = sorted(folder.rglob("*.trace.json*"))
        if found:
            size = sum(f.stat().st_size for f in found)
            if size == last:
                return found[-1]
            last = size
        time.sleep(2)
    raise TimeoutError(f"no complete profiler trace in {folder} after {wait_s:.0f} s")


def profile_rounds(srv, prompts, requests: int, max_new_tokens: int, folder: Path, timing: Path, keep: int = 200):
    """`requests` prompts decoded one at a time under SGLang's torch profiler (GPU activity) -> {"rounds", "kernels"
    (the `keep` largest by GPU time), "trace"}; rounds from the plugin's timer around the profiled requests."""
    from dspine.sglang.bench import _run_set, _timing_mark

    shutil.rmtree(folder, ignore_errors=True)  # a rerun's trace, never an earlier one
    folder.mkdir(parents=True)
    before = _timing_mark(srv, prompts[0], timing)
    srv.post("/start_profile", {"output_dir": str(folder), "activities": ["GPU"]})
    _run_set(srv, prompts[:requests], 1, max_new_tokens, 0.0, ignore_eos=True)
    srv.post("/stop_profile")
    after = _timing_mark(srv, prompts[0], timing)
    trace = _trace_in(folder, 300)
    kern = kernel_times(trace)
    return {
        "rounds": after["rounds"] - before["rounds"],
        "kernels": dict(list(kern.items())[:keep]),
        "trace": str(trace),
    }


@dataclass
class ScaleConfig:
    """What `bench/experiments/sglang_scale.py` asks for."""

    shape: str = "qwen3-8b"
    taus: list[float] = field(default_factory=lambda: [2.0, 3.0, 4.8])
    concurrencies: list[int] = field(default_factory=lambda: [1, 4, 16, 32])
    methods: list[str] = field(default_factory=lambda: ["ar", "dflash", "dspine"])
    max_new_tokens: int = 256
    benchmarks: list[str] = field(
        default_factory=lambda: ["gsm8k", "math500", "humaneval", "mbpp", "livecodebench", "mt_bench", "arena_hard"]
    )
    per_benchmark: int = 10
    max_prompt_tokens: int = 1024
    layers: int = 5
    block: int = 16
    top_k: int = 8
    group: int = 4  # servers started side by side
    tp: int = 1  # SGLang's --tp-size: every server on this many GPUs (then one server at a time)
    flags: list[str] | None = None
    attention_backend: str = "triton"  # SGLang's --attention-backend for target and drafters alike
    tokenizer: str | None = None  # a folder with tokenizer.json; default: the built-in target's
    work: str = "/tmp/dspine-scale"
    out: str | None = None
    summary: str | None = None
    section: str = "speed_scale"  # the summary's section this run rewrites (e.g. speed_scale_long)
    kernels: str | None = None  # bench/kernels.py JSON at this shape (injection, transition per round)
    measured_tau: dict[str, float] = field(default_factory=dict)  # {method: τ} on the real target
    profile_requests: int = 0  # per drafter server: requests decoded at c=1 under SGLang's profiler (0: none)
    profile_tokens: int = 128
    progress: bool = True

    def validate(self) -> None:
        shape_config(self.shape)
        if 1 not in self.concurrencies:
            raise ConfigError("concurrencies must include 1 (the round against the AR step is measured there)")
        if set(self.methods) - {"ar", "dflash", "dspine"} or "ar" not in self.methods:
            raise ConfigError(f"methods {self.methods}: a subset of ar, dflash, dspine that includes ar")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend {self.attention_backend!r}: one of {', '.join(ATTENTION_BACKENDS)}")
        if not self.section.startswith("speed_scale"):
            raise ConfigError(f"section {self.section!r}: the summary's SGLang-at-scale sections are speed_scale*")
        if self.profile_requests < 0 or self.profile_tokens < 1:
            raise ConfigError("profile_requests must be >= 0 and profile_tokens >= 1")
        if self.tp < 1 or (self.tp > 1 and self.group != 1):
            raise ConfigError(
                f"tp {self.tp} with group {self.group}: tp >= 1, and a tp > 1 server holds every GPU (group 1)"
            )
        bad = [t for t in self.taus if not 1 <= t <= self.block]
        if bad:
            raise ConfigError(f"forced τ {bad} outside [1, block {self.block}]")


def _with(flags: list[str], extra: tuple[str, ...]) -> list[str]:
    """`flags` with each option of `extra` (pairs: option, value) set to extra's value (replaced, not doubled)."""
    out = list(flags)
    for opt, val in zip(extra[::2], extra[1::2]):
        if opt in out:
            out[out.index(opt) + 1] = val
        else:
            out += [opt, val]
    return out


def _prompts(cfg: ScaleConfig, tokenizer) -> list[list[int]]:
    from dspine.target import chat_template_ids
    from dspine.workloads import load_benchmark

    out = []
    for b in cfg.benchmarks:
        for it in load_benchmark(b, cfg.per_benchmark):
            ids = chat_template_ids(tokenizer, [{"role": "user", "content": it.turns[0]}])
            if len(ids) <= cfg.max_prompt_tokens:
                out.append(ids)
    # interleave benchmarks so every request set mixes them
    return sorted(out, key=lambda p: hash(tuple(p)) % 9973)


def run_scale(cfg: ScaleConfig) -> dict:
    """Write the shape's folders, start the servers group by group, measure each, and write the document
    (after every server: a run cut short keeps what it measured; a rerun skips the variants already there)."""
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from dspine.sglang.bench import DEFAULT_FLAGS, SGLangServer, sglang_version

    cfg.validate()
    work = Path(cfg.work)
    tok_dir = cfg.tokenizer
    if tok_dir is None:
        from dspine.target import DEFAULT_TARGET, resolve_target_path

        tok_dir = str(resolve_target_path(DEFAULT_TARGET))
    paths = write_shape(work / "shapes", cfg.shape, tok_dir, cfg.layers, cfg.block, cfg.top_k)
    prompts = _prompts(cfg, AutoTokenizer.from_pretrained(paths["target"]))
    flags = _with(
        list(DEFAULT_FLAGS if cfg.flags is None else cfg.flags),
        (
            *SCALE_FLAGS,
            "--attention-backend",
            cfg.attention_backend,
            *(("--tp-size", str(cfg.tp)) if cfg.tp > 1 else ()),
        ),
    )
    # one document per shape and tensor-parallel size
    shape_key = paths["name"] + (f"-tp{cfg.tp}" if cfg.tp > 1 else "")
    out = Path(cfg.out) if cfg.out else work / "sglang_scale.json"
    whole = json.loads(out.read_text()) if out.is_file() else {"shapes": {}}
    settings = {
        "concurrencies": cfg.concurrencies,
        "max_new_tokens": cfg.max_new_tokens,
        "layers": cfg.layers,
        "block": cfg.block,
        "top_k": cfg.top_k,
        "flags": flags,
        "prompts": len(prompts),
        "vocab": json.loads((Path(paths["target"]) / "config.json").read_text())["vocab_size"],
    }
    doc = whole["shapes"].get(shape_key, {})
    if doc.get("settings") != settings:
        doc = {"settings": settings, "variants": {}}
    variants = [(m, None) for m in cfg.methods if m == "ar"]
    variants += [(m, t) for m in cfg.methods if m != "ar" for t in cfg.taus]
    todo = [v for v in variants if "by_concurrency" not in doc["variants"].get(variant_name(*v), {})]
    bar = tqdm(total=len(todo), desc=f"sglang {shape_key}", disable=not cfg.progress)

    def launch(method, tau):
        name = variant_name(method, tau)
        env, timing = {}, None
        if method != "ar":
            timing = work / "timing" / f"{shape_key}-{name}.json"
            timing.unlink(missing_ok=True)
            env = {"SGLANG_SIMULATE_ACC_LEN": str(tau), "DSPINE_SGLANG_TIMING": str(timing)}
        draft = None if method == "ar" else paths[method]
        log = work / "logs" / f"{shape_key}-{name}.log"
        return SGLangServer(paths["target"], draft, cfg.block, flags, "bfloat16", log, env=env), timing

    for i in range(0, len(todo), cfg.group):
        started = [(v, *launch(*v)) for v in todo[i : i + cfg.group]]
        try:
            for (method, tau), srv, timing in started:
                name = variant_name(method, tau)
                entry = {"method": method, "forced_tau": tau, "command": " ".join(srv.cmd)}
                try:
                    srv.wait()
                    entry["startup_s"] = srv.startup_s
                    entry["by_concurrency"] = measure_server(
                        srv, prompts, cfg.concurrencies, cfg.max_new_tokens, timing
                    )
                    if cfg.profile_requests and timing is not None:
                        folder = work / "profiles" / f"{shape_key}-{name}"
                        try:
                            entry["profile"] = profile_rounds(
                                srv, prompts, cfg.profile_requests, cfg.profile_tokens, folder, timing
                            )
                        except (RuntimeError, OSError, TimeoutError, ValueError) as e:  # the timings stand
                            entry["profile_error"] = f"{type(e).__name__}: {e}"
                except (RuntimeError, OSError, KeyError) as e:  # a failed server is recorded, the rest go on
                    entry["error"] = f"{type(e).__name__}: {e}"
                srv.close()
                doc["variants"][name] = entry
                doc.update(analyse(doc, cfg.measured_tau, _kernels(cfg.kernels)))
                whole["shapes"][shape_key] = {**doc, "sglang_version": sglang_version(), **provenance()}
                atomic_write_text(out, json.dumps(whole, indent=1))
                bar.update(1)
        finally:
            for _, srv, _ in started:
                srv.close()
    bar.close()
    md = out.with_suffix(".md")
    atomic_write_text(md, scale_markdown(whole))
    if cfg.summary:
        update_summary(cfg.summary, cfg.section, scale_section(whole))
    return whole


def _kernels(path: str | None) -> dict | None:
    """bench/kernels.py's JSON -> per-round injection and transition ms at batch 1, bf16, graph replay, for
    the path the plugin takes at that width (kernels.fused_width_ok)."""
    from dspine.kernels import fused_max_width

    if not path:
        return None
    rows = [r for r in json.loads(Path(path).read_text())["rows"] if r["dtype"] == "bfloat16" and r["batch"] == 1]
    if not rows:
        return None
    r = rows[0]
    if "injection_path" in r:  # kernel benches from the "gemm" layout on record the path taken
        inj, trans, how = (
            r["injection_path"],
            "transition_path",
            "fused walk" + (", fused scores" if r.get("hidden", 576) <= fused_max_width() else ", eager scores"),
        )
    else:
        fused = r.get("hidden", 576) <= fused_max_width()
        inj = min(("rows", "split"), key=lambda v: r[f"{v}_graph_ms"]) if fused else "eager"
        trans, how = ("transition_fused", "fused") if fused else ("transition_eager", "eager")
    return {
        "injection_ms": r[f"{inj}_graph_ms"],
        "injection_variant": inj,
        "transition_ms": r[f"{trans}_graph_ms"],
        "transition_variant": how,
        "fused_instead": {"injection_split": r["split_graph_ms"], "transition": r["transition_fused_graph_ms"]},
        "candidates_over_argmax_ms": r["head_topk_fused_graph_ms"] - r["head_argmax_graph_ms"],
        "hidden": r.get("hidden"),
    }


def analyse(doc: dict, measured_tau: dict[str, float], kernels: dict | None) -> dict:
    """The comparisons of one shape's measured variants: round ratios, speedups, the projection."""
    var = {n: v for n, v in doc["variants"].items() if "by_concurrency" in v}
    res: dict = {"kernels_at_shape": kernels}
    ar = var.get("ar")
    if ar is None:
        return res
    ar_by = ar["by_concurrency"]
    ar_step = ar_by["1"]["ar_step_ms"]
    taus = sorted({v["forced_tau"] for v in var.values() if v["forced_tau"] is not None})
    table = {}
    for n, v in var.items():
        if n == "ar":
            continue
        for c, row in v["by_concurrency"].items():
            r = {
                "tokens_per_s": row["tokens_per_s"],
                "vs_ar": row["tokens_per_s"] / ar_by[c]["tokens_per_s"],
                "tau": row.get("tau_pooled"),
                "gpu_round_ms": row.get("gpu_round_ms"),
                "phase_ms_per_round": row.get("phase_ms_per_round"),
            }
            if c == "1":
                r["round_ms"] = row["round_ms"]
                r["round_over_ar_step"] = row["round_ms"] / ar_step
            table.setdefault(n, {})[c] = r
    res["table"] = table
    methods = sorted({n.split("@")[0] for n in table})  # dflash, dspine, and labelled variants (dspine-fused)
    res["over_dflash"] = {m: _over(table, m, taus) for m in methods if m != "dflash"}
    res["dspine_over_dflash"] = res["over_dflash"].get("dspine", {})
    rounds = {
        m: {t: table[variant_name(m, t)]["1"]["round_ms"] for t in taus if variant_name(m, t) in table} for m in methods
    }
    rounds = {m: p for m, p in rounds.items() if p}
    res["ar_step_ms_c1"] = ar_step
    res["round_ms_c1"] = {m: {f"{t:g}": ms for t, ms in p.items()} for m, p in rounds.items()}
    labels = {"paper": PAPER_TAU, **({"measured": measured_tau} if measured_tau else {})}
    # a labelled variant is projected at its method's τ (dspine-fused at DSpine's)
    labels = {k: {m: v[m.split("-")[0]] for m in rounds if m.split("-")[0] in v} for k, v in labels.items()}
    res["projection"] = project(rounds, ar_step, labels) if rounds else {}
    prof = {n: v["profile"] for n, v in var.items() if v.get("profile", {}).get("rounds")}
    res["kernel_diff"] = {
        f"{t:g}": kernel_diff(prof[variant_name("dspine", t)], prof[variant_name("dflash", t)])
        for t in taus
        if variant_name("dspine", t) in prof and variant_name("dflash", t) in prof
    }
    return res


def _over(table: dict, method: str, taus: list[float]) -> dict:
    """{τ: {c: {gpu_round, throughput}}}: `method` over DFlash at the same forced τ and concurrency."""
    out: dict = {}
    for t in taus:
        a, b = table.get(variant_name(method, t)), table.get(variant_name("dflash", t))
        if not (a and b):
            continue
        out[f"{t:g}"] = {
            c: {
                "gpu_round": a[c]["gpu_round_ms"] / b[c]["gpu_round_ms"]
                if a[c]["gpu_round_ms"] and b[c]["gpu_round_ms"]
                else None,
                "throughput": a[c]["tokens_per_s"] / b[c]["tokens_per_s"],
            }
            for c in a
            if c in b
        }
    return out


def scale_section(whole: dict) -> dict:
    """summary.json's `speed_scale` section: the 8B shape's headline figures (others under `shapes`)."""

    def one(doc: dict) -> dict:
        ratio = doc.get("dspine_over_dflash", {})
        table = doc.get("table", {})
        k = doc.get("kernels_at_shape") or {}
        flags = doc.get("settings", {}).get("flags") or []
        at = lambda n, c, key: table.get(n, {}).get(c, {}).get(key)
        return {
            "dspine_round_over_dflash": {t: {c: r["gpu_round"] for c, r in by.items()} for t, by in ratio.items()},
            "dspine_throughput_over_dflash": {
                t: {c: r["throughput"] for c, r in by.items()} for t, by in ratio.items()
            },
            "round_over_ar_step_c1": {m: at(f"{m}@3", "1", "round_over_ar_step") for m in ("dspine", "dflash")},
            "injection_ms": k.get("injection_ms"),
            "transition_ms": k.get("transition_ms"),
            "dspine_vs_ar_c1_tau4_8": at("dspine@4.8", "1", "vs_ar") or at("dspine-fused@4.8", "1", "vs_ar"),
            "dspine_vs_ar_c1_tau4_8_variant": "dspine@4.8" if at("dspine@4.8", "1", "vs_ar") else "dspine-fused@4.8",
            "over_dflash_by_variant": doc.get("over_dflash"),
            "dflash_vs_ar_c1_tau4_8": at("dflash@4.8", "1", "vs_ar"),
            "projection": doc.get("projection"),
            "dspine_vs_dflash_projected": {
                lab: p.get("dspine_vs_dflash") for lab, p in (doc.get("projection") or {}).items()
            },
            "errors": {n: v["error"] for n, v in doc.get("variants", {}).items() if "error" in v},
            "vocab": doc.get("settings", {}).get("vocab", VOCAB),
            **{k: doc.get(k) for k in ("git_sha", "command", "hardware", "sglang_version")},
            "flags": flags,
            "attention_backend": flags[flags.index("--attention-backend") + 1]
            if "--attention-backend" in flags
            else None,
        }

    shapes = whole.get("shapes", {})
    main = "qwen3-8b" if "qwen3-8b" in shapes else next(iter(shapes), None)
    sec = {"shape": main, **(one(shapes[main]) if main else {})}
    sec["shapes"] = {n: one(d) for n, d in shapes.items() if n != main}
    return sec


def scale_markdown(whole: dict) -> str:
    parts = []
    for name, doc in whole.get("shapes", {}).items():
        table = doc.get("table", {})
        conc = doc["settings"]["concurrencies"]
        parts.append(
            f"## {name} (random weights, forced τ; AR step at c=1: {doc.get('ar_step_ms_c1', math.nan):.2f} ms)\n"
        )
        rows = []
        for n in sorted(table):
            t1 = table[n].get("1", {})
            ph = t1.get("phase_ms_per_round") or {}
            rows.append(
                [
                    n,
                    *(f"{table[n][str(c)]['vs_ar']:.2f}" if str(c) in table[n] else "-" for c in conc),
                    f"{t1.get('round_ms', math.nan):.2f}",
                    f"{t1.get('round_over_ar_step', math.nan):.2f}",
                    " / ".join(f"{ph.get(k, math.nan):.2f}" for k in ("draft", "verify", "glue")),
                ]
            )
        header = ["variant", *(f"× AR c={c}" for c in conc), "round ms c=1", "round / AR step", "draft/verify/glue ms"]
        parts.append(md_table(header, rows))
        over = doc.get("over_dflash") or {}
        if over:
            parts.append("\nOver DFlash at the same forced τ (GPU round time ratio; throughput ratio):\n")
            rows = [
                [
                    m,
                    t,
                    *(
                        f"{by[c]['gpu_round'] or math.nan:.3f}; {by[c]['throughput']:.3f}"
                        for c in map(str, conc)
                        if c in by
                    ),
                ]
                for m, per in over.items()
                for t, by in per.items()
            ]
            parts.append(md_table(["variant", "τ", *(f"c={c}" for c in conc)], rows))
        proj = doc.get("projection") or {}
        if proj:
            parts.append("\nProjection (c=1): τ tokens per round(τ), the round fitted over the forced τ:\n")
            rows = []
            for lab, p in proj.items():
                base = p.get("dflash", {}).get("vs_ar")
                for m, r in p.items():
                    if isinstance(r, dict):
                        rel = r["vs_ar"] / base if base else math.nan
                        rows.append(
                            [lab, m, f"{r['tau']:.2f}", f"{r['round_ms']:.2f}", f"{r['vs_ar']:.2f}", f"{rel:.3f}"]
                        )
            parts.append(md_table(["τ from", "variant", "τ", "round ms", "× AR", "/ DFlash"], rows))
        k = doc.get("kernels_at_shape")
        if k:
            parts.append(
                f"\nKernels at this width (bf16, c=1, graph replay): injection over all layers "
                f"{k['injection_ms']:.3f} ms ({k['injection_variant']}), transition cache + walk "
                f"{k['transition_ms']:.3f} ms ({k.get('transition_variant', 'fused')}).\n"
            )
        for t, kd in (doc.get("kernel_diff") or {}).items():
            parts.append(
                f"\nGPU kernels per round at c=1, τ={t} (SGLang's profiler): DSpine {kd['total_a_us']:.1f} µs, DFlash "
                f"{kd['total_b_us']:.1f} µs (+{kd['total_diff_us']:.1f}); the largest differences:\n"
            )
            rows = [
                [
                    r["kernel"][:90],
                    f"{r['a_us']:.1f} ({r['a_n']:.1f})",
                    f"{r['b_us']:.1f} ({r['b_n']:.1f})",
                    f"{r['diff_us']:+.1f}",
                ]
                for r in kd["rows"]
            ]
            parts.append(md_table(["kernel", "DSpine µs (launches)", "DFlash µs (launches)", "difference µs"], rows))
        errs = {n: v["error"] for n, v in doc.get("variants", {}).items() if "error" in v}
        for n, e in errs.items():
            parts.append(f"\n- {n} failed: {e}\n")
        parts.append(
            f"\n{doc.get('git_sha', '')} · {doc.get('hardware', '')} · SGLang {doc.get('sglang_version', '')}\n"
        )
    return "# SGLang at scale\n\n" + "\n".join(parts) + f"\n(written {time.strftime('%Y-%m-%d')})\n"
