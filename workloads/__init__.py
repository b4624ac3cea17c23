"""Workloads shipped with dspine: chat prompt pools for regeneration and the seven acceptance benchmarks
(data under workloads/data, sources and licences in data/SOURCES.md).

A benchmark item is a list of user turns (MT-Bench has two; the second is asked after the target's own
reply to the first). Prompt formats follow DFlash's evaluation: math asks for step-by-step reasoning with a
boxed answer, code shows the problem (and its tests or starter code).
"""

from __future__ import annotations

import ast
import gzip
import json
import re
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
    return [
        Item(
            f"mbpp_train/{r['task_id']}",
            [f"{r['text']}\nYour code should pass these tests:\n" + "\n".join(r["test_list"])],
        )
        for r in _jsonl_train_mbpp()
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


_ASSERT = re.compile(r"^assert\s+(?P<call>(?P<name>\w+)\(.*\))\s*==\s*(?P<value>.+)$")


def _mbpp_train_rows() -> list[tuple[dict, str, list[tuple[str, str]]]]:
    """MBPP training tasks (as `mbpp_train`) whose tests call one function and compare its result:
    (row, the function's `def` line from the reference code, [(call, expected)])."""
    rows = []
    for r in _jsonl_train_mbpp():
        found = [m for t in r["test_list"] if (m := _ASSERT.match(t.strip()))]
        cases = [(m["call"], m["value"]) for m in found]
        names = {m["name"] for m in found}
        if not cases or len(names) != 1:
            continue
        sig = re.search(rf"^def\s+{re.escape(names.pop())}\s*\(.*\)\s*:", r["code"], re.M)
        if sig:
            rows.append((r, sig.group(0), cases))
    return rows


def _jsonl_train_mbpp() -> list[dict]:
    held = {r["task_id"] for r in json.loads((DATA / "mbpp/sanitized-mbpp.json").read_text())}
    return [r for r in _jsonl(DATA / "mbpp/mbpp.jsonl") if r["task_id"] not in held]


def _mbpp_fn():
    """MBPP training tasks asked as HumanEval asks: a signature and a docstring with examples to complete."""
    out = []
    for r, sig, cases in _mbpp_train_rows():
        doc = "\n".join(f"    >>> {call}\n    {value}" for call, value in cases)
        body = f'{sig}\n    """ {r["text"]}\n{doc}\n    """\n'
        out.append(
            Item(
                f"mbpp_fn/{r['task_id']}",
                [
                    "Write a solution to the following problem and make sure that it passes the tests:\n"
                    f"```python\n{body}\n```"
                ],
            )
        )
    return out


def _call_args(call: str) -> list[str]:
    """The source text of each argument of a call expression ("f([1, 2], 3)" -> ["[1, 2]", "3"])."""
    node = ast.parse(call, mode="eval").body
    return [ast.get_source_segment(call, a) for a in node.args]


def _mbpp_io():
    """MBPP training tasks asked as LiveCodeBench asks: alternately a stdin/stdout problem with sample input
    and output, and a LeetCode-style method to fill in (starter code)."""
    out = []
    for k, (r, sig, cases) in enumerate(_mbpp_train_rows()):
        fn = ast.parse(sig + " pass").body[0]
        name, params = fn.name, [x.arg for x in fn.args.args]
        try:
            cases = [(_call_args(c), v) for c, v in cases]
        except (SyntaxError, ValueError):
            continue
        if k % 2 and all(len(a) == len(params) for a, _ in cases):
            examples = "\n\n".join(
                f"Example {i}:\n\nInput: {', '.join(f'{p} = {x}' for p, x in zip(params, a))}\nOutput: {v}"
                for i, (a, v) in enumerate(cases, 1)
            )
            starter = f"class Solution:\n    def {name}(self, {', '.join(params)}):\n        "
            q = f"{r['text']}\n \n{examples}\n\nYou will use the following starter code:\n```python\n{starter}\n```"
        else:
            samples = "\n\n".join(
                f"Sample Input {i}:\n" + "\n".join(a) + f"\n\nSample Output {i}:\n{v}"
                for i, (a, v) in enumerate(cases, 1)
            )
            q = (
                f"{r['text']}\n\nInput\n\nEach argument on its own line, as a Python literal.\n\nOutput\n\n"
                f"Print the answer.\n\n{samples}\n"
                "\nRead the inputs from stdin, solve the problem and write the answer to stdout."
            )
        out.append(Item(f"mbpp_io/{r['task_id']}", [q]))
    return out


_SWE_ASK = "Explain its cause and how to fix it."


def _swe_issues():
    """SWE-bench Lite's issue texts (300 GitHub issues of 12 Python projects), asked to be explained and fixed
    (chat about real code; the project's agent harness works on its own repositories, not these)."""
    return [
        Item(
            f"swe_issues/{r['instance_id']}",
            [f"{r['problem_statement'].strip()}\n\nThis issue was reported in {r['repo']}. {_SWE_ASK}"],
        )
        for r in _jsonl(DATA / "swebench/swebench_lite.jsonl.gz")
    ]


PROMPT_POOLS = {
    "bfcl": _bfcl,
    "sharegpt": lambda: _sharegpt("ShareGPT_V3_filtered_500.json"),
    "sharegpt_3k": lambda: _sharegpt("sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json"),
    "gsm8k_train": _gsm8k_train,
    "mbpp_train": _mbpp_train,
    "mbpp_fn": _mbpp_fn,
    "mbpp_io": _mbpp_io,
    "swe_issues": _swe_issues,
    "mt_bench": _mt_bench,
}


def load_benchmark(name: str, limit: int | None = None) -> list[Item]:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    items = BENCHMARKS[name]()
    return items[:limit] if limit else items


def load_pools(name: str, limit: int | None = None, max_chars: int | None = None) -> list[tuple[str, list]]:
    """(pool, its prompts) for each pool `name` joins with '+' (e.g. "sharegpt_3k+gsm8k_train"): first-turn user
    prompts in file order, capped in length and, per pool, in count; an item with a system prompt comes as its
    messages ([system, user])."""
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
        out.append((part, prompts[:limit] if limit else prompts))
    return out


def load_prompts(name: str, limit: int | None = None, max_chars: int | None = None) -> list[str | list[dict]]:
    """First-turn user prompts of a prompt pool or benchmark, or of pools joined with '+' (`load_pools`, the limit
    applying to each pool), one list."""
    return [p for _, prompts in load_pools(name, limit, max_chars) for p in prompts]
