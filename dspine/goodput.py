"""Each batched round's draft length, chosen by goodput — the tokens the open rows are expected to commit per
second of the round (SmartSpec's criterion; vLLM's dynamic speculative decoding). Where verifying a row costs
almost nothing (one request, or a GPU far from its compute bound) the longest draft wins; where each verified row
costs compute (a few CPU cores, a full batch) the policy drafts less, or not at all, for the rows it expects to
reject.

Expected tokens of row i drafting k: E_i(k) = 1 + sum_{j<=k} prod_{m<=j} a_{i,m}, with a_{i,m} the rate at which
row i's slot m was accepted when its round reached that slot, shrunk toward the engine's rate over all rows
(`PRIOR` rounds' weight); the engine's rate starts at `START_RATE` so that drafting is tried before anything
is known.

A round's seconds: a line a + b·r + c·s in the target rows it feeds (r = N·(k+1)) and whether it drafts (s),
least-squares fitted to the engine's measured rounds (but the first of each shape, which pays for building its
kernels: oneDNN's primitives, Triton's JIT), older rounds forgotten (`DECAY` per round) and the slopes
pulled toward 0 by a small ridge. The first round drafts all; while the rounds seen fed about the same number of
rows (the slope unknown: the first rounds, or a long stretch of one batch size once the older rounds are
forgotten), the next round feeds the most different number of rows it can, and so measures it.

The choice changes only how many drafts a round verifies, never what is committed: every round is verified as
the fixed-length rounds are.
"""

from __future__ import annotations

import torch

START_RATE = 0.7
PRIOR = 4.0
DECAY = 0.98
RIDGE = 1.0


class RowAcceptance:
    """One row's counts per draft slot 1..K: rounds that reached the slot, and those that accepted it."""

    __slots__ = ("acc", "reach")

    def __init__(self, K: int):
        self.reach, self.acc = [0.0] * K, [0.0] * K

    def record(self, drafted: int, accepted: int) -> None:
        """A round that verified `drafted` drafts and accepted the first `accepted` of them."""
        for m in range(min(accepted + 1, drafted)):
            self.reach[m] += 1
            self.acc[m] += m < accepted


class DraftPolicy:
    """An engine's goodput choice of draft length in [0, max_len] for a batched round (module docstring)."""

    def __init__(self, max_len: int):
        if max_len < 1:
            raise ValueError(f"max_len {max_len}: at least 1")
        self.K = max_len
        self.rows = RowAcceptance(max_len)  # all rows' counts, the prior of each one's
        self.gram = torch.zeros(3, 3, dtype=torch.float64)  # decayed sum of x x^T, x = (1, r, s)
        self.moment = torch.zeros(3, dtype=torch.float64)  # decayed sum of x * seconds
        self.shapes: set = set()  # round shapes seen (their first round is not fitted)

    def new_row(self) -> RowAcceptance:
        return RowAcceptance(self.K)

    def record(self, row: RowAcceptance, drafted: int, accepted: int) -> None:
        """Row `row` verified `drafted` drafts this round and accepted `accepted`."""
        row.record(drafted, accepted)
        self.rows.record(drafted, accepted)

    def observe(self, rows_fed: int, drafted: bool, seconds: float, shape=None) -> None:
        """A round's measured seconds, with the target rows it fed and whether it drafted; `shape` (any hashable,
        default (rows_fed, drafted)): rounds of a shape not seen before are not fitted (kernels being built)."""
        shape = (rows_fed, drafted) if shape is None else shape
        if shape not in self.shapes:
            self.shapes.add(shape)
            return
        x = torch.tensor([1.0, rows_fed, float(drafted)], dtype=torch.float64)
        self.gram.mul_(DECAY).add_(torch.outer(x, x))
        self.moment.mul_(DECAY).add_(x * seconds)

    def fit(self) -> tuple[float, float, float]:
        """The cost line's (a, b, c); zeros before any round was measured."""
        if not self.gram[0, 0]:
            return 0.0, 0.0, 0.0
        ridge = torch.diag(torch.tensor([0.0, RIDGE, RIDGE], dtype=torch.float64))
        return tuple(torch.linalg.solve(self.gram + ridge, self.moment).tolist())

    def seconds(self, rows_fed: int, drafted: bool, line: tuple[float, float, float] | None = None) -> float:
        """The fitted seconds of a round feeding `rows_fed` target rows (0 before any round was measured)."""
        a, b, c = line or self.fit()
        return a + b * rows_fed + c * drafted

    def rates(self, row: RowAcceptance) -> list[float]:
        """a_{i,m} for m = 1..K: the row's acceptance rate per slot, shrunk toward all rows'."""
        return self._shrunk(row, self._overall())

    def _overall(self) -> list[float]:
        return [(a + PRIOR * START_RATE) / (r + PRIOR) for a, r in zip(self.rows.acc, self.rows.reach)]

    @staticmethod
    def _shrunk(row: RowAcceptance, prior: list[float]) -> list[float]:
        return [(a + PRIOR * p) / (r + PRIOR) for a, r, p in zip(row.acc, row.reach, prior)]

    def expected(self, rows: list[RowAcceptance]) -> list[float]:
        """E(k) = sum_i E_i(k) for k = 0..K: the tokens the rows are expected to commit drafting k."""
        out = [float(len(rows))] + [0.0] * self.K
        prior = self._overall()
        for row in rows:
            p = 1.0
            for m, a in enumerate(self._shrunk(row, prior), 1):
                p *= a
                out[m] += p
        for k in range(1, self.K + 1):
            out[k] += out[k - 1]
        return out

    def choose(self, rows: list[RowAcceptance], batch: int) -> int:
        """The draft length for a round over `batch` rows (the forward's), `rows` the open ones' counts."""
        if not rows:
            return 0
        if not self.gram[0, 0]:  # no round measured yet: draft all
            return self.K
        n, mean = self.gram[0, 0], self.gram[0, 1] / self.gram[0, 0]
        if self.gram[1, 1] / n - mean**2 < 1.0:  # every round fed about the same rows: measure another size first
            return max(range(self.K + 1), key=lambda k: abs(batch * (k + 1) - mean))
        gains, line = self.expected(rows), self.fit()
        costs = [max(self.seconds(batch * (k + 1), k > 0, line), 1e-6) for k in range(self.K + 1)]
        return max(range(self.K + 1), key=lambda k: gains[k] / costs[k])
