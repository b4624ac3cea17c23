"""dspine's SGLang plugin (no fork): serve DSpine and post-backbone drafters with
`--speculative-algorithm DFLASH --speculative-draft-model-path <dspine export>`.

Installed with dspine (`pip install dspine[sglang]`), found by SGLang through the entry-point group
`sglang.srt.plugins` (`dspine = dspine.sglang.plugin:register`), which SGLang runs in the server and in every
scheduler process. `register`:
- registers `DSpineDraftModel` (models/dspine_draft.py) with SGLang's `ModelRegistry`: SGLang's DFlash draft
  model plus the injection after every injecting layer, so SGLang's KV-context materialisation, attention
  backends, CUDA graphs and verify are reused unchanged;
- hooks, through SGLang's `HookRegistry` (AROUND, deferring to SGLang for any other draft model), the two
  places where DFlash turns draft hidden states into tokens: `_maybe_build_draft_sampler` (the head folded
  into the draft CUDA graph) and `_greedy_sample_from_vocab_parallel_head` (the eager path). For a DSpine
  drafter both propose through the transition cache + greedy walk (core.py), fused Triton kernels on CUDA.
  Under tensor parallelism (`--tp-size N`) the target's head is sharded by vocabulary: the ranks merge their
  top-K candidates and sum their parts of the transition table (core.VocabShard), then walk alike.

Why DFLASH and not a registered algorithm: 0.5.17 checks `is_dflash()` and `== SpeculativeAlgorithm.DFLASH`
in the scheduler, memory sizing and CUDA-graph runners; a `SpeculativeAlgorithm.register`-ed name would have
to re-enter every one of those. The proposal step is the only behaviour DSpine changes, so it is hooked there.

Sampling (temperature > 0): SGLang 0.5.17's DFlash verifier is target-only — drafts are treated as point
masses, accepted with probability p(x) and resampled from norm(max(0, p − δ_x)) — which is exact for a
deterministic proposal such as the greedy walk. From 0.5.23 on, DFLASH has a candidate-selector contract
whose verifier takes the proposal q over K candidates per slot: the model then exposes the transition cache as
that selector (core.DSpineSelector) and these hooks stand aside, so the sampled walk with its real q is
verified by SGLang itself.

With DSPINE_SGLANG_TIMING=FILE, timing.py also times every decode round, its draft forward and its target
verify with CUDA events (`dspine bench --backend sglang` sets it and reports the split).

Version-specific names live in `SGLANG_TARGETS` here and in the model module; dspine/sglang_compat.py lists
them for the CI check against the 0.5.17 and 0.5.23 wheels.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

WORKER = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2"
SGLANG_TARGETS = {
    "build_sampler": f"{WORKER}._maybe_build_draft_sampler",
    "eager_sample": f"{WORKER}._greedy_sample_from_vocab_parallel_head",
    # timing only (DSPINE_SGLANG_TIMING): the round, the draft runner's forward, the target verify
    "round": f"{WORKER}.forward_batch_generation",
    "runner_forward": "sglang.srt.model_executor.model_runner.ModelRunner.forward",
    "target_forward": "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
}


def _is_dspine(worker) -> bool:
    """A DSpine drafter on a worker without the candidate-selector contract (0.5.17): the hooks propose.
    With the contract (>= 0.5.23, `worker.selector`) SGLang walks DSpine's lattice itself."""
    return hasattr(getattr(worker, "draft_model", None), "dspine_state") and getattr(worker, "selector", None) is None


def _build_sampler(original, self, *args, **kwargs):
    if not _is_dspine(self):
        return original(self, *args, **kwargs)
    from sglang.srt.runtime_context import get_exec

    from .core import DSpineDraftSampler

    model = self.draft_model
    if int(self.block_size) != int(model.block_size):
        raise ValueError(
            f"--speculative-num-draft-tokens {self.block_size} differs from the DSpine drafter's "
            f"block_size {model.block_size}: the injection chain is trained for one block size"
        )
    head = _vocab_shard(model, self._target_worker.model_runner.model.lm_head)
    logger.info(
        "dspine: transition-cache proposal folded into the draft CUDA graph (top_k %d, layers %s, tp %d)",
        model.dspine.top_k,
        model.inject_layers,
        1 if head.group is None else int(head.group.world_size),
    )
    return DSpineDraftSampler(model, head, self.block_size, max(get_exec().graph.cuda_graph_config.decode.bs))


def _eager_sample(original, self, *args, hidden_states=None, lm_head=None, **kwargs):
    if not _is_dspine(self):
        return original(self, *args, hidden_states=hidden_states, lm_head=lm_head, **kwargs)
    from .core import propose_from_state

    B = int(self.block_size)
    slots = hidden_states.view(-1, B - 1, hidden_states.shape[-1])  # (bs, B-1, d)
    return propose_from_state(self.draft_model, slots, _vocab_shard(self.draft_model, lm_head))


def _vocab_shard(model, lm_head):
    """This rank's part of the target's head (core.VocabShard), with SGLang's tensor-parallel group."""
    from sglang.srt.distributed import get_tp_group

    from .core import VocabShard

    return VocabShard.of(lm_head, model.transfer_codes.shape[0], get_tp_group())


def register() -> None:
    """Entry point of the `sglang.srt.plugins` group."""
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    ModelRegistry.register("dspine.sglang.plugin.models", overwrite=True, strict=True)
    HookRegistry.register(SGLANG_TARGETS["build_sampler"], _build_sampler, HookType.AROUND)
    HookRegistry.register(SGLANG_TARGETS["eager_sample"], _eager_sample, HookType.AROUND)
    path = os.environ.get("DSPINE_SGLANG_TIMING")
    if path:
        from .timing import RoundTimer

        timer = RoundTimer(path)
        HookRegistry.register(SGLANG_TARGETS["round"], timer.round, HookType.AROUND)
        HookRegistry.register(SGLANG_TARGETS["runner_forward"], timer.draft, HookType.AROUND)
        HookRegistry.register(SGLANG_TARGETS["target_forward"], timer.verify, HookType.AROUND)
