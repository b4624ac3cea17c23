"""One request record, end to end: what the server keeps for every finished request (served at
/v1/dspine/requests/{id}), what the proxy callback stores (read back from the server, or built from an SGLang
response) and what the acceptance store's rows hold. τ, verify rounds and SGLang's fields are computed from
the per-slot histogram through stats.AcceptanceStats, never stored apart from it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from dspine.stats import AcceptanceStats


@dataclass
class RequestRecord:
    request_id: str
    model: str
    workload: str = "default"
    thinking: str = "none"
    drafter: str | None = None
    method: str | None = None
    stream: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    latency_s: float | None = None
    ts: float = field(default_factory=time.time)
    accept_hist: list[int] | None = None  # verify rounds by drafts accepted (0 .. block_size-1)
    source: str | None = None  # where the acceptance came from: engine, backend_record, response
    batch_size: int | None = None
    text: str | None = None
    # the exact ids the target saw and produced, kept when the request asked for them (return_token_ids)
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None

    @property
    def stats(self) -> AcceptanceStats | None:
        return AcceptanceStats(len(self.accept_hist), list(self.accept_hist)) if self.accept_hist else None

    @property
    def tau(self) -> float | None:
        st = self.stats
        return st.tau if st else None

    @property
    def verify_rounds(self) -> int | None:
        st = self.stats
        return st.rounds if st else None

    def spec(self) -> dict | None:
        """SGLang's acceptance fields (meta_info / sglext.spec_tokens_details), None for AR."""
        st = self.stats
        return st.sglang_meta() if st else None

    def to_json(self) -> dict:
        spec = self.spec()
        tau, rounds = (spec["spec_accept_length"], spec["spec_verify_ct"]) if spec else (None, None)
        return {**asdict(self), "id": self.request_id, "tau": tau, "verify_rounds": rounds, "spec": spec}
