"""The trace format: Parquet, one row per generation event (agents.base.TraceRow), one shard per episode.

A collection directory (a local path or any URI pyarrow understands: s3://, gs://, hdfs://, file://) holds

    config.json                           what was asked (refused if a later run asks for something else)
    traces/<workload>/<episode_id>.parquet  the episode's rows; deterministic names, so a retried or re-run
                                          episode overwrites its own shard
    episodes/<episode_id>.json            the episode's summary (success, termination, turns, tokens, ...)
    failures/<episode_id>.json            an episode that failed after its retries, with the reason
    accounts.json                         requested = ok + failed + skipped, per workload × level

Every file is written under _tmp/ and then moved into place. Load the rows with
`datasets.load_dataset("parquet", data_files=f"{dir}/traces/*/*.parquet")` or `load_traces(dir)`. Training
masks come from the ids (`loss_mask`), never from re-rendered text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, fields

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from dspine.agents.base import TraceRow

_TYPES = {
    "str": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "bool": pa.bool_(),
    "list[int]": pa.list_(pa.int64()),
    "str | None": pa.string(),
    "float | None": pa.float64(),
    "bool | None": pa.bool_(),
}
SCHEMA = pa.schema([pa.field(f.name, _TYPES[str(f.type)]) for f in fields(TraceRow)])


class Store:
    """A collection directory on any pyarrow filesystem."""

    def __init__(self, uri: str):
        self.uri = uri
        self.fs, self.root = pafs.FileSystem.from_uri(uri if "://" in uri else _abs(uri))

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def exists(self, *parts: str) -> bool:
        return self.fs.get_file_info(self.path(*parts)).type != pafs.FileType.NotFound

    def write_bytes(self, data: bytes, *parts: str) -> None:
        tmp = self.path("_tmp", f"{uuid.uuid4().hex}-{parts[-1]}")
        self.fs.create_dir(self.path("_tmp"), recursive=True)
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.create_dir(self.path(*parts[:-1]), recursive=True)
        self.fs.move(tmp, self.path(*parts))

    def write_json(self, obj, *parts: str) -> None:
        self.write_bytes(json.dumps(obj, indent=1, default=str).encode(), *parts)

    def read_json(self, *parts: str):
        with self.fs.open_input_stream(self.path(*parts)) as f:
            return json.loads(f.read())

    def delete(self, *parts: str) -> None:
        if self.exists(*parts):
            self.fs.delete_file(self.path(*parts))

    def list(self, *parts: str) -> list[str]:
        if not self.exists(*parts):
            return []
        sel = pafs.FileSelector(self.path(*parts), recursive=False)
        return sorted(i.base_name for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.File)

    def write_rows(self, rows: list[TraceRow], *parts: str) -> None:
        table = pa.Table.from_pylist([asdict(r) for r in rows], schema=SCHEMA)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        self.write_bytes(sink.getvalue().to_pybytes(), *parts)

    def clean_tmp(self) -> None:
        if self.exists("_tmp"):
            self.fs.delete_dir(self.path("_tmp"))


def _abs(path: str) -> str:
    from pathlib import Path

    return str(Path(path).expanduser().resolve())


def shard(workload: str, episode_id: str) -> tuple[str, str, str]:
    return ("traces", workload, f"{episode_id}.parquet")


def load_traces(uri: str) -> pa.Table:
    """Every row of a collection, as one Arrow table."""
    st = Store(uri)
    tables = [
        pq.read_table(st.path("traces", w, name), filesystem=st.fs, schema=SCHEMA)
        for w in _dirs(st, "traces")
        for name in st.list("traces", w)
        if name.endswith(".parquet")
    ]
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def _dirs(st: Store, *parts: str) -> list[str]:
    if not st.exists(*parts):
        return []
    sel = pafs.FileSelector(st.path(*parts), recursive=False)
    return sorted(i.base_name for i in st.fs.get_file_info(sel) if i.type == pafs.FileType.Directory)


def loss_mask(row: dict) -> tuple[list[int], list[int]]:
    """(input ids, mask) of one row: the prompt then the completion; 1 on the tokens the target generated."""
    p, c = list(row["prompt_token_ids"]), list(row["completion_token_ids"])
    return p + c, [0] * len(p) + [1] * len(c)


def export_store(db: str, out: str) -> dict[str, int]:
    """The proxy's recorded agent traffic (requests with token ids) -> trace shards in `out`, one per workload
    (traces/<workload>/from-store.parquet, rewritten whole on each export) -> rows per workload."""
    from collections import defaultdict

    from dspine.serve.store import AcceptanceStore
    from dspine.stats import AcceptanceStats

    by_workload: dict[str, list[TraceRow]] = defaultdict(list)
    turns: dict[str, int] = defaultdict(int)
    for r in AcceptanceStore(db).traces():
        ep = r["episode_id"] or f"proxy-{r['request_id']}"
        hist = r["accept_hist"]
        by_workload[r["workload"]].append(
            TraceRow(
                episode_id=ep,
                task_id=r["task_id"] or "",
                workload=r["workload"],
                thinking=r["thinking"],
                turn=turns[ep],
                request_id=r["request_id"],
                messages=r["messages"],
                tools=r["tools"],
                prompt_token_ids=r["prompt_token_ids"],
                completion_token_ids=r["completion_token_ids"],
                has_token_ids=True,
                completion_text=r["completion_text"] or "",
                tool_calls=r["tool_calls"],
                finish_reason=r["finish_reason"] or "",
                prompt_tokens=r["prompt_tokens"] or 0,
                completion_tokens=r["completion_tokens"] or 0,
                accept_hist=hist,
                tau=AcceptanceStats(len(hist), hist).tau if hist else None,
                sampling=r["sampling"],
                target=r["model"],
                drafter=r["drafter"],
                chat_template_sha256=None,
                latency_s=r["latency_s"] or 0.0,
                ts=r["ts"],
                termination="proxy",
            )
        )
        turns[ep] += 1
    st = Store(out)
    for w, rows in by_workload.items():
        st.write_rows(rows, "traces", w, "from-store.parquet")
    st.clean_tmp()
    return {w: len(rows) for w, rows in by_workload.items()}
