"""Replaying real agent conversations through the target: every assistant turn of another model's conversation is
asked of the endpoint with its exact preceding messages (tools, tool calls and tool results included), and the
target's own reply becomes a trace row.

Design choices:
- **Formats** (`read_conversations`, chosen per file by `fmt` or found from its shape): OpenAI `messages` (+ `tools`)
  records as SWE-Gym/OpenHands and SWE-smith publish them (a JSON list or JSON lines); tau-bench's `traj`
  records; SWE-agent `.traj` files (`history`); nebius SWE-agent records (`trajectory`, roles system/user/ai); and the
  generic JSON lines `{"messages", "tools", "workload", "task_id", "id"}` that users export from their own logs.
  `.gz` files are read as they are. Every message is normalised to the OpenAI chat shape (text parts joined, tool
  calls' arguments as JSON text, a tool result's call id kept).
- **A conversation belongs to a task** (`task_id`): the tau-bench task, the SWE instance without its trajectory
  suffix, the user's own field. Splits are made by task, so repeated trials of one task stay on one side.
- **Tool schemas a source lacks** come from the project's own definitions: tau-bench airline conversations get
  the airline tools of `agents.tau_tools`.
- **The prefix is what the endpoint renders**, checked here before anything runs with the target's own tokenizer
  and the server's own rendering (`dspine.serve.openai.chat_prompt_ids`): a prefix longer than the window (less
  the turn's `max_tokens`) is cut from the left at a message boundary — the system message kept, never starting
  on a tool result — and the number of messages cut is recorded with the row. A turn that does not fit even
  with every earlier message but the system one and its own last message cut is reported (`Plan.oversize`).
- **The episode is one conversation at one level**; its rows are its assistant turns (`turn` = the turn's message
  index, so ids are conversation × turn × level), each with the original reply as `reference`.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from dspine.agents.base import Harness, Task

FORMATS = ("auto", "openai", "tau", "swe_agent", "nebius", "generic")
WORKLOAD_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "ai": "assistant", "tool": "tool"}


class ReplayError(ValueError):
    """Conversations that cannot be replayed (unknown format, no assistant turn, a prefix that cannot fit)."""


@dataclass
class Conversation:
    id: str  # unique: the file's stem and the record's own id or index
    task_id: str  # the task it works on (several conversations may share one)
    workload: str  # tool_replay, swe_replay, or the generic record's own
    source: str  # the format it came from
    messages: list[dict]
    tools: list[dict] = field(default_factory=list)

    def assistant_turns(self) -> list[int]:
        """Indices of the assistant messages that have a user message before them (the turns to replay)."""
        out, seen_user = [], False
        for i, m in enumerate(self.messages):
            if m["role"] == "user":
                seen_user = True
            elif m["role"] == "assistant" and seen_user:
                out.append(i)
        return out


# ---- reading ------------------------------------------------------------------------------------------------


def _text(content) -> str:
    """A message's content as text: parts of a list joined, None as ''."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _calls(raw) -> list[dict]:
    if not raw:
        return []
    if isinstance(raw, str):
        raw = json.loads(raw)
    out = []
    for k, c in enumerate(raw):
        fn = c.get("function") or c
        args = fn.get("arguments", "{}")
        out.append(
            {
                "id": c.get("id") or f"call_{k}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    return out


def normalise(m: dict, where: str) -> dict | None:
    """One source message -> an OpenAI chat message (None for a role that is not part of the chat)."""
    role = ROLES.get(str(m.get("role", "")).lower())
    if role is None:
        return None
    text = _text(m.get("content") if "content" in m else m.get("text"))
    if role == "system" and not text and m.get("system_prompt"):
        text = _text(m["system_prompt"])
    out: dict = {"role": role, "content": text}
    if role == "assistant":
        try:
            calls = _calls(m.get("tool_calls"))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ReplayError(f"{where}: unreadable tool_calls ({e})") from None
        if calls:
            out["tool_calls"] = calls
    if role == "tool":
        ids = m.get("tool_call_ids")
        out["tool_call_id"] = m.get("tool_call_id") or (ids[0] if isinstance(ids, list) and ids else "call_0")
    return out


def _load(path: Path):
    """A JSON document or JSON lines (.gz read through)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ReplayError(f"{path}: neither JSON nor JSON lines ({e})") from None


def detect(doc, path: Path) -> str:
    """The format of a loaded file, from its shape."""
    first = doc[0] if isinstance(doc, list) and doc else doc
    if not isinstance(first, dict):
        raise ReplayError(f"{path}: not a conversation file (expected JSON objects)")
    if "history" in first:
        return "swe_agent"
    if "traj" in first:
        return "tau"
    if "trajectory" in first:
        return "nebius"
    if "messages" in first:
        return "generic" if "workload" in first else "openai"
    raise ReplayError(
        f"{path}: unknown conversation format (keys {sorted(first)[:8]}); "
        f"give --format, one of {', '.join(FORMATS[1:])}"
    )


def _swe_task(instance: str) -> str:
    """SWE-bench-style instance ids (owner__repo-NUMBER) carry a trajectory suffix in some sources
    (python__mypy-15976_0): the task drops it (SWE-smith's ids, such as getmoto__moto.694ce1f4.pr_6055, keep theirs)."""
    return re.sub(r"(-\d+)_\d+$", r"\1", instance)


def read_conversations(path: str | Path, fmt: str = "auto") -> list[Conversation]:
    """Every conversation of one file. Raises ReplayError naming the file (and record) on bad input."""
    path = Path(path)
    if fmt not in FORMATS:
        raise ReplayError(f"unknown conversation format {fmt!r}; one of {', '.join(FORMATS)}")
    if not path.is_file():
        raise ReplayError(f"{path}: no such file")
    doc = _load(path)
    fmt = detect(doc, path) if fmt == "auto" else fmt
    records = doc if isinstance(doc, list) else [doc]
    stem = path.name.split(".")[0]
    out = []
    for k, r in enumerate(records):
        where = f"{path}: record {k}"
        if not isinstance(r, dict):
            raise ReplayError(f"{where}: not a JSON object")
        try:
            if fmt == "tau":
                from dspine.agents.tau_tools import DOMAINS, schema

                raw, tools = r["traj"], [schema(f) for f in DOMAINS["airline"].values()]
                task, workload = f"airline-{r['task_id']}", "tool_replay"
                cid = f"{stem}-{r['task_id']}-{r.get('trial', k)}"
            elif fmt == "swe_agent":
                raw, tools, workload = r["history"], [], "swe_replay"
                name = path.name.removesuffix(".gz").removesuffix(".traj")  # <instance>[.<config>].traj
                task, cid = str(r.get("instance_id") or name.split(".")[0]), f"{name}-{k}"
            elif fmt == "nebius":
                raw, tools, workload = r["trajectory"], [], "swe_replay"
                task, cid = _swe_task(str(r["instance_id"])), f"{stem}-{r['instance_id']}-{k}"
            elif fmt == "openai":
                raw, tools, workload = r["messages"], list(r.get("tools") or []), "swe_replay"
                inst = str(r.get("instance_id") or r.get("id") or k)
                task, cid = _swe_task(inst), f"{stem}-{r.get('id') or r.get('run_id') or inst}-{k}"
            else:  # generic
                raw, tools, workload = r["messages"], list(r.get("tools") or []), str(r["workload"])
                task, cid = str(r["task_id"]), str(r.get("id") or f"{stem}-{k}")
        except (KeyError, TypeError) as e:
            raise ReplayError(f"{where}: missing field {e} for format {fmt!r}") from None
        if not WORKLOAD_RE.fullmatch(workload):
            raise ReplayError(f"{where}: workload {workload!r} must match {WORKLOAD_RE.pattern}")
        if not isinstance(raw, list):
            raise ReplayError(f"{where}: the messages are not a list")
        msgs = [m for j, x in enumerate(raw) if (m := normalise(x, f"{where}, message {j}")) is not None]
        conv = Conversation(cid, task, workload, fmt, msgs, tools)
        if not conv.assistant_turns():
            raise ReplayError(f"{where} ({cid}): no assistant turn after a user message — nothing to replay")
        out.append(conv)
    return out


def collect_files(paths: list[str]) -> list[Path]:
    """Files given, folders expanded (their .json, .jsonl, .traj files, .gz included), in a fixed order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and re.search(r"\.(json|jsonl|traj)(\.gz)?$", f.name))
        else:
            out.append(p)
    return out


def read_all(paths: list[str], fmt: str = "auto") -> list[Conversation]:
    files = collect_files(paths)
    if not files:
        raise ReplayError(f"no conversation files in {paths}")
    convs = [c for f in files for c in read_conversations(f, fmt)]
    ids = [c.id for c in convs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ReplayError(f"conversation ids repeat across the files: {dup[:5]}")
    return convs


def shipped() -> Path:
    """The conversations shipped with dspine (workloads/data/agent_trajectories)."""
    from dspine import workloads

    return Path(workloads.__file__).resolve().parent / "data" / "agent_trajectories"


# ---- rendering and cutting ------------------------------------------------------------------------------------


class Renderer:
    """The target's rendering of a chat request, as `dspine serve` does it (tokenizer only, no weights)."""

    def __init__(self, target: str):
        from transformers import AutoTokenizer

        from dspine.target import resolve_target_path

        path = resolve_target_path(target)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
        self.name = target

    def ids(self, messages: list[dict], tools: list[dict], level: str) -> list[int]:
        from dspine.serve.openai import chat_prompt_ids
        from dspine.serve.protocol import parse_request

        body = {"messages": messages, **({"tools": tools} if tools else {})}
        return chat_prompt_ids(self.tokenizer, self.model_type, parse_request(body, True), level)


def prefix(conv: Conversation, turn: int, cut: int) -> list[dict]:
    """The messages before `turn` with `cut` of them dropped from the left (the system message kept)."""
    msgs = conv.messages[:turn]
    head = 1 if msgs and msgs[0]["role"] == "system" else 0
    return msgs[:head] + msgs[head + cut :]


@dataclass
class Plan:
    turns: list[tuple[int, int, int]]  # (message index of the turn, messages cut from the left, prompt tokens)
    oversize: list[int]  # message indices of turns that do not fit even cut to the bone


def plan_turns(conv: Conversation, renderer: Renderer, level: str, budget: int, max_turns: int = 0) -> Plan:
    """For each assistant turn (up to max_turns, spread over the conversation): the fewest messages to cut from
    the left so its prefix renders to at most `budget` tokens."""
    at = conv.assistant_turns()
    if max_turns and len(at) > max_turns:
        at = sorted({at[round(k * (len(at) - 1) / max(max_turns - 1, 1))] for k in range(max_turns)})
    turns, oversize = [], []
    for i in at:
        head = 1 if conv.messages[0]["role"] == "system" else 0
        starts = [0] + [k for k in range(1, i - head) if conv.messages[head + k]["role"] != "tool"]
        best = None  # (cut, tokens) of the smallest cut found to fit

        def length(k: int) -> int:
            return len(renderer.ids(prefix(conv, i, k), conv.tools, level))

        full = length(0)
        if full <= budget:
            turns.append((i, 0, full))
            continue
        lo, hi = 1, len(starts) - 1  # the smallest cut that fits (lengths fall as more is cut)
        while lo <= hi:
            mid = (lo + hi) // 2
            size = length(starts[mid])
            if size <= budget:
                best, hi = (starts[mid], size), mid - 1
            else:
                lo = mid + 1
        if best is None:
            oversize.append(i)
        else:
            turns.append((i, *best))
    return Plan(turns, oversize)


def reference(m: dict) -> str:
    """The original turn, as JSON text: its content and tool calls."""
    return json.dumps({"content": m.get("content") or "", "tool_calls": m.get("tool_calls") or []})


# ---- the harness -----------------------------------------------------------------------------------------------


class ReplayHarness(Harness):
    """Conversations as tasks: `play` asks each planned turn (task.data["turns"]) of the endpoint in order."""

    name = "replay"

    def __init__(self, conversations: list[Conversation]):
        self.conversations = {c.id: c for c in conversations}

    def tasks(self) -> list[Task]:
        return [
            Task(c.id, c.workload, "", {"conversation": c.id}, family=c.task_id) for c in self.conversations.values()
        ]

    def play(self, ep):
        conv = self.conversations[ep.task.id]
        for i, cut, _ in ep.task.data["turns"]:
            ep.chat(
                prefix(conv, i, cut),
                conv.tools,
                turn=i,
                reference=reference(conv.messages[i]),
                cut=cut,
                source="replay",
            )
        return None, "replayed"
