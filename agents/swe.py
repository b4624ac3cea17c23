"""The swe workload: mini-swe-agent fixing a small Python repository with a failing test.

mini-swe-agent's own loop (`DefaultAgent`) and prompts (its bundled `mini.yaml`: one `bash` tool, sent as an
OpenAI tool) run unchanged; two small adapters connect it to dspine: its model calls go through the episode
(`Episode.chat`, which tags and records them) and its bash commands run in the episode's jail instead of
`LocalEnvironment`'s plain subprocess. Why mini-swe-agent: its local environment needs no container, its loop is
a hundred lines that any SWE-agent user knows, and its trajectories are what users of such agents produce.

Tasks: workloads/data/swe/<id>/ — ISSUE.md, the code, a unittest that fails, and task.json (the test command and
the fix, which never enters the episode directory). Success: the test command passes in the jail afterwards.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dspine.agents.base import Harness, Task

# mini-swe-agent's exit statuses -> the termination reasons every harness uses
MINI_EXITS = {
    "LimitsExceeded": "max_turns",
    "TimeExceeded": "wall_time",
    "Submitted": "submitted",
    "RepeatedFormatError": "format_errors",
}


def data_dir() -> Path:
    from dspine import workloads

    return Path(workloads.__file__).resolve().parent / "data" / "swe"


def _mini_config() -> dict:
    import yaml
    from minisweagent.config import get_config_path

    return yaml.safe_load(get_config_path("mini").read_text())


def _adapters():
    """mini-swe-agent classes bound late: the package is only needed when the workload runs."""
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel
    from minisweagent.models.utils.actions_toolcall import BASH_TOOL

    class EpisodeModel(LitellmModel):
        abort_exceptions = [Exception]  # no silent retries: a failed call ends the episode with its reason

        def __init__(self, ep, **kwargs):
            super().__init__(model_name=f"openai/{ep.cfg.model}", cost_tracking="ignore_errors", **kwargs)
            self.ep = ep

        def _query(self, messages, **kwargs):
            return self.ep.chat(messages, tools=[BASH_TOOL])

    class JailedEnvironment(LocalEnvironment):
        def __init__(self, ep, **kwargs):
            super().__init__(cwd=str(ep.workdir), **kwargs)
            self.ep = ep

        def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
            r = self.ep.jail.run_shell(action.get("command", ""))
            self.ep.tool_result("bash", r.output, r.ok)
            out = {
                "output": r.output,
                "returncode": r.returncode,
                "exception_info": "the command timed out and was killed" if r.timed_out else "",
            }
            self._check_finished(out)
            return out

    return EpisodeModel, JailedEnvironment


class SweHarness(Harness):
    name = "swe"

    def tasks(self) -> list[Task]:
        out = []
        for d in sorted(p for p in data_dir().iterdir() if (p / "task.json").is_file()):
            meta = json.loads((d / "task.json").read_text())
            out.append(
                Task(
                    meta["id"],
                    self.name,
                    (d / "ISSUE.md").read_text().strip(),
                    {"dir": str(d), "test_command": meta["test_command"]},
                )
            )
        return out

    def setup(self, ep) -> None:
        src = Path(ep.task.data["dir"])
        for f in src.iterdir():
            if f.name != "task.json" and f.is_file():
                shutil.copy2(f, ep.workdir / f.name)

    def play(self, ep):
        from minisweagent.agents.default import DefaultAgent

        EpisodeModel, JailedEnvironment = _adapters()
        cfg = _mini_config()
        model_cfg = {k: v for k, v in cfg.get("model", {}).items() if k != "model_kwargs"}
        agent_cfg = {
            **cfg["agent"],
            "step_limit": ep.cfg.max_turns,
            "cost_limit": 0,
            "wall_time_limit_seconds": int(ep.cfg.wall_s),
        }
        env_cfg = {"env": cfg.get("environment", {}).get("env", {}), "timeout": int(ep.cfg.tool_limits.wall_s)}
        agent = DefaultAgent(EpisodeModel(ep, **model_cfg), JailedEnvironment(ep, **env_cfg), **agent_cfg)
        out = agent.run(task=ep.task.instruction)  # EpisodeLimit and refused calls end it in Harness.run
        status = out.get("exit_status") or "ended"
        return self.score(ep), MINI_EXITS.get(status, status)

    def score(self, ep) -> bool:
        return ep.jail.run_shell(ep.task.data["test_command"]).ok
