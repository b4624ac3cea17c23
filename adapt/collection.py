"""Collecting agent traces as a Ray job: plan, check, run episodes as Ray tasks, keep accounts.

The plan is deterministic: for each workload × thinking level, episode i runs task i mod T (tasks in an order
fixed by the seed) as repetition i div T, and its id is derived from workload, task, level and repetition
(agents.base.episode_id). So a re-run skips what is already written, a retried task overwrites its own shard,
and nothing is ever written twice. Episodes run as Ray tasks (`max_retries`, retried on worker death and on
errors), at most `concurrency` at a time; what still fails after its retries is written to failures/ with its
reason, and the accounts add up: ok + failed + skipped == requested.

Everything a user can get wrong is checked before Ray starts (`check`): unknown workloads or levels, a
non-positive episode count, an endpoint that does not answer, an output directory that cannot be written, an
output directory holding a collection of another configuration.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dspine.agents.base import LEVELS, AgentConfig, endpoint_info, episode_id, litellm_quiet
from dspine.agents.sandbox import JailLimits
from dspine.agents.traces import Store, shard
from dspine.io import md_table

WORKLOADS = ("swe", "tool", "office")
SOURCES = ("live", "replay")
# a different value of any of these makes a different collection (the endpoint may move)
IDENTITY = (
    "source",
    "workloads",
    "levels",
    "episodes",
    "seed",
    "model",
    "max_turns",
    "max_tokens",
    "max_episode_tokens",
    "temperature",
    "conversations_sha256",
    "max_context",
    "max_conversations",
)


class CollectError(ValueError):
    """Bad input, found before any work is submitted."""


@dataclass
class CollectConfig:
    endpoint: str
    out: str
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    levels: list[str] = field(default_factory=lambda: ["low", "high"])
    episodes: int = 1  # per workload × level
    model: str | None = None  # default: the endpoint's first model
    api_key: str = "none"
    concurrency: int = 4
    retries: int = 2
    seed: int = 0
    max_turns: int = 8
    max_tokens: int = 256
    max_episode_tokens: int = 4096
    wall_s: float = 600.0
    temperature: float = 0.0
    tool_wall_s: float = 30.0
    scratch: str = ""  # where episode directories live on each worker (default: the system temp dir)
    # "ray": episodes as Ray tasks (a local head, or the cluster of RAY_ADDRESS); "local": worker processes of
    # this machine without Ray (each episode tried 1 + retries times), where Ray is not installed
    executor: str = "ray"
    # replay: recorded conversations (files or folders; agents.replay formats) replayed turn by turn
    source: str = "live"
    conversations: list[str] = field(default_factory=list)
    format: str = "auto"
    tokenizer: str = ""  # the target whose rendering decides the cuts (default: the endpoint's `target`)
    max_context: int = 0  # the window a prefix + max_tokens must fit (default: the endpoint's max_model_len)
    skip_oversize: bool = False  # a turn that cannot fit even cut: skipped and counted (default: refused)
    max_conversations: int = 0  # replay: at most this many conversations per workload, one task after another
    conversations_sha256: str = ""  # filled in by check(): what the conversation files hold

    def identity(self) -> dict:
        return {k: getattr(self, k) for k in IDENTITY}

    def agent(self) -> AgentConfig:
        replay = self.source == "replay"
        return AgentConfig(
            endpoint=self.endpoint,
            model=self.model or "dspine",
            api_key=self.api_key,
            max_turns=10**6 if replay else self.max_turns,  # replay: the plan bounds the turns
            max_tokens=self.max_tokens,
            max_episode_tokens=10**9 if replay else self.max_episode_tokens,
            wall_s=self.wall_s,
            temperature=self.temperature,
            tool_limits=JailLimits(wall_s=self.tool_wall_s),
        )


def harness(name: str, cfg: CollectConfig | None = None):
    if cfg is not None and cfg.source == "replay":
        from dspine.agents.replay import ReplayHarness, read_all

        return ReplayHarness([c for c in read_all(cfg.conversations, cfg.format) if c.workload == name])
    if name == "swe":
        from dspine.agents.swe import SweHarness

        return SweHarness()
    if name == "tool":
        from dspine.agents.tau import TauHarness

        return TauHarness()
    if name == "office":
        from dspine.agents.office import OfficeHarness

        return OfficeHarness()
    raise CollectError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")


def plan(cfg: CollectConfig, turns: dict | None = None, convs: list | None = None) -> list[dict]:
    """Every episode, in rounds: episode i of each workload × level cell before episode i + 1 of any, so a
    collection stopped early (or still running) holds every cell in equal measure. Replay: one episode per
    conversation × level, carrying its planned turns (`turns`: {(conversation, level): [(turn, cut, tokens)]}, and
    `convs` the conversations, both from check_replay)."""
    if cfg.source == "replay":
        return [
            {
                "episode_id": episode_id(c.workload, c.id, level, 0),
                "workload": c.workload,
                "task_id": c.id,
                "family": c.task_id,
                "level": level,
                "rep": 0,
                "turns": turns[(c.id, level)],
            }
            for c in convs
            for level in cfg.levels
            if turns[(c.id, level)]
        ]
    tasks = {w: harness(w).tasks() for w in cfg.workloads}
    for w, ts in tasks.items():
        random.Random(f"{cfg.seed}/{w}").shuffle(ts)
    out = []
    for i in range(cfg.episodes):
        for w in cfg.workloads:
            t, rep = tasks[w][i % len(tasks[w])], i // len(tasks[w])
            for level in cfg.levels:
                out.append(
                    {
                        "episode_id": episode_id(w, t.id, level, rep),
                        "workload": w,
                        "task_id": t.id,
                        "level": level,
                        "rep": rep,
                    }
                )
    return out


def _replay_conversations(cfg: CollectConfig) -> list:
    """The conversations to replay: of the asked workloads; with max_conversations, that many per workload taken
    round-robin over its tasks (one conversation of each task before a second of any), in file order."""
    from dspine.agents.replay import read_all

    convs = [c for c in read_all(cfg.conversations, cfg.format) if not cfg.workloads or c.workload in cfg.workloads]
    if not cfg.max_conversations:
        return convs
    out = []
    for w in dict.fromkeys(c.workload for c in convs):
        by_task: dict[str, list] = {}
        for c in convs:
            if c.workload == w:
                by_task.setdefault(c.task_id, []).append(c)
        rounds = [cs[k] for k in range(max(map(len, by_task.values()))) for cs in by_task.values() if k < len(cs)]
        out += rounds[: cfg.max_conversations]
    return out


def check_replay(cfg: CollectConfig, info: dict) -> tuple[dict, dict, list]:
    """Reads the conversations and plans every turn's cut with the target's rendering -> ({(conversation, level):
    turns}, {"oversize": [...], "turns": n}, the conversations). Raises CollectError on bad input (an unreadable
    or unknown format, a conversation without assistant turns, a turn that cannot fit unless skip_oversize)."""
    import hashlib

    from dspine.agents.replay import Renderer, ReplayError, collect_files, plan_turns

    if not cfg.conversations:
        raise CollectError("--source replay needs --conversations (files or folders of recorded conversations)")
    try:
        convs = _replay_conversations(cfg)
    except ReplayError as e:
        raise CollectError(str(e)) from None
    if not convs:
        raise CollectError(f"no conversation of workload(s) {cfg.workloads} in {cfg.conversations}")
    h = hashlib.sha256()
    for f in collect_files(cfg.conversations):
        h.update(f.read_bytes())
    cfg.conversations_sha256 = h.hexdigest()
    cfg.tokenizer = cfg.tokenizer or str(info.get("target") or "")
    cfg.max_context = cfg.max_context or int(info.get("max_model_len") or 0)
    if not cfg.tokenizer or not cfg.max_context:
        raise CollectError("the endpoint does not say its target or window: give --tokenizer and --max-context")
    budget = cfg.max_context - cfg.max_tokens
    if budget < 1:
        raise CollectError(f"--max-tokens {cfg.max_tokens} leaves no room in a window of {cfg.max_context}")
    try:
        renderer = Renderer(cfg.tokenizer)
    except Exception as e:
        raise CollectError(f"cannot load the tokenizer of {cfg.tokenizer!r}: {e}") from None
    plans, oversize = {}, []
    from tqdm import tqdm

    for c in tqdm(convs, desc="planning turns", disable=len(convs) < 20):
        for level in cfg.levels:
            try:
                p = plan_turns(c, renderer, level, budget, cfg.max_turns)
            except Exception as e:  # a message the server would refuse, a template that rejects it
                raise CollectError(f"conversation {c.id}: cannot render it as the server would: {e}") from None
            plans[(c.id, level)] = [list(t) for t in p.turns]
            oversize += [f"{c.id} turn {i} ({level})" for i in p.oversize]
    if oversize and not cfg.skip_oversize:
        raise CollectError(
            f"{len(oversize)} turn(s) do not fit a window of {cfg.max_context} ({cfg.max_tokens} for the reply) even "
            f"with every earlier message cut, e.g. {oversize[:3]}; --skip-oversize skips them (counted)"
        )
    n = sum(map(len, plans.values()))
    if not n:
        raise CollectError("no turn to replay")
    return plans, {"oversize": oversize, "turns": n}, convs


def check(cfg: CollectConfig) -> dict:
    """Validates everything before work is submitted -> the endpoint's model info. Raises CollectError."""
    if cfg.source not in SOURCES:
        raise CollectError(f"source {cfg.source!r}: one of {', '.join(SOURCES)}")
    bad = [w for w in cfg.workloads if w not in WORKLOADS]
    if cfg.source == "live" and (bad or not cfg.workloads):
        raise CollectError(f"unknown workload(s) {bad or '(none given)'}; choose from {', '.join(WORKLOADS)}")
    if cfg.executor not in ("ray", "local"):
        raise CollectError(f"executor {cfg.executor!r}: ray or local")
    bad = [x for x in cfg.levels if x not in LEVELS]
    if bad or not cfg.levels:
        raise CollectError(f"unknown thinking level(s) {bad or '(none given)'}; choose from {', '.join(LEVELS)}")
    for name in ("episodes", "concurrency", "max_turns", "max_tokens"):
        if name == "max_turns" and cfg.source == "replay" and cfg.max_turns == 0:
            continue  # replay: 0 replays every turn
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 1:
            raise CollectError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)!r}")
    if cfg.max_conversations < 0:
        raise CollectError(f"--max-conversations must be 0 (all) or more, got {cfg.max_conversations}")
    if cfg.retries < 0:
        raise CollectError(f"--retries must be 0 or more, got {cfg.retries}")
    try:
        info = endpoint_info(cfg.endpoint, cfg.api_key)
    except ConnectionError as e:
        raise CollectError(str(e)) from None
    cfg.model = cfg.model or info.get("id")
    try:
        st = Store(cfg.out)
        st.write_bytes(b"ok", "_tmp", "probe")
        st.delete("_tmp", "probe")
    except Exception as e:
        raise CollectError(f"cannot write the output directory {cfg.out!r}: {e}") from None
    if cfg.source == "live":
        _check_identity(cfg)
    return info


def _check_identity(cfg: CollectConfig) -> None:
    """A collection directory holds one configuration: a re-run with another is refused (a key an older
    collection did not record counts as its default)."""
    st = Store(cfg.out)
    if not st.exists("config.json"):
        return
    defaults = {f.name: f.default for f in fields(CollectConfig) if f.name in IDENTITY}
    old = {**defaults, **st.read_json("config.json").get("identity", {})}
    diff = {k: (old.get(k), v) for k, v in cfg.identity().items() if old.get(k) != v}
    if diff:
        raise CollectError(
            f"{cfg.out!r} holds a collection of another configuration ({', '.join(f'{k}: {a!r} there, {b!r} now' for k, (a, b) in diff.items())}); "  # noqa: E501
            "use another --out"
        )


def run_episode(spec: dict, cfg_dict: dict, info: dict) -> dict:
    """One episode, on a Ray worker (or inline): runs it, writes its shard and summary -> the summary."""
    litellm_quiet()
    cfg = CollectConfig(**cfg_dict)
    h = harness(spec["workload"], cfg)
    task = next(t for t in h.tasks() if t.id == spec["task_id"])
    if "turns" in spec:
        task.data["turns"] = spec["turns"]
    scratch = Path(cfg.scratch or tempfile.gettempdir()) / "dspine-episodes" / spec["episode_id"]
    try:
        res = h.run(cfg.agent(), task, spec["level"], spec["episode_id"], scratch, info)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    st = Store(cfg.out)
    st.write_rows(res.rows, *shard(spec["workload"], spec["episode_id"]))
    summary = {**res.summary(), "rep": spec["rep"], "worker_pid": os.getpid()}
    st.write_json(summary, "episodes", f"{spec['episode_id']}.json")
    st.delete("failures", f"{spec['episode_id']}.json")
    return summary


def done(st: Store, spec: dict) -> bool:
    return st.exists("episodes", f"{spec['episode_id']}.json") and st.exists(
        *shard(spec["workload"], spec["episode_id"])
    )


def collect(cfg: CollectConfig, dry_run: bool = False, progress: bool = True) -> dict:
    info = check(cfg)
    extra: dict = {}
    if cfg.source == "replay":
        turns, extra, convs = check_replay(cfg, info)
        _check_identity(cfg)
        todo = plan(cfg, turns, convs)
    else:
        todo = plan(cfg)
    st = Store(cfg.out)
    pending = [s for s in todo if not done(st, s)]
    if dry_run:
        return {"requested": len(todo), "to_run": pending, "already_done": len(todo) - len(pending)}
    shown = {**asdict(cfg), "api_key": "***" if cfg.api_key not in ("", "none") else cfg.api_key}  # never on disk
    st.write_json({"identity": cfg.identity(), "config": shown, "endpoint_info": info}, "config.json")
    from tqdm import tqdm

    litellm_quiet()
    t0 = time.time()
    bar = tqdm(total=len(pending), desc="episodes", disable=not progress)
    failures = (_run_local if cfg.executor == "local" else _run_ray)(pending, cfg, info, bar.update)
    for s in pending:
        if s["episode_id"] in failures:
            st.write_json({**s, "reason": failures[s["episode_id"]]}, "failures", f"{s['episode_id']}.json")
    bar.close()
    acc = accounts(st, todo, skipped=len(todo) - len(pending), failed=failures, seconds=time.time() - t0)
    if extra:
        acc["replay"] = {"turns_planned": extra["turns"], "oversize_skipped": extra["oversize"]}
    st.write_json(acc, "accounts.json")
    st.clean_tmp()  # what killed workers left half-written
    return acc


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[-2000:]}"


def _run_ray(pending: list[dict], cfg: CollectConfig, info: dict, tick) -> dict[str, str]:
    """Episodes as Ray tasks, at most `concurrency` in flight -> {episode id: reason} of those out of retries."""
    import ray

    if not ray.is_initialized():
        ray.init(address="auto" if _cluster() else None, log_to_driver=False)
    task = ray.remote(num_cpus=0, max_retries=cfg.retries, retry_exceptions=True)(run_episode)
    cfg_dict = asdict(cfg)
    failures: dict[str, str] = {}
    inflight: dict = {}
    queue = list(pending)
    while queue or inflight:
        while queue and len(inflight) < cfg.concurrency:
            s = queue.pop(0)
            inflight[task.remote(s, cfg_dict, info)] = s
        ready, _ = ray.wait(list(inflight), num_returns=1)
        for ref in ready:
            s = inflight.pop(ref)
            try:
                ray.get(ref)
            except Exception as e:  # out of retries
                failures[s["episode_id"]] = _failure(e)
            tick(1)
    return failures


def _attempts(spec: dict, cfg_dict: dict, info: dict, retries: int) -> dict:
    """run_episode, tried again after an error up to `retries` times (the last error is raised)."""
    for _ in range(retries):
        try:
            return run_episode(spec, cfg_dict, info)
        except Exception:
            continue
    return run_episode(spec, cfg_dict, info)


def _run_local(pending: list[dict], cfg: CollectConfig, info: dict, tick) -> dict[str, str]:
    """Episodes in `concurrency` worker processes of this machine (spawned: tools run in subprocesses, which a
    threaded parent should not fork) -> {episode id: reason} of those that failed every attempt."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    cfg_dict, failures = asdict(cfg), {}
    with ProcessPoolExecutor(cfg.concurrency, mp_context=multiprocessing.get_context("spawn")) as ex:
        futures = {ex.submit(_attempts, s, cfg_dict, info, cfg.retries): s for s in pending}
        for f in as_completed(futures):
            try:
                f.result()
            except Exception as e:
                failures[futures[f]["episode_id"]] = _failure(e)
            tick(1)
    return failures


def _cluster() -> bool:
    return bool(os.environ.get("RAY_ADDRESS"))


def accounts(st: Store, todo: list[dict], skipped: int, failed: dict, seconds: float) -> dict:
    """ok + failed + skipped == requested, and the figures per workload × level."""
    summaries = {s["episode_id"]: st.read_json("episodes", f"{s['episode_id']}.json") for s in todo if done(st, s)}
    cells: dict = defaultdict(list)
    for s in todo:
        if s["episode_id"] in summaries and s["episode_id"] not in failed:
            cells[(s["workload"], s["level"])].append(summaries[s["episode_id"]])
    table = []
    for (w, level), eps in sorted(cells.items()):
        judged = [e["success"] for e in eps if e["success"] is not None]
        table.append(
            {
                "workload": w,
                "level": level,
                "episodes": len(eps),
                "success_rate": sum(judged) / len(judged) if judged else None,
                "mean_turns": sum(e["turns"] for e in eps) / len(eps),
                "mean_generated_tokens": sum(e["generated_tokens"] for e in eps) / len(eps),
                "terminations": dict(Counter(e["termination"] for e in eps)),
            }
        )
    ran = len(todo) - skipped - len(failed)
    return {
        "requested": len(todo),
        "ok": ran,
        "failed": len(failed),
        "skipped": skipped,
        "failures": failed,
        "seconds": seconds,
        "episodes_per_minute": ran / (seconds / 60) if seconds > 0 and ran else 0.0,
        "table": table,
    }


def accounts_markdown(acc: dict) -> str:
    rows = [
        [
            r["workload"],
            r["level"],
            r["episodes"],
            "n/a" if r["success_rate"] is None else f"{r['success_rate']:.2f}",
            f"{r['mean_turns']:.1f}",
            f"{r['mean_generated_tokens']:.0f}",
            ", ".join(f"{k} {v}" for k, v in r["terminations"].items()),
        ]
        for r in acc["table"]
    ]
    head = ["workload", "level", "episodes", "success", "turns", "gen tokens", "terminations"]
    return (
        md_table(head, rows) + f"\n\nrequested {acc['requested']} = ok {acc['ok']} + failed {acc['failed']} + "
        f"skipped {acc['skipped']}; {acc['episodes_per_minute']:.2f} episodes/min"
    )
