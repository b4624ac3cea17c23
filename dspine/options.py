"""How the engine's rounds draft, with each device's defaults: the CLI, the server and the benchmarks build engines
from one `EngineOptions` (no torch at import: the CLI's parsers are built from its fields)."""

from __future__ import annotations

from dataclasses import dataclass

from dspine.config import option

# Device defaults (EngineOptions.build). On a CPU every verified row costs compute: 3 drafts per round
# (bench/results/engine_cpu.md), the drafter running only the verified slots (engine_cpu_block.md), a single request's
# rounds through a small tree, and, with the fixed policy, AR rounds above 2 open requests (engine_cpu_conc.md).
CPU_DRAFT_LEN = 3
CPU_SPEC_MAX_BATCH = 2
CPU_DRAFT_TREE = "0000.1"
# elsewhere (a GPU verifies 33 rows in the time of 16 at this size): the T = 0 pick of 32 nodes
# (bench/results/tree_profile_t0.md), measured against the chain in bench/results/engine_cuda_trees.md
GPU_DRAFT_TREE = "000000000000000.00000001.000001.00001.0001000.0010.010.02.100.20"
DRAFT_POLICIES = ("fixed", "goodput")
PREFIX_CACHE_TOKENS = 16384  # SmolLM2-135M in fp32 holds ~58 KB per cached token (its K/V and the drafter's features)
# a replay's drafters share one prefix cache that holds a whole batch of agent prompts (adapt's evaluation, validation)
REPLAY_PREFIX_TOKENS = 65536


def default_draft_tree(device_type: str, cfg) -> str | None:
    """The tree a single request's rounds verify when neither a draft length nor a tree is given: a small one on
    a CPU, where every verified row costs, a wide one elsewhere; None where the drafter cannot draft it."""
    from dspine.decoding import DraftTree

    spec = CPU_DRAFT_TREE if device_type == "cpu" else GPU_DRAFT_TREE
    return spec if DraftTree.parse(spec).fits(cfg) else None


@dataclass(frozen=True)
class EngineOptions:
    """How rounds draft, as `dspine generate`/`serve` take it (the options are built from these fields); None:
    the device's default, resolved by `build`."""

    draft_len: int | None = option(
        help="drafts verified per round, 1..block-1 (on a CPU: 3, where each draft is a row of the target's verify "
        "and 3 measured fastest, bench/results/engine_cpu.md; the whole block elsewhere); an explicit length asks "
        "for chains"
    )
    draft_tree: str | None = option(
        help="a single request's rounds verify this tree of drafts, one target forward for all of its nodes: its "
        "leaves as rank paths, '.'-separated (0 = best candidate; 0000.1.01 = the best chain of 4, slot 1's second "
        "candidate, and the second-best successor of slot 1's best; ranks follow the transition table; when "
        "sampling, the 0 chain is the sampled one and a rank r beside it the r-th best other candidate); rounds of "
        f"several requests verify a chain of --draft-len; 'none': chains only (without --draft-len: {CPU_DRAFT_TREE} "
        "on a CPU, bench/results/engine_cpu.md; elsewhere a tree of 32 nodes, engine_cuda_trees.md; none where the "
        "drafter's block or top_k is too small for it; bench/tree_profile.py picks trees from measured acceptance)"
    )
    spec_max_batch: int | None = option(
        help="the most open requests a batched round drafts for; a fuller batch decodes its rounds "
        "autoregressively, where verifying drafts costs more than it returns (vLLM's disable_by_batch_size; "
        "bench/results/engine_cpu_conc.md); no limit, or 2 on a CPU with --draft-policy fixed"
    )
    draft_policy: str | None = option(
        help="goodput: each batched round drafts 0 .. --draft-len tokens, as many as the requests' acceptance so far "
        "is worth against the measured cost of verifying more rows (dspine/goodput.py); fixed: always --draft-len "
        "(goodput on a CPU, where every verified row costs compute; fixed elsewhere)",
        choices=DRAFT_POLICIES,
    )
    suffix_corpus: str | None = option(
        help='with suffix drafting (--drafter suffix or CHECKPOINT+suffix): a JSONL file of {"token_ids": [...], '
        '"workload": ...} rows — this target\'s token ids of past traffic — indexed per workload at start; served '
        "requests are added as they finish (dspine/suffix.py)"
    )
    prefix_cache_tokens: int | None = option(
        help="prompt tokens whose prefill is kept for reuse: a prompt that begins with an earlier prompt (an agent's "
        "next turn, a shared system prompt) prefills only the rest (dspine/prefix.py; SGLang's radix cache, vLLM's "
        f"prefix caching); 0: off (default {PREFIX_CACHE_TOKENS})"
    )
    suffix: bool = False  # suffix drafting on (from the drafter spec: `suffix`, `CHECKPOINT+suffix`)

    def build(self, target, drafter):
        """The engine for `target`'s device: the options given, that device's defaults for the rest. Raises
        ValueError naming the option that does not fit."""
        flags = (
            ("--draft-len", self.draft_len),
            ("--spec-max-batch", self.spec_max_batch),
            ("--draft-tree", self.draft_tree),
            ("--draft-policy", self.draft_policy),
        )
        for flag, v in flags:
            if v is not None and drafter is None:
                raise ValueError(f"{flag} needs a drafter")
        if self.suffix_corpus is not None and not self.suffix:
            raise ValueError("--suffix-corpus needs suffix drafting: --drafter suffix or --drafter CHECKPOINT+suffix")
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < 0:
            raise ValueError(f"--prefix-cache-tokens {self.prefix_cache_tokens}: 0 (off) or more")
        if self.draft_policy is not None and self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"--draft-policy {self.draft_policy!r}: one of {', '.join(DRAFT_POLICIES)}")
        draft_len, spec_max_batch, tree, draft_block = self.draft_len, self.spec_max_batch, self.draft_tree, None
        if drafter is not None and tree is None and draft_len is None:
            tree = default_draft_tree(target.device.type, drafter.config)
        cpu = target.device.type == "cpu"
        policy = self.draft_policy or ("goodput" if cpu else "fixed")
        if drafter is not None and cpu:
            if draft_len is None:
                draft_len = min(CPU_DRAFT_LEN, drafter.config.block_size - 1)
            if spec_max_batch is None and policy == "fixed":
                spec_max_batch = CPU_SPEC_MAX_BATCH
            draft_block = draft_len + 1  # only the slots that are verified: the drafter's forward shrinks with them
        tree = None if tree == "none" else tree
        from dspine.engine import Engine
        from dspine.prefix import PrefixCache
        from dspine.suffix import SuffixConfig, SuffixCorpus

        suffix = corpus = None
        if self.suffix:
            suffix, vocab = SuffixConfig(), target.info.vocab_size
            corpus = (
                SuffixCorpus.load(self.suffix_corpus, suffix, vocab)
                if self.suffix_corpus
                else SuffixCorpus(suffix, vocab)
            )
        tokens = PREFIX_CACHE_TOKENS if self.prefix_cache_tokens is None else self.prefix_cache_tokens
        prefix = PrefixCache(tokens) if tokens else None
        return Engine(
            target, drafter, draft_len, draft_block, spec_max_batch, tree, policy == "goodput", suffix, corpus, prefix
        )
