"""Workloads shipped with dspine: chat prompt pools for regeneration and the seven acceptance benchmarks
(data under workloads/data, sources and licences in data/SOURCES.md).

A benchmark item is a list of user turns (MT-Bench has two; the second is asked after the target's own
reply to the first). Prompt formats follow DFlash's evaluation: math asks for step-by-step reasoning with a
boxed answer, code shows the problem (and its tests or starter code).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data"
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass
class Item:
    id: str
    turns: list[str]
    system: str | None = None  # a system prompt (the tool-calling pool offers its functions there)


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _sharegpt(name: str) -> list[Item]:
    rows = json.loads((DATA / "sharegpt" / name).read_text())
    return [
        Item(str(r.get("id", i)), [r["conversations"][0]["value"]])
        for i, r in enumerate(rows)
        if r.get("conversations")
    ]


def _gsm8k():
    return [Item(f"gsm8k/{i}", [r["question"] + MATH_SUFFIX]) for i, r in enumerate(_jsonl(DATA / "gsm8k/test.jsonl"))]


def _math500():
    return [Item(r["unique_id"], [r["problem"] + MATH_SUFFIX]) for r in _jsonl(DATA / "math500/test_ori.jsonl")]


def _humaneval():
    return [
        Item(
            r["task_id"],
            [
                "Write a solution to the following problem and make sure that it passes the tests:\n"
                f"```python\n{r['prompt']}\n```"
            ],
        )
        for r in _jsonl(DATA / "humaneval/HumanEval.jsonl.gz")
    ]


def _mbpp():
    rows = json.loads((DATA / "mbpp/sanitized-mbpp.json").read_text())
    return [
        Item(
            f"mbpp/{r['task_id']}", [f"{r['prompt']}\nYour code should pass these tests:\n" + "\n".join(r["test_list"])]
        )
        for r in rows
    ]


def _livecodebench():
    out = []
    for r in _jsonl(DATA / "livecodebench/lcb.jsonl"):
        q = r["question_content"]
        if r.get("starter_code"):
            q += f"\nYou will use the following starter code:\n```python\n{r['starter_code']}\n```"
        else:
            q += "\nRead the inputs from stdin, solve the problem and write the answer to stdout."
        out.append(Item(f"lcb/{r['question_id']}", [q]))
    return out


def _mt_bench():
    return [Item(f"mt_bench/{r['question_id']}", list(r["turns"])) for r in _jsonl(DATA / "mt_bench/question.jsonl")]


def _arena_hard():
    return [Item(r["uid"], [r["prompt"]]) for r in _jsonl(DATA / "arena_hard/question.jsonl")]


def _gsm8k_train():
    return [
        Item(f"gsm8k_train/{i}", [r["question"] + MATH_SUFFIX])
        for i, r in enumerate(_jsonl(DATA / "gsm8k/train.jsonl"))
    ]


def _mbpp_train():
    """Full MBPP minus every task of the sanitized set that `mbpp` evaluates on (no contamination)."""
    held = {r["task_id"] for r in json.loads((DATA / "mbpp/sanitized-mbpp.json").read_text())}
    return [
        Item(
            f"mbpp_train/{r['task_id']}",
            [f"{r['text']}\nYour code should pass these tests:\n" + "\n".join(r["test_list"])],
        )
        for r in _jsonl(DATA / "mbpp/mbpp.jsonl")
        if r["task_id"] not in held
    ]


BENCHMARKS = {
    "gsm8k": _gsm8k,
    "math500": _math500,
    "humaneval": _humaneval,
    "mbpp": _mbpp,
    "livecodebench": _livecodebench,
    "mt_bench": _mt_bench,
    "arena_hard": _arena_hard,
}


def _bfcl():
    """BFCL's single-turn tool-calling questions, their functions offered in the system prompt as the server
    offers a request's `tools` to a target without a tool-aware chat template (dspine.target.tools_system_text)."""
    from dspine.target import tools_system_text

    items = []
    for path in sorted((DATA / "bfcl").glob("BFCL_v4_*.json.gz")):
        for r in _jsonl(path):
            turn = [m for m in r["question"][0] if m["role"] == "user"]
            if not turn:
                continue
            tools = [{"type": "function", "function": f} for f in r["function"]]
            items.append(Item(f"bfcl/{r['id']}", [turn[-1]["content"]], tools_system_text(tools)))
    return items


PROMPT_POOLS = {
    "bfcl": _bfcl,
    "sharegpt": lambda: _sharegpt("ShareGPT_V3_filtered_500.json"),
    "sharegpt_3k": lambda: _sharegpt("sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json"),
    "gsm8k_train": _gsm8k_train,
    "mbpp_train": _mbpp_train,
    "mt_bench": _mt_bench,
}


def load_benchmark(name: str, limit: int | None = None) -> list[Item]:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    items = BENCHMARKS[name]()
    return items[:limit] if limit else items


def load_prompts(name: str, limit: int | None = None, max_chars: int | None = None) -> list[str | list[dict]]:
    """First-turn user prompts of a prompt pool or benchmark (file order), capped in count and length; an
    item with a system prompt comes as its messages ([system, user]).
    `name` may join pools with '+' (e.g. "sharegpt_3k+gsm8k_train"): the limit applies to each pool."""
    out = []
    for part in name.split("+"):
        loader = PROMPT_POOLS.get(part) or BENCHMARKS.get(part)
        if loader is None:
            raise ValueError(f"unknown workload {part!r}; known: {sorted(set(PROMPT_POOLS) | set(BENCHMARKS))}")
        prompts = [
            it.turns[0]
            if it.system is None
            else [
                {"role": "system", "content": it.system},
                {"role": "user", "content": it.turns[0]},
            ]
            for it in loader()
            if it.turns[0].strip() and (max_chars is None or len(it.turns[0]) <= max_chars)
        ]
        out += prompts[:limit] if limit else prompts
    return out
