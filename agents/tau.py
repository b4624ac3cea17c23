"""The tool workload: tau-bench-style customer service over the retail (tau2) and airline (tau-bench) databases.

The agent gets the domain's policy as its system prompt and the tools (agents.tau_tools) as OpenAI `tools`; every
call runs jailed on the episode's own copy of the database (`db.json` in the episode directory). The user is
scripted from the task's instructions (who they are, why they call, what they do not know, how they behave) and
is no model: no trace row is a user turn. It answers the agent's text replies in order — its reason for calling,
then what else the task says, then a confirmation — and ends the conversation after that.

Success is tau2's database check: the episode's final database equals the database after replaying the task's
gold actions. None when the task is not judged on the database, its gold actions use a tool not built here, or
they change nothing (such tasks are judged on what the agent says, which is not checked here).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

from dspine.agents.base import Harness, Task, call_tool
from dspine.agents.tau_tools import DOMAINS, replay, schema

SPEC = "dspine.agents.tau:run_in"
MUTATING = ("cancel_", "modify_", "return_", "exchange_", "book_", "update_", "send_")


def data_dir() -> Path:
    from dspine import workloads

    return Path(workloads.__file__).resolve().parent / "data" / "tau"


def load_db(domain: str) -> dict:
    with gzip.open(data_dir() / domain / "db.json.gz", "rt") as f:
        return json.load(f)


def db_hash(db: dict) -> str:
    return hashlib.sha256(json.dumps(db, sort_keys=True).encode()).hexdigest()


def run_in(domain: str, name: str, args: dict):
    """Inside the jail: one tool call on ./db.json (rewritten atomically when the tool changes it)."""
    from dspine.agents.tau_tools import call

    with open("db.json") as f:
        db = json.load(f)
    out = call(domain, db, name, args)
    if name.startswith(MUTATING):
        with open("db.json.tmp", "w") as f:
            json.dump(db, f)
        os.replace("db.json.tmp", "db.json")
    return out


class TauHarness(Harness):
    name = "tool"

    def __init__(self, domains=("retail", "airline"), user_turns: int = 3):
        self.domains, self.user_turns = tuple(domains), user_turns
        self._dbs: dict[str, dict] = {}
        # tool name -> "module:function" run in the jail; extra tools may be registered here
        self.tools: dict[str, dict] = {d: {n: schema(f) for n, f in DOMAINS[d].items()} for d in self.domains}
        self.extra: dict[str, str] = {}

    def tasks(self) -> list[Task]:
        out = []
        for d in self.domains:
            for t in json.loads((data_dir() / d / "tasks.json").read_text()):
                ins = (t.get("user_scenario") or {}).get("instructions") or {}
                crit = t.get("evaluation_criteria") or {}
                out.append(
                    Task(
                        f"{d}-{t['id']}",
                        self.name,
                        ins.get("reason_for_call") or "",
                        {
                            "domain": d,
                            "instructions": ins,
                            "actions": crit.get("actions") or [],
                            "reward_basis": crit.get("reward_basis") or [],
                        },
                    )
                )
        return out

    def db(self, domain: str) -> dict:
        if domain not in self._dbs:
            self._dbs[domain] = load_db(domain)
        return self._dbs[domain]

    def setup(self, ep) -> None:
        (ep.workdir / "db.json").write_text(json.dumps(self.db(ep.task.data["domain"])))

    def schemas(self, domain: str) -> list[dict]:
        extra = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in self.extra]
        return list(self.tools[domain].values()) + extra

    def execute(self, ep, name: str, arguments: str) -> str:
        def route(args):  # an extra tool by its own spec; a domain tool through run_in (unknown names: its error)
            if name in self.extra:
                return self.extra[name], args
            return SPEC, {"domain": ep.task.data["domain"], "name": name, "args": args}

        return call_tool(ep, name, arguments, route, raw=name not in self.extra)

    def user_lines(self, task: Task) -> list[str]:
        ins = task.data["instructions"]
        first = " ".join(x for x in (ins.get("known_info"), ins.get("reason_for_call")) if x)
        rest = [x for x in (ins.get("unknown_info"), ins.get("task_instructions")) if x]
        lines = [f"Hi, I need some help. {first}"] + rest + ["Yes, please go ahead."]
        return (lines + ["Thank you, that's all."])[: self.user_turns + 1]

    def play(self, ep):
        domain = ep.task.data["domain"]
        policy = (data_dir() / domain / "policy.md").read_text()
        lines = self.user_lines(ep.task)
        messages = [{"role": "system", "content": policy}, {"role": "user", "content": lines.pop(0)}]
        tools = self.schemas(domain)
        while True:
            resp = ep.chat(messages, tools)
            msg = resp.choices[0].message
            calls = msg.tool_calls or []
            if calls:
                messages.append(
                    {"role": "assistant", "content": msg.content, "tool_calls": [c.model_dump() for c in calls]}
                )
                for c in calls:
                    out = self.execute(ep, c.function.name, c.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": c.id, "content": out})
                continue
            messages.append({"role": "assistant", "content": msg.content or ""})
            if not lines:
                return self.score(ep), "user_stop"
            messages.append({"role": "user", "content": lines.pop(0)})

    def score(self, ep) -> bool | None:
        data = ep.task.data
        if "DB" not in data["reward_basis"] or any(a["name"] not in DOMAINS[data["domain"]] for a in data["actions"]):
            return None
        expected = replay(data["domain"], self.db(data["domain"]), data["actions"])
        if db_hash(expected) == db_hash(self.db(data["domain"])):
            return None  # the task changes nothing: it is judged on what is said, which is not checked here
        try:
            got = json.loads((ep.workdir / "db.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
        return db_hash(got) == db_hash(expected)
