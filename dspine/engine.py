"""The embedded engine: a target, an optional drafter and how rounds draft; `generate`, `generate_batch` and
`generate_stream` are thin wrappers over the one decode loop (decode.BatchDecode). `EngineOptions` holds the
decode-time choices with each device's defaults, so the CLI, the server and the benchmarks build engines alike.
"""

from __future__ import annotations

import time

import torch

from dspine.decode import BatchDecode
from dspine.decoding import DraftTree
from dspine.drafter import DSpineDraftModel
from dspine.goodput import DraftPolicy, SuffixChainPolicy, TreePolicy
from dspine.options import CPU_DRAFT_LEN, CPU_DRAFT_TREE, GPU_DRAFT_TREE, EngineOptions, default_draft_tree
from dspine.prefix import PrefixCache
from dspine.sampling import RequestError, SamplingParams, sample, warp_probs
from dspine.state import DraftContext, GenerationResult, TreeProfile
from dspine.suffix import SuffixConfig, SuffixCorpus
from dspine.target import Target

__all__ = [
    "CPU_DRAFT_LEN",
    "CPU_DRAFT_TREE",
    "GPU_DRAFT_TREE",
    "BatchDecode",
    "DraftContext",
    "Engine",
    "EngineOptions",
    "GenerationResult",
    "default_draft_tree",
    "generate_batch",
    "generate_stream",
]


class Engine:
    """Generate with a target alone (`method="ar"`) or with a DSpine/DFlash/post-backbone drafter: the target,
    the drafter and how rounds draft; every request decodes through decode.BatchDecode."""

    def __init__(
        self,
        target: Target,
        drafter: DSpineDraftModel | None = None,
        draft_len: int | None = None,
        draft_block: int | None = None,
        spec_max_batch: int | None = None,
        tree: DraftTree | str | None = None,
        goodput: bool = False,
        suffix: SuffixConfig | None = None,
        corpus: SuffixCorpus | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        """`draft_len`: drafts verified per round (1 .. block_size-1; default block_size-1), a decode-time
        choice: each draft costs a row of the target's verify forward. `draft_block`: block slots the drafter
        runs per round (draft_len+1 .. block_size; default block_size) — slots past the drafts are never
        verified, but in a bidirectional block the earlier slots attend to them. `spec_max_batch`: the most
        open rows a batched round drafts for (default: no limit); a fuller batch decodes its round
        autoregressively, where verifying drafts costs more than it returns (vLLM's
        `disable_by_batch_size`). The drafter's context follows those rounds too, so drafting resumes as soon
        as the batch is small again. `tree` (a DraftTree or its spec, decoding.py): rounds of a single open
        request verify that tree of drafts instead of a chain, the drafter running depth + 1 slots (draft_len
        then defaults to the depth); rounds of several requests, penalties and forced replays keep the chain.
        `goodput`: each batched round drafts 0 .. draft_len tokens, as many as maximise the tokens expected per
        second of the round (goodput.DraftPolicy: the rows' acceptance so far against the measured cost of
        verifying more rows) — on a CPU, where every verified row costs compute, a full batch drafts less.
        `suffix` (suffix.SuffixConfig): suffix drafts from the request's own prompt + output and from `corpus` (the
        deployment's past traffic, per workload) join every round: a single request's rounds merge them into the
        drafter's tree (every node; the drafter's forward skipped when the suffix expects `skip_drafter_tokens`
        accepted — or, with `tree_goodput`, the nodes and whether the drafter runs chosen by goodput from the
        rounds' measured cost and acceptance, goodput.TreePolicy); a batched round gives a row the suffix's chain
        instead of the drafter's where the suffix expects more. `prefix_cache` (prefix.PrefixCache): a prompt that
        begins with an earlier prompt prefills only the rest."""
        self.target = target
        self.prefix_cache = prefix_cache
        self.drafter = drafter.bind(target) if drafter is not None else None
        self.suffix, self.corpus = suffix, corpus
        if corpus is not None and suffix is None:
            raise ValueError("a suffix corpus needs suffix drafting (a drafter spec with +suffix)")
        names = ([drafter.config.method] if drafter is not None else []) + (["suffix"] if suffix is not None else [])
        self.method = "+".join(names) or "ar"
        self.speculative = bool(names)
        B = drafter.config.block_size if drafter is not None else 1
        self.tree = None
        if tree is not None:
            self.tree = DraftTree.for_drafter(tree, drafter.config if drafter is not None else None)
            draft_len = draft_len or self.tree.depth
        if draft_len is not None and not 1 <= draft_len <= B - 1:
            raise ValueError(f"draft_len must be in [1, {B - 1}] for this drafter (block size {B}), got {draft_len}")
        self.draft_len = draft_len or max(B - 1, 0)
        if draft_block is not None and not self.draft_len + 1 <= draft_block <= B:
            raise ValueError(f"draft_block must be in [{self.draft_len + 1}, {B}] (draft_len + 1 .. block size)")
        self.draft_block = draft_block or B
        if spec_max_batch is not None and spec_max_batch < 1:
            raise ValueError(f"spec_max_batch must be >= 1 (the most open rows a round drafts for): {spec_max_batch}")
        self.spec_max_batch = spec_max_batch
        if drafter is None and suffix is not None:  # suffix alone: a batched round's chain is at most this long
            self.draft_len = draft_len or suffix.max_depth
        # a single request's tree rounds: the engine's tree, or (suffix drafts beside a chain) the chain as a tree
        self.round_tree = self.tree
        if self.tree is None and suffix is not None and drafter is not None:
            self.round_tree = DraftTree.parse("0" * self.draft_len)
        paths = self.round_tree.paths if self.round_tree is not None else ()
        self.round_index = {p: i for i, p in enumerate(paths)}
        self.tree_profile = TreeProfile(len(paths))
        # with suffix drafts, which nodes a single request's round verifies (and whether the drafter runs), by goodput
        self.tree_policy = None
        if suffix is not None:
            self.tree_policy = TreePolicy(self.round_tree, self.tree_profile, suffix)
        self.policy = DraftPolicy(self.draft_len) if goodput and drafter is not None else None
        # suffix drafts alone: a batched round's chain length (rows padded) by goodput
        self.suffix_policy = SuffixChainPolicy(suffix.pad_batches) if suffix is not None and drafter is None else None
        self.max_positions = target.info.max_position_embeddings

    # ---- inputs ----------------------------------------------------------------------------------------
    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise RequestError("prompt is empty")
            ids = self.target.chat_ids([{"role": "user", "content": prompt}])
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if not any(str(m.get("content", "")).strip() for m in prompt):
                raise RequestError("messages have no content")
            ids = self.target.chat_ids(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = [int(t) for t in prompt]
        else:
            raise RequestError(f"prompt must be text, chat messages or token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.target.info.vocab_size]
        if bad:
            raise RequestError(f"prompt has token ids outside the vocabulary: {bad[:5]}")
        if len(ids) >= self.max_positions:
            raise RequestError(f"prompt has {len(ids)} tokens; the target's context is {self.max_positions}")
        return ids

    # ---- decoding --------------------------------------------------------------------------------------
    def pick(self, logits: torch.Tensor, params: SamplingParams, gen) -> int:
        """logits (V,) -> next token, exactly as AR decoding picks it."""
        if params.greedy:
            return int(logits.argmax())
        return int(sample(warp_probs(logits, params), gen))

    @torch.no_grad()
    def generate(
        self,
        prompt,
        params: SamplingParams | None = None,
        on_token=None,
        profile: bool = False,
        forced: list[int] | None = None,
        workload: str = "default",
    ) -> GenerationResult:
        """One request: a one-row BatchDecode run to its end. `on_token(token_id)` sees every committed token as
        it is committed; returning False aborts. `profile` fills `timings` (seconds per phase: prefill, draft,
        propose, verify, commit, ar_step), with a device sync at each boundary — slower, for benchmarks only.
        `forced`: a given continuation (another engine's greedy output, e.g. SGLang's) stands in for the
        target's choices, so the drafter's τ is measured on exactly that text (greedy only). `workload`: whose
        part of the suffix corpus drafts for it."""
        run = BatchDecode(
            self,
            [prompt],
            params,
            [on_token],
            forced=[forced] if forced is not None else None,
            profile=profile,
            workloads=[workload],
        )
        while not run.done:
            run.step()
        ((_, res),) = run.pop_finished()
        return res


def generate_batch(
    engine: Engine,
    prompts: list,
    params: SamplingParams | list[SamplingParams] | None = None,
    on_tokens: list | None = None,
    forced: list | None = None,
) -> list[GenerationResult]:
    """Decode several requests together (one target forward and one drafter forward per round for all rows)
    -> one GenerationResult per prompt. See BatchDecode."""
    if not prompts:
        return []
    run = BatchDecode(engine, prompts, params, on_tokens, forced=forced)
    out = dict(run.pop_finished())
    while not run.done:
        run.step()
        out.update(run.pop_finished())
    return [out[i] for i in range(len(prompts))]


def generate_stream(
    engine: Engine,
    prompts: list,
    params=None,
    concurrency: int = 8,
    timings: dict | None = None,
    workloads: list[str] | None = None,
) -> list[GenerationResult]:
    """Decode the prompts with at most `concurrency` in flight (continuous batching, as `dspine serve`
    schedules): each round runs every open row; a finished row leaves at once and the next prompt, prefilled
    apart, joins the running batch -> one GenerationResult per prompt, in order. `params`: one SamplingParams
    or one per prompt (drawing tokens alike, as BatchDecode's rows). `timings` (a dict) gains "prefill_s", the
    seconds spent prefilling joining prompts, and "rounds", the batched rounds run. `workloads[i]`: whose part of
    the suffix corpus drafts for prompt i (default: "default")."""
    if concurrency < 1:
        raise ValueError(f"concurrency {concurrency}: at least 1")
    per = params if isinstance(params, list) else [params] * len(prompts)
    out: dict = {}
    run, nxt = None, 0
    while nxt < len(prompts) or (run is not None and not run.done):
        free = concurrency - (len(run) if run is not None else 0)
        if free > 0 and nxt < len(prompts):
            take = list(range(nxt, min(nxt + free, len(prompts))))
            t0 = time.perf_counter()
            wl = [workloads[i] for i in take] if workloads is not None else None
            new = BatchDecode(engine, [prompts[i] for i in take], [per[i] for i in take], tags=take, workloads=wl)
            nxt = take[-1] + 1
            out.update(new.pop_finished())
            if timings is not None:
                timings["prefill_s"] = timings.get("prefill_s", 0.0) + time.perf_counter() - t0
            if len(new):
                if run is None or not len(run):
                    run = new
                else:
                    run.merge(new)
            continue  # fill up before the next round
        run.step()
        out.update(run.pop_finished())
        if timings is not None:
            timings["rounds"] = timings.get("rounds", 0) + 1
    return [out[i] for i in range(len(prompts))]
