"""What every harness shares: a task, an episode that drives an OpenAI-compatible endpoint through the LiteLLM
SDK, and the trace it leaves.

An episode is one task at one thinking level. Each model call goes out tagged with `metadata.workload` and
`reasoning_effort`, asks the server for the exact token ids (`return_token_ids`) and its acceptance
(`return_spec_tokens_details`; SGLang 0.5.17: per-choice `meta_info` with `return_meta_info`), and becomes one
`TraceRow`; the episode is bounded in turns, generated tokens and wall time (`EpisodeLimit` ends it with its
reason). Tools run in the episode's `Jail`; a tool that fails gives its error to the model as the tool's result.

Token ids: the request sets `return_token_ids`, which the embedded server answers with `prompt_token_ids` (top
level) and per-choice `token_ids` (vLLM's convention) and SGLang's OpenAI endpoints with per-choice
`prompt_token_ids` and `token_ids` (non-streaming); LiteLLM passes top-level extras through and per-choice ones as
`provider_specific_fields`, and both places are read. Through `dspine proxy` (whose per-choice extras LiteLLM's SDK
drops) they arrive at the top level: `prompt_token_ids`, `completion_token_ids`, `meta_info`. A backend that returns
no ids leaves the row's ids empty and `has_token_ids` False: training masks are made from ids only, never from
re-rendered text.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dspine.agents.sandbox import Jail, JailLimits
from dspine.serve.records import acceptance_from_response, reply_ids
from dspine.stats import AcceptanceStats

LEVELS = ("none", "low", "medium", "high", "xhigh")
REFUSED = ("BadRequestError", "ContextWindowExceededError")  # LiteLLM's exceptions for a 400 from the endpoint


@dataclass
class AgentConfig:
    endpoint: str = "http://127.0.0.1:8000/v1"
    model: str = "dspine"
    api_key: str = "none"
    max_turns: int = 8  # model calls per episode
    max_tokens: int = 256  # per call
    max_episode_tokens: int = 4096  # generated, per episode
    wall_s: float = 600.0  # per episode
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    tool_limits: JailLimits = field(default_factory=JailLimits)


@dataclass
class Task:
    id: str
    workload: str
    instruction: str
    data: dict = field(default_factory=dict)
    family: str = ""  # the task a replayed conversation works on (its rows' task_id); "": this task itself

    @property
    def task_id(self) -> str:
        return self.family or self.id


class EpisodeLimit(Exception):
    """The episode ran out of turns, tokens or time; the message is the termination reason."""


@dataclass
class TraceRow:
    """One generation event: a model call inside an episode."""

    episode_id: str
    task_id: str
    workload: str
    thinking: str
    turn: int
    request_id: str
    messages: str  # JSON: the request's messages
    tools: str  # JSON: the request's tools ([] when none)
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    has_token_ids: bool
    completion_text: str
    tool_calls: str  # JSON
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    accept_hist: list[int]  # verify rounds by drafts accepted; empty when the backend gave none (AR or unknown)
    tau: float | None
    sampling: str  # JSON: temperature, max_tokens, reasoning_effort
    target: str
    drafter: str | None
    chat_template_sha256: str | None
    latency_s: float
    ts: float
    # episode level, repeated on each of its rows (filled in when the episode ends)
    success: bool | None = None
    termination: str = ""
    source: str = "live"  # live: an agent harness's own call; replay: a turn of a recorded conversation
    reference: str | None = None  # replay: the recorded turn (JSON: content, tool_calls)
    cut: int = 0  # replay: messages cut from the left of the recorded prefix to fit the window


@dataclass
class EpisodeResult:
    episode_id: str
    task_id: str
    workload: str
    thinking: str
    success: bool | None
    termination: str
    turns: int
    generated_tokens: int
    seconds: float
    rows: list[TraceRow]
    tool_calls: int = 0
    tool_errors: int = 0
    jail_events: list[str] = field(default_factory=list)  # tool results that the jail refused or killed

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "rows"}


def endpoint_info(endpoint: str, api_key: str = "none", timeout: float = 10.0) -> dict:
    """The endpoint's /models entry: target, drafter, chat-template hash where the server tells them. Raises
    ConnectionError naming the endpoint when it does not answer."""
    import urllib.request

    req = urllib.request.Request(endpoint.rstrip("/") + "/models", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = json.loads(r.read())["data"]
    except Exception as e:
        raise ConnectionError(f"endpoint {endpoint} does not answer GET /models: {e}") from None
    return data[0] if data else {}


class Episode:
    """One task at one thinking level, driving the endpoint; `chat` is the only way it calls the model."""

    def __init__(self, cfg: AgentConfig, task: Task, level: str, episode_id: str, workdir: Path, info: dict):
        if level not in LEVELS:
            raise ValueError(f"unknown thinking level {level!r}; one of {LEVELS}")
        self.cfg, self.task, self.level, self.id = cfg, task, level, episode_id
        self.workdir = Path(workdir)
        self.jail = Jail(self.workdir, cfg.tool_limits)
        self.info = info
        self.rows: list[TraceRow] = []
        self.generated = 0
        self.tool_calls = self.tool_errors = 0
        self.jail_events: list[str] = []
        self.t0 = time.monotonic()

    # ---- the model ------------------------------------------------------------------------------------
    def check_limits(self) -> None:
        if len(self.rows) >= self.cfg.max_turns:
            raise EpisodeLimit("max_turns")
        if self.generated >= self.cfg.max_episode_tokens:
            raise EpisodeLimit("max_episode_tokens")
        if time.monotonic() - self.t0 >= self.cfg.wall_s:
            raise EpisodeLimit("wall_time")

    def chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        turn: int | None = None,
        reference: str | None = None,
        cut: int = 0,
        source: str = "live",
    ):
        """One model call -> the LiteLLM ModelResponse; records its TraceRow (`turn`: its index in the episode,
        by default the call's number; `reference`, `cut`, `source`: a replayed turn's)."""
        import litellm

        self.check_limits()
        left = self.cfg.wall_s - (time.monotonic() - self.t0)
        max_tokens = min(self.cfg.max_tokens, self.cfg.max_episode_tokens - self.generated)
        t0 = time.time()
        resp = litellm.completion(
            model=f"openai/{self.cfg.model}",
            api_base=self.cfg.endpoint,
            api_key=self.cfg.api_key,
            messages=messages,
            tools=tools or None,
            max_tokens=max_tokens,
            temperature=self.cfg.temperature,
            reasoning_effort=self.level,
            timeout=max(1.0, min(self.cfg.request_timeout_s, left)),
            num_retries=0,
            extra_body={
                "metadata": {"workload": self.task.workload, "episode_id": self.id, "task_id": self.task.task_id},
                "return_token_ids": True,
                "return_spec_tokens_details": True,
                "return_meta_info": True,  # SGLang 0.5.17 reports acceptance per choice in meta_info only
            },
        )
        latency = time.time() - t0
        choice = resp.choices[0]
        msg = choice.message
        prompt_ids = reply_ids(resp, "prompt_token_ids") or []
        out_ids = reply_ids(resp, "token_ids") or []
        st = AcceptanceStats.from_sglang_meta(acceptance_from_response(resp))
        hist = list(st.accept_hist) if st else []
        calls = [c.model_dump() if hasattr(c, "model_dump") else dict(c) for c in (msg.tool_calls or [])]
        usage = resp.usage
        row = TraceRow(
            episode_id=self.id,
            task_id=self.task.task_id,
            workload=self.task.workload,
            thinking=self.level,
            turn=len(self.rows) if turn is None else turn,
            request_id=resp.id,
            messages=json.dumps(messages),
            tools=json.dumps(tools or []),
            prompt_token_ids=prompt_ids,
            completion_token_ids=out_ids,
            has_token_ids=bool(prompt_ids) and bool(out_ids),
            completion_text=msg.content or "",
            tool_calls=json.dumps(calls),
            finish_reason=choice.finish_reason or "",
            prompt_tokens=usage.prompt_tokens if usage else len(prompt_ids),
            completion_tokens=usage.completion_tokens if usage else len(out_ids),
            accept_hist=hist,
            tau=st.tau if st else None,
            sampling=json.dumps(
                {"temperature": self.cfg.temperature, "max_tokens": max_tokens, "reasoning_effort": self.level}
            ),
            target=str(self.info.get("target") or self.info.get("id") or self.cfg.model),
            drafter=self.info.get("drafter"),
            chat_template_sha256=self.info.get("chat_template_sha256"),
            latency_s=latency,
            ts=t0,
            source=source,
            reference=reference,
            cut=cut,
        )
        self.rows.append(row)
        self.generated += row.completion_tokens
        return resp

    # ---- tools ----------------------------------------------------------------------------------------
    def tool_result(self, name: str, result: str, ok: bool) -> str:
        """Counts a tool call; jail refusals and kills are noted for the trace."""
        self.tool_calls += 1
        self.tool_errors += not ok
        if any(s in result for s in ("Permission denied", "killed:", "Resource temporarily unavailable")):
            self.jail_events.append(f"{name}: {result.strip().splitlines()[-1][:200]}")
        return result

    def result(self, success: bool | None, termination: str) -> EpisodeResult:
        for r in self.rows:
            r.success, r.termination = success, termination
        return EpisodeResult(
            episode_id=self.id,
            task_id=self.task.task_id,
            workload=self.task.workload,
            thinking=self.level,
            success=success,
            termination=termination,
            turns=len(self.rows),
            generated_tokens=self.generated,
            seconds=time.monotonic() - self.t0,
            rows=self.rows,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            jail_events=self.jail_events,
        )


class Harness:
    """A workload: its tasks, and how one episode of a task runs. Subclasses set `name` and implement
    `tasks()`, `setup(episode)` (lay out the episode directory) and `play(episode)` -> (success, termination);
    `play` may let EpisodeLimit escape, which ends the episode with that reason and success from `score`."""

    name = ""

    def tasks(self) -> list[Task]:
        raise NotImplementedError

    def skipped(self) -> dict[str, str]:
        """Tasks of the source data this harness cannot run here -> why."""
        return {}

    def setup(self, ep: Episode) -> None:
        pass

    def play(self, ep: Episode) -> tuple[bool | None, str]:
        raise NotImplementedError

    def score(self, ep: Episode) -> bool | None:
        return None

    def run(
        self, cfg: AgentConfig, task: Task, level: str, episode_id: str, workdir: Path, info: dict | None = None
    ) -> EpisodeResult:
        workdir = Path(workdir)
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        ep = Episode(cfg, task, level, episode_id, workdir, info if info is not None else {})
        self.setup(ep)
        try:
            success, why = self.play(ep)
        except EpisodeLimit as e:
            success, why = self.score(ep), str(e)
        except Exception as e:  # the endpoint refused a call (a full context, ...): the episode ends there
            if type(e).__name__ not in REFUSED:
                raise  # anything else (the endpoint down, ...) fails the episode, and Ray retries it
            success, why = self.score(ep), f"model_error: {type(e).__name__}"
        return ep.result(success, why)


def episode_id(workload: str, task_id: str, level: str, rep: int) -> str:
    """Deterministic: a re-run of the same task × level × repetition has the same id (and the same shard)."""
    key = f"{workload}/{task_id}/{level}/{rep}"
    return f"{workload}-{hashlib.sha1(key.encode()).hexdigest()[:12]}-{level}-{rep}"


def litellm_quiet() -> None:
    """No network for LiteLLM's cost map and no telemetry; called before the first model call."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("LITELLM_TELEMETRY", "False")
    os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")


def payload(obj: Any) -> str:
    """A tool's return value as the text the model reads."""
    return obj if isinstance(obj, str) else json.dumps(obj, default=str)


def python_tool(ep: Episode, spec: str, args: dict, label: str | None = None, count: bool = True) -> str:
    """Run `module:function(**args)` inside the episode's jail -> the text the model reads (errors included).
    `count`: an agent's tool call (counted in the episode's figures), not the harness's own check."""
    import sys

    from dspine.agents.toolrun import parse

    r = ep.jail.run(
        [sys.executable, "-c", "from dspine.agents.toolrun import main; main()", spec], stdin=json.dumps(args)
    )
    ok, text = parse(r.output, r.returncode)
    return ep.tool_result(label or spec, text, ok and r.ok) if count else text


def call_tool(ep: Episode, name: str, arguments: str, route, raw: bool = False) -> str:
    """One tool call of the model, jailed -> the text it reads; a bad call is the tool's error, never the
    episode's. `route(args)` -> ("module:function", kwargs), or None for a tool the harness does not have.
    `raw`: pass the decoded arguments on as they are (a router that checks them itself); else a non-object is {}."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as e:
        return ep.tool_result(name, f"Error: the arguments are not JSON: {e}", False)
    target = route(args if raw or isinstance(args, dict) else {})
    if target is None:
        return ep.tool_result(name, f"Error: unknown tool {name!r}", False)
    return python_tool(ep, target[0], target[1], name)
