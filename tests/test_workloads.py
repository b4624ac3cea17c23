"""Training prompt pools: no evaluation item in them, the formats they borrow hold, and pools added to a
continued run leave its held-out split alone."""

import ast
import re

from dspine.train.run import split_heldout
from workloads import BENCHMARKS, PROMPT_POOLS, load_prompts


def test_added_pools_borrow_the_benchmark_formats_without_their_items():
    fn, io, swe = (PROMPT_POOLS[n]() for n in ("mbpp_fn", "mbpp_io", "swe_issues"))
    assert len(fn) > 500 and len(io) > 500 and len(swe) == 300
    eval_mbpp = {it.id.split("/")[1] for it in BENCHMARKS["mbpp"]()}
    assert not eval_mbpp & {it.id.split("/")[1] for it in fn + io}
    for it in fn:  # HumanEval's shape: a signature whose docstring holds the task and doctest examples
        code = re.search(r"```python\n(.*)```", it.turns[0], re.S).group(1)
        (f,) = ast.parse(code).body
        assert isinstance(f, ast.FunctionDef) and ">>> " + f.name + "(" in ast.get_docstring(f)
    stdin = [it for it in io if "stdin" in it.turns[0]]
    starter = [it for it in io if "class Solution:" in it.turns[0]]
    assert len(stdin) + len(starter) == len(io) and min(len(stdin), len(starter)) > 200
    for it in stdin:  # every sample input line is one Python expression (an argument)
        for block in re.findall(r"Sample Input \d+:\n(.*?)\n\nSample Output", it.turns[0], re.S):
            for line in block.splitlines():
                ast.parse(line, mode="eval")
    assert all(it.turns[0].endswith("how to fix it.") and len(it.turns) == 1 for it in swe)
    assert len(load_prompts("mbpp_fn+swe_issues", limit=3)) == 6


def test_added_samples_join_training_and_leave_the_heldout_split_alone():
    samples = [([k] * 40, 5) for k in range(50)]
    added = [([100 + k] * 40, 5) for k in range(10)] + [([7] * 400, 390)]  # the last leaves no room to answer
    train, held = split_heldout(samples, 8, seed=3, max_len=256)
    train2, held2 = split_heldout(samples, 8, seed=3, max_len=256, train_only=added)
    assert held2 == held and train2[: len(train)] == train and train2[len(train) :] == added[:10]
