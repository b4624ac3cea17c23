"""Acceptance, defined once. Training, evaluation, the servers and the dashboards all use this type.

τ (acceptance length) = tokens committed per target verify round = accepted drafts + 1 (the bonus), in
[1, B]. Reported two ways across requests: the mean of per-request means (z-lab/dflash's convention) and
the pooled ratio (all committed tokens / all rounds). The per-slot histogram counts, for each block slot
k = 1..B-1, the rounds in which slot k was accepted; `accept_hist[n]` counts rounds that accepted n drafts.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field


def tau_of(accepted: int, rounds: int) -> float:
    """τ from counts: (accepted drafts + one bonus per round) / rounds — also for servers that report only
    counts (SGLang's meta_info `spec_num_correct_drafts`, `spec_verify_ct`)."""
    return (accepted + rounds) / rounds if rounds else 0.0


@dataclass
class AcceptanceStats:
    block_size: int
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[n]: rounds with n drafts accepted

    def __post_init__(self):
        if len(self.accept_hist) != self.block_size:
            self.accept_hist = (list(self.accept_hist) + [0] * self.block_size)[: self.block_size]

    def record(self, accepted: int) -> None:
        if not 0 <= accepted < self.block_size:
            raise ValueError(f"accepted={accepted} outside [0, {self.block_size - 1}]")
        self.accept_hist[accepted] += 1

    @property
    def rounds(self) -> int:
        return sum(self.accept_hist)

    @property
    def accepted(self) -> int:
        return sum(n * c for n, c in enumerate(self.accept_hist))

    @property
    def proposed(self) -> int:
        return self.rounds * (self.block_size - 1)

    @property
    def tau(self) -> float:
        return tau_of(self.accepted, self.rounds)

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def per_slot(self) -> list[float]:
        """P(slot k accepted) for k = 1..B-1 (fraction of rounds reaching slot k)."""
        r = self.rounds
        return [sum(self.accept_hist[k:]) / r if r else 0.0 for k in range(1, self.block_size)]

    @property
    def per_slot_conditional(self) -> list[float]:
        """P(slot k accepted | slot k-1 accepted) for k = 1..B-1 (slot 1: unconditional); 0 where no round
        reached slot k-1. What conditioning on the predecessor changes."""
        reach = [1.0, *self.per_slot]
        return [b / a if a else 0.0 for a, b in zip(reach, reach[1:])]

    def merge(self, other: AcceptanceStats) -> AcceptanceStats:
        if other.block_size != self.block_size:
            raise ValueError("cannot merge stats of different block sizes")
        return AcceptanceStats(self.block_size, [a + b for a, b in zip(self.accept_hist, other.accept_hist)])

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "rounds": self.rounds,
            "accepted": self.accepted,
            "tau": self.tau,
            "accept_rate": self.accept_rate,
            "accept_hist": list(self.accept_hist),
            "per_slot": self.per_slot,
        }

    @classmethod
    def from_dict(cls, d: dict) -> AcceptanceStats:
        return cls(int(d["block_size"]), [int(x) for x in d["accept_hist"]])

    @classmethod
    def from_sglang_meta(cls, meta: dict | None) -> AcceptanceStats | None:
        """A request's acceptance from SGLang's per-request fields (meta_info, or sglext.spec_tokens_details), None
        without a histogram. SGLang's histogram only reaches the largest count seen; its width (the block) is
        the proposed drafts per verify round + 1."""
        hist = (meta or {}).get("spec_correct_drafts_histogram")
        if not hist:
            return None
        rounds, proposed = meta.get("spec_verify_ct"), meta.get("spec_num_proposed_drafts")
        width = proposed // rounds + 1 if rounds and proposed else len(hist)
        return cls(max(width, len(hist)), [int(x) for x in hist])

    def sglang_meta(self) -> dict:
        """The per-request fields SGLang 0.5.23 reports (meta_info / sglext.spec_tokens_details)."""
        return {
            "spec_accept_length": self.tau,
            "spec_verify_ct": self.rounds,
            "spec_accept_rate": self.accept_rate,
            "spec_num_correct_drafts": self.accepted,
            "spec_num_proposed_drafts": self.proposed,
            "spec_correct_drafts_histogram": list(self.accept_hist),
        }


def summarize(requests: list[AcceptanceStats]) -> dict:
    """Across requests: mean of per-request τ, pooled τ, pooled per-slot acceptance (pooled figures None when
    drafters of different block sizes are mixed)."""
    live = [s for s in requests if s.rounds]
    if not live:
        return {"requests": 0, "tau_mean": 0.0, "tau_pooled": 0.0, "per_slot": [], "rounds": 0}
    out = {"requests": len(live), "tau_mean": sum(s.tau for s in live) / len(live)}
    if len({s.block_size for s in live}) != 1:
        return {**out, "tau_pooled": None, "per_slot": [], "rounds": sum(s.rounds for s in live)}
    pooled = live[0]
    for s in live[1:]:
        pooled = pooled.merge(s)
    return {
        **out,
        "tau_pooled": pooled.tau,
        "per_slot": pooled.per_slot,
        "rounds": pooled.rounds,
        "accept_hist": pooled.accept_hist,
        "per_slot_conditional": pooled.per_slot_conditional,
    }


def group_by(items: Iterable[tuple[Hashable, AcceptanceStats | None]]) -> dict:
    """Acceptance aggregated by any key — workload × thinking level in the store, benchmark × temperature ×
    method in the eval — -> {key: summarize(...) + "items"}; items without stats (AR) count in "items" only."""
    groups: dict = {}
    for key, st in items:
        groups.setdefault(key, []).append(st)
    return {k: {**summarize([s for s in v if s is not None]), "items": len(v)} for k, v in groups.items()}


def simulated_tau(per_slot_acc: list[float]) -> float:
    """SpecForge's convention from per-slot conditional accuracies acc_k: 1 + Σ_k Π_{i<=k} acc_i."""
    tau, run = 1.0, 1.0
    for a in per_slot_acc:
        run *= a
        tau += run
    return tau


def quantile(xs: list[float], q: float) -> float | None:
    """Nearest-rank quantile of a sample (None when empty): latency p50/p99 in the load test and dashboards."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def bootstrap_over_groups(groups: list, figures, draws: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Percentile intervals of `figures(items) -> {name: value}` with whole groups resampled (a task's rows
    together: rows of one task are not independent) -> {name: [low, high]}. One group: no interval (None)."""
    import random

    if len(groups) < 2:
        return {k: None for k in figures([x for g in groups for x in g])}
    rng = random.Random(seed)
    samples = [figures([x for g in rng.choices(groups, k=len(groups)) for x in g]) for _ in range(draws)]
    lo, hi = int((1 - level) / 2 * draws), int((1 + level) / 2 * draws) - 1
    out = {}
    for key in samples[0]:
        vals = sorted(s[key] for s in samples)
        out[key] = [vals[lo], vals[hi]]
    return out
