"""Workload prompt sets shipped with dspine (data under workloads/data, sources in data/SOURCES.md)."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"


def _sharegpt() -> list[str]:
    rows = json.loads((DATA / "sharegpt" / "ShareGPT_V3_filtered_500.json").read_text())
    return [r["conversations"][0]["value"] for r in rows if r.get("conversations")]


def _mt_bench() -> list[str]:
    lines = (DATA / "mt_bench" / "question.jsonl").read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]


LOADERS = {"sharegpt": _sharegpt, "mt_bench": _mt_bench}


def load_prompts(name: str, limit: int | None = None, max_chars: int | None = None) -> list[str]:
    """First-turn user prompts of workload `name` (in file order), optionally capped in count and length."""
    if name not in LOADERS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(LOADERS)}")
    prompts = [p for p in LOADERS[name]() if p.strip() and (max_chars is None or len(p) <= max_chars)]
    return prompts[:limit] if limit else prompts
