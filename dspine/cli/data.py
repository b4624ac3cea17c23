"""`dspine regen` (target-regenerated training data) and `dspine traces` (the proxy's agent traffic as trace rows)."""

from __future__ import annotations

import json

from dspine.cli.common import UsageError, add_target, torch_dtype


def add_regen(sub) -> None:
    r = sub.add_parser(
        "regen",
        help="regenerate responses to a prompt set with the target (training data)",
        description="Answer every prompt of a workload with the target itself and write a Parquet "
        "dataset (part-*.parquet, errors.jsonl, manifest.json). Re-running with the "
        "same --out skips prompts already answered.",
    )
    add_target(r)
    r.add_argument("--workload", default="sharegpt_3k", help="prompt pool from workloads/ (default: %(default)s)")
    r.add_argument("--prompts-file", help="JSONL file of {id, prompt} rows instead of a workload")
    r.add_argument("--out", required=True, help="dataset folder to write (or resume)")
    r.add_argument("--limit", type=int, default=None, help="first N prompts only")
    r.add_argument("--max-new-tokens", type=int, default=256, help="response length cap (default: %(default)s)")
    r.add_argument("--batch-size", type=int, default=16, help="prompts per generate call (default: %(default)s)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    r.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def add_traces(sub) -> None:
    t = sub.add_parser(
        "traces",
        help="agent traces: export the proxy's recorded traffic, or import your agents' logs, as training rows",
        description="Agent traces in dspine's training format (Parquet, one row per model call, exact token "
        "ids). `export --from-store DB --out DIR` writes the requests that reached the proxy with "
        "metadata.workload (recorded with their token ids) as DIR/traces/<workload>/from-store.parquet, "
        "the same format `adapt/collect.py` writes. `import --conversations LOGS --endpoint URL --out DIR` "
        "replays your agents' logged conversations (JSON lines {messages, tools, workload, task_id, id}, or any "
        "format `adapt/collect.py --source replay` reads) through the endpoint, one row per assistant turn, the "
        "target generating each turn from its exact preceding messages (worker processes here, no Ray).",
    )
    ts = t.add_subparsers(dest="traces_verb", required=True, metavar="ACTION")
    x = ts.add_parser("export", help="proxy store -> trace shards")
    x.add_argument("--from-store", required=True, help="the proxy's SQLite acceptance store")
    x.add_argument("--out", required=True, help="collection directory (a path or a URI pyarrow understands)")
    i = ts.add_parser("import", help="logged conversations -> trace shards, every turn replayed through an endpoint")
    i.add_argument("--conversations", required=True, help="comma-separated files or folders of conversations")
    i.add_argument("--format", default="auto", help="generic (JSON lines), openai, tau, swe_agent, nebius, or auto")
    i.add_argument("--endpoint", required=True, help="OpenAI-compatible base URL of the target, e.g. .../v1")
    i.add_argument("--api-key", default="none", help="bearer key (the proxy needs one)")
    i.add_argument("--out", required=True, help="collection directory (re-running the same command skips what is done)")
    i.add_argument("--levels", default="none", help="thinking levels to replay each turn at, comma-separated")
    i.add_argument("--max-tokens", type=int, default=256, help="generated tokens per turn (default: %(default)s)")
    i.add_argument("--concurrency", type=int, default=2, help="conversations replayed at once (default: %(default)s)")


def cmd_regen(a) -> int:
    from dspine.target import load_target
    from dspine.train.data import regenerate_dataset, workload_items

    if a.prompts_file:
        items = []
        with open(a.prompts_file) as f:
            for n, line in enumerate(f):
                if line.strip():
                    row = json.loads(line)
                    items.append((str(row.get("id", n)), row.get("prompt", "")))
    else:
        items = workload_items(a.workload)
    items = items[: a.limit] if a.limit else items
    target = load_target(a.target, dtype=torch_dtype(a.dtype), device=a.device)
    rep = regenerate_dataset(
        target,
        items,
        a.out,
        max_new_tokens=a.max_new_tokens,
        batch_size=a.batch_size,
        temperature=a.temperature,
        progress=not a.no_progress,
    )
    print(f"regen {a.out}: input={rep.input} ok={rep.ok} error={rep.error} skipped={rep.skipped}")
    return 0


def cmd_traces(a) -> int:
    import os

    from dspine.agents.traces import export_store

    if a.traces_verb == "import":
        return _import(a)
    if not os.path.isfile(a.from_store):
        raise UsageError(f"--from-store {a.from_store!r}: no such file")
    counts = export_store(a.from_store, a.out)
    for w, n in sorted(counts.items()):
        print(f"{w}: {n} rows -> {a.out}/traces/{w}/from-store.parquet")
    if not counts:
        print("no requests with token ids in the store (agent traffic sends metadata.workload through the proxy)")
    return 0


def _import(a) -> int:
    from dspine.adapt.collection import CollectConfig, CollectError, accounts_markdown, collect

    cfg = CollectConfig(
        endpoint=a.endpoint,
        out=a.out,
        workloads=[],
        levels=[x for x in a.levels.split(",") if x],
        api_key=a.api_key,
        concurrency=a.concurrency,
        max_turns=0,
        max_tokens=a.max_tokens,
        executor="local",
        source="replay",
        conversations=[c for c in a.conversations.split(",") if c],
        format=a.format,
    )
    try:
        acc = collect(cfg)
    except CollectError as e:
        raise UsageError(str(e)) from None
    print(accounts_markdown(acc))
    return 1 if acc["failed"] else 0
