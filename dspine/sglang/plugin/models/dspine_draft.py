"""`DSpineDraftModel` for SGLang: SGLang's DFlash draft model (its RadixAttention layers, context-KV
materialisation, CUDA graphs and verify stay SGLang's) plus DSpine's gated adjacent injection after the
injecting layers and the state the transition-cache proposal needs.

SGLang finds this module through `ModelRegistry.register("dspine.sglang.plugin.models")` (the plugin's
entry point) and builds it for checkpoints whose `architectures` is ["DSpineDraftModel"].

Where SGLang has DFLASH's candidate-selector contract (>= 0.5.23: `draft_model.candidate_selector`,
`compute_candidates`, a `lm_head` the worker points at the target's), the model offers the transition cache
through it (core.DSpineSelector) and SGLang proposes and verifies — greedy or sampled with q — by itself;
on 0.5.17 the plugin's sampler hook proposes (greedy walk). This import is the version switch.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.models.dflash import DFlashDraftModel
from sglang.srt.runtime_context import get_parallel
from torch import nn

from dspine.drafter import Injection, RMSNorm
from dspine.sglang.plugin.core import (
    DSpineSelector,
    candidates,
    inject_flat,
    parse_dspine_config,
    split_weights,
    vocab_rows,
)

try:  # SGLang >= 0.5.23
    from sglang.srt.models.dflash import CandidateSelector as _SGLangSelector
except ImportError:  # 0.5.17
    _SGLangSelector = None


class DSpineDraftModel(DFlashDraftModel):
    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config=config, quant_config=quant_config, prefix=prefix)
        if int(get_parallel().tp_size) != 1 and _SGLangSelector is not None:
            # the selector's lattice reads the whole head (core.DSpineSelector); the 0.5.17 hooks merge shards
            raise NotImplementedError(
                "the dspine SGLang plugin serves DSpine drafters under tensor parallelism on SGLang 0.5.17's "
                "hooks only; with DFLASH's candidate selector (>= 0.5.23) use --tp-size 1"
            )
        self.dspine, self.inject_layers = parse_dspine_config(config)
        d, r, s = int(config.hidden_size), self.dspine.transfer_rank, self.dspine.message_size
        self.injections = nn.ModuleDict({str(i): Injection(d, r, s) for i in self.inject_layers})
        # the code table is a lookup, kept fp32 whatever the serving dtype
        self.register_buffer("transfer_codes", torch.zeros(int(config.vocab_size), r, dtype=torch.float32))
        # the transition scores' norm is the final norm; a plain-torch view of its weight (kernels read .weight,
        # .eps) — not a submodule, so it is neither loaded nor listed twice
        score_norm = RMSNorm(d, float(getattr(config, "rms_norm_eps", 1e-6)))
        score_norm.weight = self.norm.weight
        object.__setattr__(self, "norm_for_scores", score_norm)
        self.dspine_state: dict[str, torch.Tensor] = {}
        if _SGLangSelector is not None:
            self.lm_head = None  # the worker points it at the target's head before capture
            self.candidate_selector = DSpineSelector(self, sample_path=_SGLangSelector.sample_path)

    def compute_candidates(self, hidden: torch.Tensor):
        """SGLang >= 0.5.23: hidden (N, d) -> candidate ids (N, K), their logits (N, K) fp32."""
        return candidates(hidden, vocab_rows(self, self.lm_head.weight), self.candidate_selector.top_k)

    @torch.no_grad()
    def forward(
        self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False, pp_proxy_tensors=None
    ) -> LogitsProcessorOutput:
        """input_ids/positions (bs*B,), the block flat; input_embeds (bs*B, d) the target's embedding."""
        if input_embeds is None:
            raise ValueError("DSpineDraftModel requires input_embeds (the target's embedding of the block)")
        h, residual = input_embeds, None
        if h.numel() == 0:
            return LogitsProcessorOutput(next_token_logits=None, hidden_states=h)
        B = int(self.block_size)
        anchor_code = self.transfer_codes[input_ids.view(-1, B)[:, 0]].to(h.dtype)  # (bs, r)
        if not self.dspine.anchor_write:  # slot 1 without the anchor's write (DSpineSection.anchor_write)
            anchor_code = torch.zeros_like(anchor_code)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, h, forward_batch, residual)
            inj = self.injections[str(i)] if str(i) in self.injections else None
            if inj is None:
                continue
            # the injection reads and writes the full residual stream (h + residual)
            h, f, x = inject_flat(inj, h, anchor_code, B, residual)
            residual = None
            if i == last:
                self.dspine_state["h_pre"], self.dspine_state["f"] = x, f
        h = self.norm(h) if residual is None else self.norm(h, residual)[0]
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=h)

    def load_weights(self, weights):
        mine, rest = split_weights(weights, self.inject_layers)
        own = {**dict(self.injections.named_parameters(prefix="injections")), "transfer_codes": self.transfer_codes}
        for name, w in mine.items():
            if tuple(w.shape) != tuple(own[name].shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} vs model {tuple(own[name].shape)}")
            own[name].data.copy_(w.to(own[name].dtype))
        super().load_weights(rest)


EntryClass = [DSpineDraftModel]
