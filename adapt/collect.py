"""Collect agent traces as a Ray job.

    ray job submit --working-dir . -- python adapt/collect.py --endpoint http://127.0.0.1:8000/v1 \\
        --workloads swe,tool,office --levels low,high --episodes 8 --out runs/traces

Runs the swe, tool and office agents against an OpenAI-compatible endpoint (`dspine serve`, SGLang, or the
`dspine proxy` in front of either) and writes their traces (see dspine.agents.traces for the layout).

    ray job submit --working-dir . -- python adapt/collect.py --source replay --conversations CONVERSATIONS \
        --endpoint http://127.0.0.1:8000/v1 --levels none --out runs/replay

replays recorded agent conversations instead (dspine.agents.replay: OpenAI messages + tools, tau-bench `traj`,
SWE-agent .traj, nebius SWE-agent, or the generic JSON lines {"messages", "tools", "workload", "task_id", "id"}
that you can export from your own logs; `shipped` = the conversations that come with dspine): each assistant turn's
exact preceding messages are sent to the endpoint, which generates that turn; rows carry `source: replay`, the
original turn as `reference`, the messages cut to fit the window as `cut`. One episode per conversation × level.

Re-running the same command skips what is done; `--dry-run` lists what would run. Works the same on a local head
and on a cluster: give an endpoint every node reaches and an --out on shared storage or an object-store URI (s3://...).
Without Ray (a machine where it is not installed): `--executor local` runs the episodes in worker processes here.
A one-machine head that should stay on 127.0.0.1 is started with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (Ray otherwise
replaces 127.0.0.1 by the machine's interface address).
"""

from __future__ import annotations

import argparse
import json
import sys


def parse(argv=None) -> tuple:
    from dspine.adapt.collection import SOURCES, WORKLOADS, CollectConfig
    from dspine.agents.replay import FORMATS, shipped

    p = argparse.ArgumentParser(
        prog="adapt/collect.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--endpoint", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--out", required=True, help="collection directory: a path or a URI pyarrow understands")
    p.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated: {', '.join(WORKLOADS)} (live; default all); replay: the conversations' workloads to "
        "keep (default all)",
    )
    p.add_argument(
        "--source",
        choices=SOURCES,
        default="live",
        help="live: run the agent harnesses; replay: replay recorded conversations (--conversations)",
    )
    p.add_argument(
        "--conversations", default="", help="replay: comma-separated files or folders of conversations, or `shipped`"
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=FORMATS,
        help="replay: the conversations' format (auto: from each file's shape)",
    )
    p.add_argument(
        "--tokenizer",
        default="",
        help="replay: the target whose rendering decides the cuts (default: the endpoint's `target`)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=0,
        help="replay: the window a prefix plus --max-tokens must fit (default: the endpoint's max_model_len)",
    )
    p.add_argument(
        "--max-conversations",
        type=int,
        default=0,
        help="replay: at most this many conversations per workload, one per task before a second of any (0: all)",
    )
    p.add_argument(
        "--skip-oversize",
        action="store_true",
        help="replay: skip (and count) turns that do not fit "
        "even cut to their last message, instead of refusing the job",
    )
    p.add_argument("--levels", default="low,high", help="thinking levels, comma-separated: none low medium high xhigh")
    p.add_argument("--episodes", type=int, default=1, help="episodes per workload × level")
    p.add_argument("--model", help="model name at the endpoint (default: its first model)")
    p.add_argument("--api-key", default="none", help="bearer key (the proxy needs one)")
    p.add_argument("--concurrency", type=int, default=4, help="episodes running at once")
    p.add_argument("--retries", type=int, default=2, help="Ray retries of an episode (worker death or error)")
    p.add_argument("--seed", type=int, default=0, help="fixes the order tasks are drawn in")
    p.add_argument(
        "--max-turns",
        type=int,
        default=None,
        help="model calls per episode (live, default 8); "
        "replay: turns per conversation, spread over it (default: every turn)",
    )
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
    replay = a.source == "replay"
    convs = [shipped() if c == "shipped" else c for c in a.conversations.split(",") if c]
    cfg = CollectConfig(
        endpoint=a.endpoint,
        out=a.out,
        workloads=[w for w in (a.workloads or ("" if replay else ",".join(WORKLOADS))).split(",") if w],
        levels=[x for x in a.levels.split(",") if x],
        episodes=a.episodes,
        model=a.model,
        api_key=a.api_key,
        concurrency=a.concurrency,
        retries=a.retries,
        seed=a.seed,
        max_turns=a.max_turns if a.max_turns is not None else (0 if replay else 8),
        max_tokens=a.max_tokens,
        max_episode_tokens=a.max_episode_tokens,
        wall_s=a.wall_s,
        temperature=a.temperature,
        tool_wall_s=a.tool_wall_s,
        executor=a.executor,
        source=a.source,
        conversations=[str(c) for c in convs],
        format=a.format,
        tokenizer=a.tokenizer,
        max_context=a.max_context,
        skip_oversize=a.skip_oversize,
        max_conversations=a.max_conversations,
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
