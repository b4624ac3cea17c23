"""Target-regenerated training data: the target answers each prompt itself (fixed dtype, greedy by
default) and the drafter learns to predict the target's own continuations."""

from __future__ import annotations

from dataclasses import dataclass

from .engine import Engine
from .sampling import SamplingParams
from .target import Target


@dataclass
class Sample:
    prompt: str
    ids: list[int]  # prompt (chat template applied) + response
    response_start: int
    thinking: str = "none"

    def as_pair(self) -> tuple[list[int], int]:
        return self.ids, self.response_start


def regenerate(target: Target, prompts: list[str], params: SamplingParams | None = None,
               progress: bool = True) -> list[Sample]:
    """Answer every prompt with the target alone (AR); returns one Sample per prompt."""
    from tqdm.auto import tqdm

    engine = Engine(target)
    params = params or SamplingParams(max_tokens=128)
    out = []
    for i, prompt in enumerate(tqdm(prompts, desc="regenerate", disable=not progress)):
        ids = engine.prompt_ids(prompt)
        p = SamplingParams(**{**params.__dict__, "seed": (params.seed or 0) + i})
        res = engine.generate(ids, p)
        out.append(Sample(prompt, ids + res.token_ids, len(ids)))
    return out
