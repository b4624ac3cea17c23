"""The acceptance store: one SQLite file of per-request records, append-only, safe under concurrent writers.

Written by the LiteLLM proxy callback (one row per request that reached a backend), read by `dspine
dashboard`. WAL journal + a busy timeout let several processes append while others read; `request_id` is
unique, so a callback that fires twice for one request still leaves one row. τ and the per-slot curves are
computed from each row's `accept_hist` through stats.AcceptanceStats (acceptance is defined once).
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from pathlib import Path

from dspine.serve.records import RequestRecord
from dspine.stats import AcceptanceStats, group_by, quantile

COLUMNS = (
    "request_id",
    "ts",
    "model",
    "drafter",
    "method",
    "workload",
    "thinking",
    "stream",
    "prompt_tokens",
    "completion_tokens",
    "tau",
    "verify_rounds",
    "accept_hist",
    "latency_s",
    "source",
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL UNIQUE,
    ts REAL NOT NULL,
    model TEXT NOT NULL,
    drafter TEXT,
    method TEXT,
    workload TEXT NOT NULL,
    thinking TEXT NOT NULL,
    stream INTEGER NOT NULL,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    tau REAL,
    verify_rounds INTEGER,
    accept_hist TEXT,
    latency_s REAL,
    source TEXT
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
CREATE TRIGGER IF NOT EXISTS requests_append_only_u BEFORE UPDATE ON requests
    BEGIN SELECT RAISE(ABORT, 'the acceptance store is append-only'); END;
CREATE TRIGGER IF NOT EXISTS requests_append_only_d BEFORE DELETE ON requests
    BEGIN SELECT RAISE(ABORT, 'the acceptance store is append-only'); END;
CREATE TABLE IF NOT EXISTS traces (
    request_id TEXT PRIMARY KEY,
    episode_id TEXT,
    task_id TEXT,
    messages TEXT NOT NULL,
    tools TEXT NOT NULL,
    prompt_token_ids TEXT NOT NULL,
    completion_token_ids TEXT NOT NULL,
    completion_text TEXT,
    tool_calls TEXT NOT NULL,
    finish_reason TEXT,
    sampling TEXT NOT NULL
);
"""
# the token-level fields of a request that asked for them (metadata.workload through the proxy): one row of
# `traces` beside its `requests` row, what `dspine traces export` turns into training rows
TRACE_COLUMNS = (
    "request_id",
    "episode_id",
    "task_id",
    "messages",
    "tools",
    "prompt_token_ids",
    "completion_token_ids",
    "completion_text",
    "tool_calls",
    "finish_reason",
    "sampling",
)


class AcceptanceStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA busy_timeout=30000")
        return db

    def append(self, rec: RequestRecord, trace: dict | None = None) -> bool:
        """Insert one record (and, with `trace` and the record's token ids, its trace row). False when its
        request id is already there."""
        row = {c: getattr(rec, c) for c in COLUMNS}
        row["stream"] = int(bool(row["stream"]))
        if row["accept_hist"] is not None:
            row["accept_hist"] = json.dumps([int(x) for x in row["accept_hist"]])
        db = self._connect()
        try:
            cur = db.execute(
                f"INSERT OR IGNORE INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)})",
                [row[c] for c in COLUMNS],
            )
            if cur.rowcount == 1 and trace is not None and rec.prompt_token_ids and rec.completion_token_ids:
                t = {
                    **trace,
                    "request_id": rec.request_id,
                    "completion_text": rec.text,
                    "finish_reason": rec.finish_reason,
                    "prompt_token_ids": rec.prompt_token_ids,
                    "completion_token_ids": rec.completion_token_ids,
                }
                t = {
                    c: t.get(c) if isinstance(t.get(c), (str, type(None))) else json.dumps(t.get(c))
                    for c in TRACE_COLUMNS
                }
                db.execute(
                    f"INSERT OR IGNORE INTO traces ({', '.join(TRACE_COLUMNS)}) "
                    f"VALUES ({', '.join('?' for _ in TRACE_COLUMNS)})",
                    [t[c] for c in TRACE_COLUMNS],
                )
            return cur.rowcount == 1
        finally:
            db.close()

    def traces(self) -> list[dict]:
        """Requests with token-level fields, joined with their records, oldest first (JSON fields decoded)."""
        db = self._connect()
        db.row_factory = sqlite3.Row
        try:
            sql = "SELECT r.*, t.* FROM traces t JOIN requests r ON r.request_id = t.request_id ORDER BY r.seq"
            rows = [dict(r) for r in db.execute(sql)]
        finally:
            db.close()
        for r in rows:
            for k in ("prompt_token_ids", "completion_token_ids", "accept_hist"):
                r[k] = json.loads(r[k]) if r[k] else []
        return rows

    def rows(self, since: float = 0.0) -> list[dict]:
        db = self._connect()
        db.row_factory = sqlite3.Row
        try:
            out = [dict(r) for r in db.execute("SELECT * FROM requests WHERE ts >= ? ORDER BY seq", (since,))]
        finally:
            db.close()
        for r in out:
            r["accept_hist"] = json.loads(r["accept_hist"]) if r["accept_hist"] else None
        return out

    def summary(self, since: float = 0.0, bucket_s: float = 60.0, max_points: int = 720) -> dict:
        """What the dashboard draws: τ and per-slot acceptance by drafter × workload × thinking level (levels in
        their own order, none < low < medium < high < xhigh, then any other), τ and requests/s over time in
        equal buckets from the first request to the last, empty ones included (τ None, 0 requests/s); the
        bucket widens (a multiple of `bucket_s`) when more than `max_points` would be needed."""
        rows = self.rows(since)
        cells = []
        key = lambda r: (r["drafter"] or "", r["workload"], r["thinking"])
        by_cell = group_by((key(r), _stats(r)) for r in rows)
        latency: dict = {}
        for r in rows:
            if r["latency_s"] is not None:
                latency.setdefault(key(r), []).append(r["latency_s"])
        for k, g in sorted(by_cell.items(), key=lambda kv: (kv[0][0], kv[0][1], level_rank(kv[0][2]))):
            d, w, t = k
            cells.append(
                {
                    "drafter": d or None,
                    "workload": w,
                    "thinking": t,
                    "requests": g["items"],
                    "tau_mean": _measured(g, "tau_mean"),
                    "tau_pooled": _measured(g, "tau_pooled"),
                    "per_slot": g["per_slot"],
                    "latency_p50_s": quantile(latency.get(k, []), 0.5),
                }
            )
        series = []
        if rows:
            t0 = rows[0]["ts"] - rows[0]["ts"] % bucket_s
            span = max(r["ts"] for r in rows) - t0
            bucket_s *= max(1, math.ceil(span / bucket_s / max_points))
            by_time = group_by((t0 + (r["ts"] - t0) // bucket_s * bucket_s, _stats(r)) for r in rows)
            for i in range(int(span // bucket_s) + 1):
                start = t0 + i * bucket_s
                g = by_time.get(start)
                series.append(
                    {
                        "t": start,
                        "requests": g["items"] if g else 0,
                        "requests_per_s": g["items"] / bucket_s if g else 0.0,
                        "tau_mean": _measured(g, "tau_mean") if g else None,
                    }
                )
        return {
            "requests": len(rows),
            "cells": cells,
            "series": series,
            "bucket_s": bucket_s,
            "levels": list(LEVELS),
            "generated": time.time(),
        }


LEVELS = ("none", "minimal", "low", "medium", "high", "xhigh")  # thinking levels, in order


def level_rank(level: str) -> tuple:
    """Sort key: the known levels in order, then any other by name."""
    return (LEVELS.index(level), "") if level in LEVELS else (len(LEVELS), level)


def _measured(group: dict, key: str) -> float | None:
    """A τ figure of a group, None where no request in it had verify rounds (AR or not found)."""
    return group[key] if group["requests"] else None


def _stats(r: dict) -> AcceptanceStats | None:
    return AcceptanceStats(len(r["accept_hist"]), r["accept_hist"]) if r["accept_hist"] else None
