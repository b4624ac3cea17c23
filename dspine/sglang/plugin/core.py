"""The plugin's SGLang-free parts, tested on CPUs: the `dspine_config` section, the weight split between
SGLang's DFlash loader and DSpine's own modules, the injection on SGLang's flat token layout, the block
proposal (transition cache + greedy walk) that runs where SGLang 0.5.17's DFlash takes its argmax, and the
transition lattice SGLang >= 0.5.23 walks itself (greedy, or sampled with q for its verifier).

SGLang lays the draft block out flat: `bs * B` rows, block b at rows [b*B, (b+1)*B), slot 0 the anchor (the
bonus token). Everything here reshapes that view; nothing allocates per call beyond what torch ops return,
so the draft CUDA graph captures the proposal together with the draft forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dspine import kernels
from dspine.config import ConfigError, from_dict
from dspine.decoding import greedy_transition_walk, scores_table, top_candidates, walk_table
from dspine.drafter import VARIANTS, DSpineSection, Injection

PluginConfig = DSpineSection  # `dspine_config` of an exported checkpoint (export.py writes it)


def parse_dspine_config(hf_config) -> tuple[PluginConfig, list[int]]:
    """A transformers config (or dict) of a DSpine export -> (typed section, layers that inject)."""
    raw = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    section = raw.get("dspine_config")
    if not isinstance(section, dict):
        raise ConfigError(
            "config.json has no dspine_config section: export the drafter with `dspine export --to sglang`"
        )
    cfg = from_dict(PluginConfig, section, "dspine_config")
    if cfg.method not in VARIANTS or VARIANTS[cfg.method] == "none":
        raise ConfigError(
            f"dspine_config.method {cfg.method!r}: DSpineDraftModel serves "
            f"{sorted(k for k, v in VARIANTS.items() if v != 'none')}; a dflash drafter is "
            "exported as SGLang's own DFlashDraftModel"
        )
    n = int(raw["num_hidden_layers"])
    layers = list(range(n)) if VARIANTS[cfg.method] == "all" else [n - 1]
    if min(cfg.transfer_rank, cfg.message_size, cfg.top_k) < 1:
        raise ConfigError("dspine_config: transfer_rank, message_size and top_k must be >= 1")
    return cfg, layers


def dspine_weight_names(inject_layers: list[int]) -> set[str]:
    """Names DSpine loads itself (SGLang's DFlash loader would silently skip them)."""
    names = {f"injections.{layer}.{p}" for layer in inject_layers for p in Injection.PARAMS}
    return names | {"transfer_codes"}


def split_weights(weights, inject_layers: list[int]):
    """Iterable of (name, tensor) -> (DSpine's {name: tensor}, the rest for DFlash's loader). A name under
    `injections.` or `transfer_codes` that this config does not have is an error, and so is a missing one."""
    want = dspine_weight_names(inject_layers)
    mine, rest = {}, []
    for name, w in weights:
        key = name[len("model.") :] if name.startswith("model.") else name
        if key.startswith("injections.") or key == "transfer_codes":
            if key not in want:
                raise ValueError(
                    f"checkpoint weight {name!r} does not belong to this dspine_config "
                    f"(injecting layers {inject_layers})"
                )
            mine[key] = w
        else:
            rest.append((name, w))
    missing = sorted(want - set(mine))
    if missing:
        raise ValueError(f"checkpoint lacks DSpine weights {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    return mine, rest


def inject_flat(
    inj: Injection,
    h: torch.Tensor,
    anchor_code: torch.Tensor,
    block_size: int,
    residual: torch.Tensor | None = None,
):
    """h (bs*B, d) a layer's output, residual (bs*B, d) or None as SGLang's layers hand the stream over (the full
    stream x = h + residual), anchor_code (bs, r) -> (x updated, f (bs*B, r), x before the write)."""
    bs, fused = h.shape[0] // block_size, kernels.enabled(h)
    if fused:
        from dspine.kernels.injection import add_sumsq, fused_injection, injection_variant
    if fused and injection_variant(width=h.shape[-1]) == "gemm":  # the add and |x|² in one launch
        x, sq = add_sumsq(h, residual)
    else:
        x, sq = (h if residual is None else h + residual), None
    xb = x.view(bs, 1, block_size, -1)
    out, f = fused_injection(inj, xb, anchor_code[:, None], sumsq=sq) if fused else inj(xb, anchor_code[:, None])
    return out.reshape(h.shape), f.reshape(h.shape[0], -1), x


class VocabShard:
    """The target's lm_head as one tensor-parallel rank holds it, and how the ranks agree on a proposal.

    SGLang shards the head by vocabulary (`VocabParallelEmbedding`: contiguous ascending ranges, each padded;
    `shard_indices` says where a rank's range starts and how many real rows it has). DFlash's own sampler
    takes each rank's argmax and all-gathers (max, id); DSpine needs more than one argmax:
    - the candidate sets: each rank's top-K of its rows (ids made global), all-gathered, the best K of the
      tp·K kept — the same set a full head gives (ties aside);
    - the transition table S[p, c] = norm(h_p) · head[c]: every rank scores the candidates whose rows it
      holds (zero rows for the others, so their scores are exactly 0) and the tables are summed across the
      group — K·K floats per slot on the wire instead of gathering K head rows of width d.
    The injection, the codes and the walk are replicated (the draft layers' outputs are all-reduced by
    SGLang's row-parallel projections), so every rank walks to the same tokens. Without a group (one rank)
    everything is the single-GPU path unchanged.

    `group` is SGLang's GroupCoordinator or anything with `world_size`, `all_gather_into_tensor(out, inp)` and
    `all_reduce(t) -> t`."""

    def __init__(self, weight: torch.Tensor, vocab: int, start: int = 0, group=None):
        if group is not None and int(group.world_size) == 1:
            group = None
        if group is None and start:
            raise ValueError("a vocabulary shard that starts past 0 needs its tensor-parallel group")
        self.weight, self.start, self.group = weight[: int(vocab)], int(start), group

    @classmethod
    def of(cls, lm_head, vocab: int, group=None) -> VocabShard:
        """SGLang's lm_head (with `shard_indices` under tensor parallelism) -> this rank's shard; `vocab` the
        drafter's vocabulary (its code table's rows): on one rank the head's first `vocab` rows (SGLang pads
        past them)."""
        shard = getattr(lm_head, "shard_indices", None)
        if group is None or int(group.world_size) == 1:
            return cls(lm_head.weight, vocab)
        if shard is None:
            raise ValueError("a tensor-parallel lm_head without shard_indices: its vocabulary ranges are unknown")
        if int(shard.num_added_elements):
            raise ValueError("the target's lm_head has added vocabulary rows: DSpine's code table does not cover them")
        end = int(shard.org_vocab_start_index) + int(shard.num_org_elements)
        if end > vocab:
            raise ValueError(f"the target's vocabulary shard ends at row {end}, past the drafter's {vocab} codes")
        return cls(lm_head.weight, int(shard.num_org_elements), int(shard.org_vocab_start_index), group)

    def top_candidates(self, hidden: torch.Tensor, k: int, fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (N, d) -> the K best global ids (N, K) and their logits (N, K) fp32 over the whole vocabulary."""
        ids, vals = top_candidates(hidden, self.weight, k, fast=fast)
        if self.group is None:
            return ids, vals
        N, P = hidden.shape[0], int(self.group.world_size)
        if ids.shape[1] < k:  # a shard of fewer than K rows: pad with entries that never win
            pad = k - ids.shape[1]
            ids = torch.cat([ids, ids.new_zeros(N, pad)], 1)
            vals = torch.cat([vals, vals.new_full((N, pad), float("-inf"))], 1)
        ids = ids + self.start
        all_ids, all_vals = ids.new_empty(P * N * k), vals.new_empty(P * N * k)
        self.group.all_gather_into_tensor(all_ids, ids.reshape(-1).contiguous())
        self.group.all_gather_into_tensor(all_vals, vals.reshape(-1).contiguous())
        all_ids = all_ids.view(P, N, k).permute(1, 0, 2).reshape(N, P * k)
        best, at = all_vals.view(P, N, k).permute(1, 0, 2).reshape(N, P * k).topk(k, dim=-1)
        return all_ids.gather(1, at), best

    def scores(self, inj: Injection, norm: nn.Module, codes, h_pre, f, cand) -> torch.Tensor:
        """Under TP: decoding.scores_table over the whole vocabulary, S (N, B-2, K, K) for global candidates cand
        (one rank walks through decoding.greedy_transition_walk itself)."""
        fast = kernels.fused_width_ok(h_pre)
        # a table of the candidates' own rows: this rank's head rows (zero where another rank holds the row)
        # and every candidate's code, indexed by position, so scores_table runs unchanged
        local = cand - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = self.weight[local.clamp(0, self.weight.shape[0] - 1)] * mine[..., None].to(self.weight.dtype)
        at = torch.arange(cand.numel(), device=cand.device).view(cand.shape)
        S = scores_table(inj, norm, rows.reshape(cand.numel(), -1), codes[cand.reshape(-1)], h_pre, f, at, fast)
        return self.group.all_reduce(S.contiguous())


def propose_block(
    slots: torch.Tensor,
    h_pre: torch.Tensor,
    f: torch.Tensor,
    inj: Injection,
    norm: nn.Module,
    head: torch.Tensor | VocabShard,
    codes: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """Greedy proposal for one block per row: slots (bs, B-1, d) slots 1..B-1 after the drafter's final norm
    (what SGLang's DFlash takes its argmax of), h_pre (bs, B, d), f (bs, B, r), head (V, d) the target's
    lm_head or this rank's VocabShard of it, codes (V, r) -> tokens (bs, B-1), through dspine's own
    greedy_transition_walk (on one rank) or the shard's merged candidates and summed table (under TP)."""
    bs, Bm1, d = slots.shape
    shard = head if isinstance(head, VocabShard) else VocabShard(head, head.shape[0])
    cand, _ = shard.top_candidates(slots.reshape(bs * Bm1, d), top_k, kernels.enabled(slots))
    cand = cand.view(bs, Bm1, -1)
    if shard.group is None:
        return greedy_transition_walk(cand, inj, norm, shard.weight, codes, h_pre, f)
    return walk_table(cand, shard.scores(inj, norm, codes, h_pre, f, cand))


def vocab_rows(model, head: torch.Tensor) -> torch.Tensor:
    """The target's lm_head (V_padded, d) without the rows SGLang pads past the vocabulary (which must never
    become candidates: they have no transfer code)."""
    return head[: model.transfer_codes.shape[0]]


@torch.no_grad()  # SGLang calls the sampler outside the model's no_grad; the fused kernels have no backward
def propose_from_state(model, slots: torch.Tensor, head: torch.Tensor | VocabShard) -> torch.Tensor:
    """slots (bs, B-1, d) normed draft hidden of slots 1..B-1; the rest from the DSpine model's forward
    (`model.dspine_state`: h_pre, f); head (V_padded, d) the target's lm_head, or this rank's VocabShard of it
    -> tokens (bs*(B-1),)."""
    bs, Bm1, _ = slots.shape
    st = model.dspine_state
    last = str(max(model.inject_layers))
    return propose_block(
        slots,
        st["h_pre"].view(bs, Bm1 + 1, -1),
        st["f"].view(bs, Bm1 + 1, -1),
        model.injections[last],
        model.norm_for_scores,
        head if isinstance(head, VocabShard) else VocabShard(head, model.transfer_codes.shape[0]),
        model.transfer_codes,
        model.dspine.top_k,
    ).reshape(-1)


class DSpineDraftSampler:
    """Stands where SGLang's `_DflashDraftSampler` stands (same `out` buffer and call signature): called on
    the draft forward's hidden states inside the draft CUDA graph, it writes the proposed tokens of slots
    1..B-1 of every block into `out`."""

    def __init__(self, model, head: torch.Tensor | VocabShard, block_size: int, max_bs: int):
        if not isinstance(head, VocabShard):  # one rank: the head's rows of the drafter's vocabulary
            head = VocabShard(head, model.transfer_codes.shape[0])
        self.model, self.head, self.block_size = model, head, int(block_size)
        self.out = torch.empty(int(max_bs) * (self.block_size - 1), dtype=torch.int64, device=head.weight.device)

    def __call__(self, hidden_states: torch.Tensor, input_ids=None) -> None:
        """hidden_states (bs*B, d) after the final norm."""
        B = self.block_size
        slots = hidden_states.view(-1, B, hidden_states.shape[-1])[:, 1:]
        toks = propose_from_state(self.model, slots, self.head)
        self.out[: toks.shape[0]].copy_(toks)


@torch.no_grad()
def candidates(hidden: torch.Tensor, head: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (N, d) normed draft states, head (V, d) -> top-K ids (N, K) and their logits (N, K), fp32: the
    candidate sets C_t and unconditioned scores of SGLang >= 0.5.23's `compute_candidates` contract."""
    return top_candidates(hidden, head, top_k, fast=kernels.enabled(hidden))


class DSpineSelector:
    """DSpine's transition cache in the shape of SGLang >= 0.5.23's DFLASH candidate selector
    (`draft_model.candidate_selector`: `top_k`, `build_lattice`, `sample_path`). SGLang then walks the lattice
    itself inside the draft CUDA graph — greedy, or sampled at the request's temperature with the proposal q
    over the K candidates handed to its verifier, which makes T > 0 lossless against the real q.
    `sample_path` is SGLang's own walk, passed in by the model module (the one SGLang-version-specific part)."""

    def __init__(self, model, sample_path=None):
        self.model, self._sample_path = model, sample_path
        self.top_k = int(model.dspine.top_k)

    @torch.no_grad()
    def build_lattice(
        self,
        *,
        candidate_ids: torch.Tensor,
        unary_logits: torch.Tensor,
        hidden_states: torch.Tensor,
        anchor_token_ids: torch.Tensor,
    ) -> torch.Tensor:
        """candidate_ids / unary_logits (bs, B-1, K) of slots 1..B-1, hidden_states (bs, B-1, d) -> scores
        (bs, B-1, K, K), score[b, e, p, c] for candidate c of slot e+1 after candidate p of slot e: slot 1's row
        is its own logits whatever p (its predecessor, the anchor, is decoded: the injection already used it);
        slots >= 2 are S_t[p, c] from the redone last write (decoding.transition_scores / its fused kernel)."""
        bs, Bm1, K = candidate_ids.shape
        m, st = self.model, self.model.dspine_state
        last = str(max(m.inject_layers))
        S = scores_table(
            m.injections[last],
            m.norm_for_scores,
            m.lm_head.weight,
            m.transfer_codes,
            st["h_pre"].view(bs, Bm1 + 1, -1),
            st["f"].view(bs, Bm1 + 1, -1),
            candidate_ids,
            kernels.fused_width_ok(hidden_states),
        )
        first = unary_logits[:, :1, None, :].float().expand(bs, 1, K, K)
        return torch.cat([first, S.float()], dim=1)

    def sample_path(self, **kw):
        return self._sample_path(self, **kw)
