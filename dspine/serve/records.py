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
    cached_tokens: int | None = None  # of them, reused from the engine's prefix cache
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


# --- what a reply carries (SGLang's shape, dspine serve's, or either behind LiteLLM) ---------------------------


def first_choice(resp) -> tuple[object, dict]:
    """A reply's first choice and the extras LiteLLM keeps on it (provider_specific_fields)."""
    choice = (getattr(resp, "choices", None) or [None])[0]
    return choice, getattr(choice, "provider_specific_fields", None) or {}


def acceptance_from_response(resp) -> dict | None:
    """SGLang-shaped acceptance fields carried on a (non-streaming) reply, if any: top-level `meta_info` or
    `sglext.spec_tokens_details`, or the first choice's `meta_info` (SGLang 0.5.17 with `return_meta_info`, which
    LiteLLM keeps among the choice's provider_specific_fields); the histogram widened to the drafter's block."""
    extra = getattr(resp, "model_extra", None) or {}
    choice, psf = first_choice(resp)
    for blob in (
        getattr(resp, "meta_info", None) or extra.get("meta_info"),
        ((getattr(resp, "sglext", None) or extra.get("sglext")) or {}).get("spec_tokens_details"),
        psf.get("meta_info") or getattr(choice, "meta_info", None),
    ):
        st = AcceptanceStats.from_sglang_meta(blob) if isinstance(blob, dict) else None
        if st is not None:
            return {**blob, "spec_correct_drafts_histogram": list(st.accept_hist)}
    return None


def cached_of(usage) -> int | None:
    """Prompt tokens a backend reused from its prefix cache, from an OpenAI usage (prompt_tokens_details, or the
    Responses API's input_tokens_details); None where it does not say."""
    details = getattr(usage, "prompt_tokens_details", None) or getattr(usage, "input_tokens_details", None)
    if isinstance(details, dict):
        return details.get("cached_tokens")
    return getattr(details, "cached_tokens", None)


def reply_ids(resp, key: str) -> list[int] | None:
    """Token ids a reply carries (return_token_ids), `key` "prompt_token_ids" or "token_ids" (the completion's):
    at the top level (dspine serve's prompt ids; both as `dspine proxy` lifts them, the completion's as
    `completion_token_ids`) or on the first choice (SGLang's; LiteLLM keeps them among its provider_specific_fields)."""
    choice, psf = first_choice(resp)
    top = getattr(resp, "prompt_token_ids" if key == "prompt_token_ids" else "completion_token_ids", None)
    return list(top or psf.get(key) or getattr(choice, key, None) or []) or None
