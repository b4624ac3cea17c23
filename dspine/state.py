"""The decode loop's per-request state, apart from the loop (decode.py): the result type, the one stop checker, the
phase clock, the drafter's context K/V, the draft tree's node profile, and the target caches' prefill, padding and
stacking that let rows join and leave a batch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspine.drafter import DSpineDraftModel
from dspine.prefix import PrefixCache
from dspine.sampling import SamplingParams
from dspine.stats import AcceptanceStats
from dspine.target import Target


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    method: str
    cached_tokens: int = 0  # prompt positions reused from the engine's prefix cache (not prefilled again)
    stats: AcceptanceStats | None = None
    seconds: float = 0.0
    timings: dict = field(default_factory=dict)
    batch_size: int = 1  # the most rows decoded together with this one
    # with params.logprobs: per token, (its log-probability, [(token id, log-probability)] of the top k)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class Stopper:
    """Appends tokens one at a time and decides when generation ends, identically for every method."""

    def __init__(self, target: Target, params: SamplingParams, on_token=None):
        self.target, self.params, self.on_token = target, params, on_token
        self.eos = set() if params.ignore_eos else target.eos_token_ids
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.logprobs: list | None = [] if params.logprobs is not None else None

    def push(self, tok: int, logprob=None) -> bool:
        if tok in self.eos:
            self.finish_reason = "stop"
            return True
        self.tokens.append(tok)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.params.stop:
            text = self.target.decode(self.tokens)
            hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
            if hits:
                self.text, self.finish_reason = text[: min(hits)], "stop"
                return True
        # after the stop-string check, so a stream never shows the stop string
        if self.on_token is not None and self.on_token(tok) is False:  # the client went away
            self.finish_reason = "abort"
            return True
        if len(self.tokens) >= self.params.max_tokens:
            self.finish_reason = "length"
            return True
        return False

    def result_text(self) -> str:
        return self.text if self.text is not None else self.target.decode(self.tokens)


class PhaseClock:
    """Seconds per phase of a batch's rounds (prefill, draft, propose, verify, commit, ar_step), the device
    synchronised at each boundary (off: no cost)."""

    def __init__(self, device: torch.device, on: bool):
        self.on, self.cuda = on, device.type == "cuda"
        self.totals: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        if not self.on:
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self._t
        self._t = now


def new_generator(device: torch.device, seed: int | None) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


class TreeProfile:
    """How often each node of the engine's draft tree was accepted, over the tree rounds that verified it
    (`DraftTree.prune` turns the rates into a smaller tree)."""

    def __init__(self, nodes: int):
        self.accepted, self.offered, self.rounds = [0] * nodes, [0] * nodes, 0

    def record(self, path: list[int], offered: list[int] | None = None) -> None:
        """A round verified nodes `offered` (default: all) and accepted `path` among them."""
        self.rounds += 1
        for i in range(len(self.offered)) if offered is None else offered:
            self.offered[i] += 1
        for i in path:
            self.accepted[i] += 1

    @property
    def rates(self) -> list[float]:
        return [a / max(o, 1) for a, o in zip(self.accepted, self.offered)]


class DraftContext:
    """The drafter's per-layer context K/V for committed positions (grows; block K/V are never kept). Features
    extended `lazy` (rounds that do not draft) wait, and are projected in one call when `kv` is next read — by
    the drafter, or to move the columns — so a batch that decodes AR for a while pays nothing per round."""

    def __init__(self, drafter: DSpineDraftModel):
        self.drafter = drafter
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._waiting: list[tuple[torch.Tensor, torch.Tensor]] = []

    def extend(self, feats: torch.Tensor, pos: torch.Tensor, lazy: bool = False) -> None:
        """feats (N, n, m*d), pos (N, n)."""
        self._waiting.append((feats, pos))
        if not lazy:
            self.project()

    def project(self) -> None:
        """Project the waiting columns now."""
        if not self._waiting:
            return
        feats, pos = (torch.cat(x, 1) for x in zip(*self._waiting))
        self._waiting = []
        new = self.drafter.context_kv(feats, pos)
        if self._kv is None:
            self._kv = new
        else:
            self._kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self._kv, new)]

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer (k, v) each (N, Hkv, C, hd), every extended column included."""
        self.project()
        return self._kv

    @kv.setter
    def kv(self, value: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._waiting:
            raise RuntimeError("the context's waiting columns must be projected before its K/V are replaced")
        self._kv = value


_PREFILL_MIN = 32  # a prompt shorter than this costs a forward about what one of this length does (weights stream)


def prefill(tgt: Target, ids: list[list[int]], layer_ids, prefix: PrefixCache | None = None):
    """Prompts -> (target cache, valid (N, L), logits at each prompt's last token (N, V), the layer features
    (N, L, F) or None, the positions each prompt reused from `prefix`). One forward over the prompts padded to the
    longest, or, where that padding would cost more than the extra forwards (or a prompt begins with one that
    `prefix` holds: only the rest is computed, from that position), one forward per prompt and the caches padded
    together with masked columns. Every prompt is then kept in `prefix`."""
    N, lens, dev = len(ids), [len(x) for x in ids], tgt.device
    L = max(lens)
    valid = torch.arange(L, device=dev)[None] < torch.tensor(lens, device=dev)[:, None]
    last = torch.tensor(lens, device=dev) - 1
    hits = [prefix.lookup(x, layer_ids) if prefix is not None else (0, None) for x in ids]
    if not any(e for _, e in hits) and (N == 1 or sum(max(n, _PREFILL_MIN) for n in lens) >= N * L):
        cache, pos = tgt.new_cache(), torch.arange(L, device=dev).expand(N, L)
        inp = torch.tensor([x + [x[-1]] * (L - len(x)) for x in ids], device=dev)
        logits, feats = tgt.forward(inp, cache, layer_ids, valid.long(), pos, logits_at=last)
        logits = logits[:, 0]
    else:
        caches, logits, feats = [], [], []
        for x, (m, entry) in zip(ids, hits):
            caches.append(entry.cache(tgt, m) if entry is not None else tgt.new_cache())
            rest = torch.tensor([x[m:]], device=dev)
            pos = torch.arange(m, len(x), device=dev)[None] if m else None
            lg, ft = tgt.forward(
                rest, caches[-1], layer_ids, position_ids=pos, logits_at=last.new_tensor([len(x) - 1 - m])
            )
            logits.append(lg[:, 0])
            if ft is not None and m:
                ft = torch.cat([entry.feats[None, :m].to(ft), ft], 1)
            feats.append(ft)
        feats = torch.cat([pad_columns(f, L) for f in feats]) if layer_ids is not None else None
        cache, logits = stack_caches(caches, L), torch.cat(logits)
    if prefix is not None:
        for i, x in enumerate(ids):
            prefix.insert(x, cache, i, feats[i] if feats is not None else None, layer_ids)
    return cache, valid, logits, feats, [m for m, _ in hits]


def pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (..., C, x) -> (..., width, x), zeros after: a cache's or a feature tensor's columns (masked)."""
    return torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[-2]))


def stack_caches(caches: list, width: int):
    """Target caches of rows side by side -> the first, holding every row (layers' (N, H, C, hd)), each
    padded to `width` columns."""
    first = caches[0]
    for j, layer in enumerate(first.layers):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = torch.cat([pad_columns(c.layers[j].keys, width) for c in caches])
            layer.values = torch.cat([pad_columns(c.layers[j].values, width) for c in caches])
    return first


def logprob_of(raw: torch.Tensor, tok: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """raw logits (V,) -> (log p(tok), the top k as (id, log p)) of the target's own distribution."""
    lsm = raw.float().log_softmax(-1)
    top = lsm.topk(k) if k else None
    return float(lsm[tok]), (list(zip(top.indices.tolist(), top.values.tolist())) if k else [])
