"""Prefix caching: a prompt that begins with an earlier prompt reuses that prompt's prefill.

An agent's conversation grows by a turn at a time — the prompt of turn n+1 is the prompt of turn n, the assistant's
answer and the tool's result — so without reuse every turn prefills thousands of tokens it already prefilled
(what SGLang's radix cache and vLLM's automatic prefix caching remove on a GPU). Design choices:

- **Whole prompts, longest common prefix.** An entry is one finished prefill: the prompt's token ids, the target's
  K/V of those positions and, when a drafter needs them, the target-layer features its context is projected from.
  A new prompt reuses the entry sharing its longest common prefix (at least `min_match` tokens) and prefills only
  the rest, from that position on; the last prompt token is always computed, so the first token's logits are the
  prefill's own. Keys carry their positions (RoPE), so reused columns are valid exactly as they were computed.
- **The features, not the drafter's K/V.** Storing the features keeps an entry independent of the rows it is
  batched with and of how the drafter decodes (int8 or not); re-projecting them is a small linear beside the
  target's prefill.
- **A token budget, least recently used out.** `max_tokens` bounds what all entries hold together; an entry
  that another one extends is dropped (the longer one serves both), then the least recently used go first.
- **Lossless.** Reused columns hold the same values a full prefill computes (up to the float rounding of a
  differently shaped forward, as a verify forward has), so the first token and every round verify as before.
  Caches whose layers are not plain growing K/V (sliding windows, quantised, linear attention) are never reused.

`Engine(prefix_cache=PrefixCache(...))` turns it on; `dspine serve` does by default (`--prefix-cache-tokens`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    ids: torch.Tensor  # (C,) the prompt's token ids, on the CPU
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per target layer (H, C, hd) keys and values
    feats: torch.Tensor | None  # (C, F) target-layer features, when a drafter reads them
    layers: tuple[int, ...] | None  # the target layers those features are of

    def __len__(self) -> int:
        return int(self.ids.numel())

    def cache(self, target, length: int):
        """A new target cache holding this entry's first `length` positions (copies: the entry is never
        written through the cache)."""
        cache = target.new_cache()
        for j, (k, v) in enumerate(self.kv):
            cache.update(k[None, :, :length].clone(), v[None, :, :length].clone(), j)
        return cache


def plain_layers(cache) -> bool:
    """Whether every layer of a target cache is a plain growing K/V (the only kind whose columns are reused)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


class PrefixCache:
    """Finished prompts' prefills, reused by prompts that begin with them. Thread-safe; `stats()` counts
    lookups, hits and reused tokens."""

    def __init__(self, max_tokens: int = 16384, min_match: int = 32):
        if max_tokens < 1 or min_match < 1:
            raise ValueError(f"prefix cache: max_tokens and min_match must be >= 1, got {max_tokens}, {min_match}")
        self.max_tokens, self.min_match = max_tokens, min_match
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self._serial = 0
        self._lock = threading.Lock()
        self.lookups = self.hits = self.reused_tokens = self.prompt_tokens = 0

    @property
    def tokens(self) -> int:
        return sum(len(e) for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _common(a: torch.Tensor, b: torch.Tensor) -> int:
        n = min(a.numel(), b.numel())
        diff = (a[:n] != b[:n]).nonzero()
        return int(diff[0]) if diff.numel() else n

    def lookup(self, ids: list[int], layers=None) -> tuple[int, PrefixEntry | None]:
        """-> (positions reusable, the entry holding them) for a prompt: the longest common prefix with any entry
        (with features of the target layers `layers`, when given), at most len(ids) - 1; (0, None) under
        `min_match`."""
        q, layers = torch.tensor(ids, dtype=torch.long), tuple(layers) if layers is not None else None
        best, hit = 0, None
        with self._lock:
            self.lookups += 1
            self.prompt_tokens += len(ids)
            for key, e in self._entries.items():
                if layers is not None and e.layers != layers:
                    continue
                m = min(self._common(e.ids, q), len(ids) - 1)
                if m > best:
                    best, hit = m, key
            if hit is None or best < self.min_match:
                return 0, None
            self._entries.move_to_end(hit)
            self.hits += 1
            self.reused_tokens += best
            return best, self._entries[hit]

    def insert(self, ids: list[int], cache, row: int, feats: torch.Tensor | None = None, layers=None) -> None:
        """Keep row `row`'s first len(ids) cache columns (and `feats` (≥ len(ids), F), that row's features of the
        target layers `layers`) as the entry for prompt `ids`. A prompt longer than the whole budget, or a cache of
        another layer kind, is not kept."""
        n, layers = len(ids), tuple(layers) if feats is not None else None
        if n < self.min_match or n > self.max_tokens or not plain_layers(cache):
            return
        q = torch.tensor(ids, dtype=torch.long)
        with self._lock:
            for key, e in list(self._entries.items()):
                common = self._common(e.ids, q)
                if common == len(e) <= n and e.layers in (None, layers):
                    del self._entries[key]  # the new entry extends it (and holds what it held)
                elif common == n <= len(e) and layers in (None, e.layers):
                    self._entries.move_to_end(key)  # already held by a longer entry
                    return
        kv = [(layer.keys[row, :, :n].clone(), layer.values[row, :, :n].clone()) for layer in cache.layers]
        entry = PrefixEntry(q, kv, feats[:n].clone() if feats is not None else None, layers)
        with self._lock:
            self._serial += 1
            self._entries[self._serial] = entry
            total = self.tokens
            while total > self.max_tokens:
                total -= len(self._entries.popitem(last=False)[1])

    def stats(self) -> dict:
        with self._lock:
            return {
                "entries": len(self._entries),
                "tokens": self.tokens,
                "lookups": self.lookups,
                "hits": self.hits,
                "reused_tokens": self.reused_tokens,
                "prompt_tokens": self.prompt_tokens,
            }
