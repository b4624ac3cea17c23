"""The office workload: OfficeBench tasks over their testbed documents (.xlsx, .docx, .eml, .ics, .txt).

Each episode copies the task's testbed into its directory; the agent works through the tools of
agents.office_tools (sent as OpenAI `tools`, run jailed) and ends by calling `finish` or by answering without a
tool call. Success is the task's own evaluation rules (`evaluate_contain`, `evaluate_excel_cell_value`, ...),
also run in the jail. Tasks that need what the testbeds here lack — images and PDFs (the OCR and PDF tasks) or
a reference file for `evaluate_exact_match` — are skipped and counted (`skipped()`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from dspine.agents.base import Harness, Task, call_tool, python_tool
from dspine.agents.office_tools import TOOLS
from dspine.agents.tau_tools import schema

SPEC = "dspine.agents.office_tools:"
_NEEDS_MISSING = re.compile(r"\bpdfs?\b|\.jpe?g|\.png|\bocr\b|\bimages?\b|\bscan(ned)?\b|\bphoto", re.IGNORECASE)
FINISH = {
    "type": "function",
    "function": {
        "name": "finish",
        "description": "Call when the task is done.",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}


def data_dir() -> Path:
    from dspine import workloads

    return Path(workloads.__file__).resolve().parent / "data" / "office" / "tasks"


class OfficeHarness(Harness):
    name = "office"

    def __init__(self):
        self.tools = {f.__name__: SPEC + f.__name__ for f in TOOLS}  # name -> "module:function" (extendable)
        self.schemas = [schema(f, skip=0) for f in TOOLS] + [FINISH]
        self._skipped: dict[str, str] = {}

    def tasks(self) -> list[Task]:
        out, self._skipped = [], {}
        for sub in sorted(data_dir().glob("*/subtasks/*.json")):
            d = json.loads(sub.read_text())
            tid = f"{sub.parent.parent.name}/{sub.stem}"
            text = json.dumps(d)
            if _NEEDS_MISSING.search(text):
                self._skipped[tid] = "needs images or PDFs that the testbed here lacks"
                continue
            if any(r["function"] == "evaluate_exact_match" for r in d.get("evaluation", [])):
                self._skipped[tid] = "evaluate_exact_match needs a reference file that was not published"
                continue
            out.append(Task(tid, self.name, d["task"], {**d, "testbed": str(sub.parent.parent / "testbed")}))
        return out

    def skipped(self) -> dict[str, str]:
        if not self._skipped:
            self.tasks()
        return dict(self._skipped)

    def setup(self, ep) -> None:
        src = Path(ep.task.data["testbed"])
        if src.is_dir():
            shutil.copytree(src, ep.workdir, dirs_exist_ok=True)

    def execute(self, ep, name: str, arguments: str) -> str:
        return call_tool(ep, name, arguments, lambda args: (self.tools[name], args) if name in self.tools else None)

    def play(self, ep):
        d = ep.task.data
        system = (
            f"You are {d['username']}'s office assistant. Today is {d['weekday']}, {d['date']}, {d['time']}. "
            "The user's files are in the current folder: data/ (spreadsheets and documents), calendar/ (one .ics "
            "per person) and emails/ (one folder per person). Use the tools to do the task; call finish when done."
        )
        messages = [{"role": "system", "content": system}, {"role": "user", "content": ep.task.instruction}]
        while True:
            resp = ep.chat(messages, self.schemas)
            msg = resp.choices[0].message
            calls = msg.tool_calls or []
            if not calls:
                return self.score(ep), "answered"
            messages.append(
                {"role": "assistant", "content": msg.content, "tool_calls": [c.model_dump() for c in calls]}
            )
            for c in calls:
                if c.function.name == "finish":
                    return self.score(ep), "finished"
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": c.id,
                        "content": self.execute(ep, c.function.name, c.function.arguments),
                    }
                )

    def score(self, ep) -> bool | None:
        rules = {"rules": ep.task.data.get("evaluation", []), "original": ep.task.data["testbed"]}
        return python_tool(ep, SPEC + "evaluate", rules, count=False).strip() == "true"
