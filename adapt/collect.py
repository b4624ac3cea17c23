"""Collect agent traces as a Ray job.

    ray job submit --working-dir . -- python adapt/collect.py --endpoint http://127.0.0.1:8000/v1 \\
        --workloads swe,tool,office --levels low,high --episodes 8 --out runs/traces

Runs the swe, tool and office agents against an OpenAI-compatible endpoint (`dspine serve`, SGLang, or the
`dspine proxy` in front of either) and writes their traces (see dspine.agents.traces for the layout). Re-running
the same command skips what is done; `--dry-run` lists what would run. Works the same on a local head and on a
cluster: give an endpoint every node reaches and an --out on shared storage or an object-store URI (s3://...).
Without Ray (a machine where it is not installed): `--executor local` runs the episodes in worker processes here.
A one-machine head that should stay on 127.0.0.1 is started with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (Ray otherwise
replaces 127.0.0.1 by the machine's interface address).
"""

from __future__ import annotations

import argparse
import json
import sys


def parse(argv=None) -> tuple:
    from dspine.adapt.collection import WORKLOADS, CollectConfig

    p = argparse.ArgumentParser(
        prog="adapt/collect.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--endpoint", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--out", required=True, help="collection directory: a path or a URI pyarrow understands")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: swe, tool, office")
    p.add_argument("--levels", default="low,high", help="thinking levels, comma-separated: none low medium high xhigh")
    p.add_argument("--episodes", type=int, default=1, help="episodes per workload × level")
    p.add_argument("--model", help="model name at the endpoint (default: its first model)")
    p.add_argument("--api-key", default="none", help="bearer key (the proxy needs one)")
    p.add_argument("--concurrency", type=int, default=4, help="episodes running at once")
    p.add_argument("--retries", type=int, default=2, help="Ray retries of an episode (worker death or error)")
    p.add_argument("--seed", type=int, default=0, help="fixes the order tasks are drawn in")
    p.add_argument("--max-turns", type=int, default=8, help="model calls per episode")
    p.add_argument("--max-tokens", type=int, default=256, help="generated tokens per call")
    p.add_argument("--max-episode-tokens", type=int, default=4096, help="generated tokens per episode")
    p.add_argument("--wall-s", type=float, default=600.0, help="wall-clock limit per episode")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tool-wall-s", type=float, default=30.0, help="wall-clock limit per tool call")
    p.add_argument(
        "--executor",
        choices=("ray", "local"),
        default="ray",
        help="ray: episodes as Ray tasks (default); local: worker processes here, without Ray",
    )
    p.add_argument("--dry-run", action="store_true", help="list the episodes that would run, then exit")
    a = p.parse_args(argv)
    cfg = CollectConfig(
        endpoint=a.endpoint,
        out=a.out,
        workloads=[w for w in a.workloads.split(",") if w],
        levels=[x for x in a.levels.split(",") if x],
        episodes=a.episodes,
        model=a.model,
        api_key=a.api_key,
        concurrency=a.concurrency,
        retries=a.retries,
        seed=a.seed,
        max_turns=a.max_turns,
        max_tokens=a.max_tokens,
        max_episode_tokens=a.max_episode_tokens,
        wall_s=a.wall_s,
        temperature=a.temperature,
        tool_wall_s=a.tool_wall_s,
        executor=a.executor,
    )
    return cfg, a.dry_run


def main(argv=None) -> int:
    from dspine.adapt.collection import CollectError, accounts_markdown, collect

    cfg, dry = parse(argv)
    try:
        acc = collect(cfg, dry_run=dry)
    except CollectError as e:
        print(f"collect: error: {e}", file=sys.stderr)
        return 2
    if dry:
        for s in acc["to_run"]:
            print(json.dumps(s))
        print(f"{len(acc['to_run'])} of {acc['requested']} episodes to run ({acc['already_done']} already done)")
        return 0
    print(accounts_markdown(acc))
    return 1 if acc["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
