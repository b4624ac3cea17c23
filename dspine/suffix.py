"""Suffix drafting: drafts with no weights, from what the request and the deployment's past traffic already hold.

Agent traffic copies — tool results, file contents, ids, whole earlier turns come back in the target's output —
and a structure over token sequences predicts those spans far better than any model drafter (SuffixDecoding;
vLLM's `suffix` method; SGLang's NGRAM with an external corpus). Design choices:

- **One index type, two scopes.** `SuffixIndex` maps every n-gram (n = 1 .. `max_match`) of its sequences to where
  it ends; a query takes the longest suffix of the context (prompt + output so far) that occurs, and the
  continuations after its occurrences (the most recent `max_occurrences`) form a trie whose node counts are the
  empirical frequency of each continuation — the subtree a suffix tree would hold below that match. A request has
  its own index over its prompt and output, grown token by token; a deployment has one `SuffixCorpus` per
  workload over its finished requests (and any corpus it loads), bounded by a token budget: the oldest sequences
  are evicted and their index entries dropped lazily (the index is rebuilt once dead entries pass half).
- **Scoring.** A node's score is the fraction of the match's occurrences that continue through it (its count over
  the occurrences), a probability estimate of acceptance; the request's own matches and the corpus's are pooled
  after weighting by match length (a longer match is more specific). Only nodes scoring at least `min_score` are
  kept, and the draft is as deep as the match allows: at most `depth_per_match` × the match length (SuffixDecoding's
  adaptive draft size), capped at `max_depth`.
- **Deterministic drafts.** A suffix draft proposes tokens with certainty (q = 1 on its token): greedy
  verification and the tree's recursive rejection sampling accept them exactly as they do a ranked node, so output
  stays the target's own (verify.verify_tree_sampled).

`SuffixDraft` is a small tree (tokens, parents, scores) that `decoding.merge_drafts` merges into a drafter's tree.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from dspine.config import ConfigError


@dataclass(frozen=True)
class SuffixConfig:
    """How suffix drafts are found and sized (the `suffix` section of a drafter spec)."""

    max_match: int = 8  # the longest context suffix looked up
    min_match: int = 2  # shorter matches propose nothing (one shared token is noise)
    max_occurrences: int = 64  # the most recent occurrences of a match whose continuations are counted
    max_depth: int = 24  # the deepest draft
    depth_per_match: float = 4.0  # draft depth at most this × the match length (SuffixDecoding's α)
    max_nodes: int = 24  # suffix nodes per round at most
    min_score: float = 0.1  # a node continued by a smaller fraction of the occurrences is not drafted
    skip_drafter_tokens: float = 4.0  # a suffix draft expecting this many accepted tokens runs without the drafter
    # on: a single request's round verifies the nodes (and runs the drafter) that goodput picks (goodput.TreePolicy);
    # off: every node, the drafter skipped only by skip_drafter_tokens (bench/results/agent_race_goodput.md: on this
    # CPU the choice measured no faster, so it is off by default)
    tree_goodput: bool = False
    # on: a batched round of suffix drafts alone pads rows with shorter matches to the length goodput picks
    # (goodput.SuffixChainPolicy); off: the chain every open row fills (bench/results/agent_race_c4_pad.md: on this
    # CPU at 4 in flight padding measured no faster, so it is off by default)
    pad_batches: bool = False
    corpus_tokens: int = 2_000_000  # the global corpus's budget per workload (oldest sequences evicted)

    def __post_init__(self):
        if not 1 <= self.min_match <= self.max_match:
            raise ConfigError(f"suffix: need 1 <= min_match <= max_match, got {self.min_match}, {self.max_match}")
        for name in ("max_occurrences", "max_depth", "max_nodes", "corpus_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"suffix: {name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.min_score <= 1 or self.depth_per_match <= 0:
            raise ConfigError("suffix: min_score in (0, 1] and depth_per_match > 0")


@dataclass
class SuffixDraft:
    """A tree of deterministic drafts: node i holds tokens[i] and hangs below parents[i] (-1: the anchor); scores[i]
    is the fraction of the match's occurrences that continue through it (an estimate of the chance it is accepted);
    parents come first. `match`: the context suffix length it was found by."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    match: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def best_path(self) -> list[int]:
        """Node indices of the highest-scoring chain from the root (each step the best-scoring child)."""
        path, at = [], -1
        while True:
            kids = [i for i, p in enumerate(self.parents) if p == at]
            if not kids:
                return path
            at = max(kids, key=lambda i: self.scores[i])
            path.append(at)

    def subset(self, keep: list[int]) -> SuffixDraft:
        """The draft of nodes `keep` (each with its parent among them), in their order here."""
        keep = sorted(keep)
        at = {i: j for j, i in enumerate(keep)}
        return SuffixDraft(
            tokens=[self.tokens[i] for i in keep],
            parents=[at[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
            scores=[self.scores[i] for i in keep],
            match=self.match,
        )

    def expected_tokens(self) -> float:
        """Expected accepted drafts along the best chain (the sum of its nodes' acceptance estimates)."""
        return sum(self.scores[i] for i in self.best_path())


class SuffixIndex:
    """N-grams (n = 1 .. max_match) of token sequences -> the positions where they end. Sequences are appended to
    (`extend`) and may be evicted oldest first (`evict_to`)."""

    def __init__(self, max_match: int):
        self.max_match = max_match
        self.seqs: dict[int, list[int]] = {}  # serial -> tokens
        self.keys: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> [(serial, end position)]
        self.order: deque[int] = deque()  # serials, oldest first
        self.next_serial = 0
        self.tokens = 0
        self.entries = 0  # (serial, end) entries in `keys`
        self.dead = 0  # those of evicted sequences

    def add(self, tokens: list[int]) -> int:
        """A new sequence -> its serial."""
        s = self.next_serial
        self.next_serial += 1
        self.seqs[s] = []
        self.order.append(s)
        self.extend(s, tokens)
        return s

    def extend(self, serial: int, tokens: list[int]) -> None:
        seq = self.seqs[serial]
        for t in tokens:
            seq.append(int(t))
            end = len(seq)
            for n in range(1, min(self.max_match, end) + 1):
                self.keys.setdefault(tuple(seq[end - n : end]), []).append((serial, end))
            self.entries += min(self.max_match, end)
        self.tokens += len(tokens)

    def evict_to(self, budget: int) -> None:
        """Drop the oldest sequences until at most `budget` tokens remain (the newest is always kept)."""
        while self.tokens > budget and len(self.order) > 1:
            s = self.order.popleft()
            n = len(self.seqs.pop(s))
            self.tokens -= n
            self.dead += sum(min(self.max_match, end) for end in range(1, n + 1))
        if self.dead > self.entries // 2:
            self._rebuild()

    def _rebuild(self) -> None:
        self.keys = {k: kept for k, v in self.keys.items() if (kept := [e for e in v if e[0] in self.seqs])}
        self.entries -= self.dead
        self.dead = 0

    def continuations(self, context: list[int], cfg: SuffixConfig) -> tuple[int, list[list[int]]]:
        """The longest suffix of `context` (>= min_match) that occurs -> (its length, the token sequences after its
        most recent occurrences, each at most max_depth long); (0, []) when none occurs."""
        for n in range(min(cfg.max_match, len(context)), cfg.min_match - 1, -1):
            occ = self.keys.get(tuple(context[-n:]))
            if not occ:
                continue
            conts = []
            for serial, end in reversed(occ):
                seq = self.seqs.get(serial)
                if seq is None or end >= len(seq):  # evicted, or nothing follows yet
                    continue
                conts.append(seq[end : end + cfg.max_depth])
                if len(conts) >= cfg.max_occurrences:
                    break
            if conts:
                return n, conts
        return 0, []


def draft_from(matches: list[tuple[int, list[list[int]], float]], cfg: SuffixConfig) -> SuffixDraft:
    """[(match length, continuations, weight)] -> the scored tree of their continuations, pooled, pruned to the
    nodes scoring at least min_score, as deep as the longest match allows, best first within max_nodes."""
    matches = [m for m in matches if m[1]]
    if not matches:
        return SuffixDraft()
    depth = min(cfg.max_depth, max(1, int(cfg.depth_per_match * max(n for n, _, _ in matches))))
    counts: dict[tuple[int, ...], float] = {}
    total = 0.0
    for n, conts, weight in matches:
        w = weight * n / len(conts)  # each occurrence's share; longer matches weigh more
        total += w * len(conts)
        for c in conts:
            for d in range(1, min(depth, len(c)) + 1):
                counts[tuple(c[:d])] = counts.get(tuple(c[:d]), 0.0) + w
    scored = sorted(((v / total, k) for k, v in counts.items() if v / total >= cfg.min_score), key=lambda x: -x[0])
    keep = {k for _, k in scored[: cfg.max_nodes]}
    keep = {k for k in keep if all(k[:d] in keep for d in range(1, len(k)))}  # a node only below its parent
    nodes = sorted(keep, key=lambda k: (len(k), -counts[k]))
    at = {k: i for i, k in enumerate(nodes)}
    return SuffixDraft(
        tokens=[k[-1] for k in nodes],
        parents=[at[k[:-1]] if len(k) > 1 else -1 for k in nodes],
        scores=[counts[k] / total for k in nodes],
        match=max(n for n, _, _ in matches),
    )


class SuffixCorpus:
    """The deployment's past traffic for one target: one index per workload ("default" for traffic without one),
    each within `cfg.corpus_tokens`; finished requests are added while serving (thread-safe)."""

    def __init__(self, cfg: SuffixConfig | None = None, vocab_size: int | None = None):
        self.cfg = cfg or SuffixConfig()
        self.vocab_size = vocab_size
        self.indexes: dict[str, SuffixIndex] = {}
        self.lock = threading.Lock()

    def add(self, tokens: list[int], workload: str = "default") -> None:
        if not tokens:
            return
        if self.vocab_size is not None:
            bad = [t for t in tokens if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"suffix corpus: token ids outside the target's vocabulary: {bad[:5]}")
        with self.lock:
            idx = self.indexes.setdefault(workload, SuffixIndex(self.cfg.max_match))
            idx.add(list(tokens))
            idx.evict_to(self.cfg.corpus_tokens)

    def tokens(self, workload: str | None = None) -> int:
        with self.lock:
            return sum(i.tokens for w, i in self.indexes.items() if workload in (None, w))

    def continuations(self, context: list[int], workload: str) -> tuple[int, list[list[int]]]:
        with self.lock:
            idx = self.indexes.get(workload) or self.indexes.get("default")
            return idx.continuations(context, self.cfg) if idx is not None else (0, [])

    @classmethod
    def load(cls, path: str | Path, cfg: SuffixConfig | None = None, vocab_size: int | None = None) -> SuffixCorpus:
        """A JSONL file of {"token_ids": [...], "workload": "..."} rows (the target's token ids; workload optional)
        -> the corpus; ValueError naming the first bad line, before anything is indexed."""
        rows = []
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"suffix corpus {path}: no such file")
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"suffix corpus {path}:{n}: not JSON ({e.msg})") from None
                ids = row.get("token_ids") if isinstance(row, dict) else None
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError(f"suffix corpus {path}:{n}: needs 'token_ids', a list of integer token ids")
                if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
                    raise ValueError(f"suffix corpus {path}:{n}: token ids outside the target's vocabulary")
                rows.append((ids, str(row.get("workload") or "default")))
        corpus = cls(cfg, vocab_size)
        total = {}
        for ids, w in rows:
            total[w] = total.get(w, 0) + len(ids)
        over = {w: t for w, t in total.items() if t > corpus.cfg.corpus_tokens}
        if over:
            raise ValueError(
                f"suffix corpus {path}: {over} tokens exceed the budget of {corpus.cfg.corpus_tokens} per workload "
                "(raise suffix.corpus_tokens or trim the file)"
            )
        for ids, w in rows:
            corpus.add(ids, w)
        return corpus


class RequestSuffix:
    """One request's suffix state: its own index over prompt + output (grown as tokens are committed) and the
    deployment's corpus for its workload."""

    def __init__(self, prompt: list[int], cfg: SuffixConfig, corpus: SuffixCorpus | None, workload: str):
        self.cfg, self.corpus, self.workload = cfg, corpus, workload
        self.index = SuffixIndex(cfg.max_match)
        self.serial = self.index.add(list(prompt))

    @property
    def context(self) -> list[int]:
        """Prompt + output so far: the request's own sequence in its index."""
        return self.index.seqs[self.serial]

    def push(self, tokens: list[int]) -> None:
        self.index.extend(self.serial, tokens)

    def draft(self) -> SuffixDraft:
        own = self.index.continuations(self.context, self.cfg)
        matches = [(own[0], own[1], 1.0)]
        if self.corpus is not None:
            n, conts = self.corpus.continuations(self.context, self.workload)
            matches.append((n, conts, 1.0))
        return draft_from(matches, self.cfg)
