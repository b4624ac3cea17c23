"""`dspine serve`'s settings: one dataclass whose fields declare the command-line options (no heavy imports)."""

from __future__ import annotations

from dataclasses import dataclass

from dspine.config import option


@dataclass
class ServeConfig:
    """The server's settings; `dspine serve`'s options are built from these fields (config.add_arguments), and a
    value out of range is refused here, whoever builds it."""

    model_name: str = option("dspine", "the model id clients ask for", flag="--served-model-name")
    max_prompt_tokens: int | None = option(None, "refuse longer prompts (none: the target's context - 1)")
    max_records: int = 10000
    max_batch: int = option(8, "rows decoded together in one batch; requests join a running batch between rounds")
    max_queue: int = option(64, "requests admitted at once, decoding or waiting; more get 429 + Retry-After")
    grace_s: float = option(
        30.0, "on SIGTERM, in-flight requests may finish this long before they are aborted", flag="--grace-seconds"
    )
    stall_s: float = 300.0  # /health reports the decode loop dead when a batch makes no progress this long
    admin_key: str | None = option(
        None,
        "bearer key of POST /v1/dspine/drafter, which swaps the served drafter without dropping requests "
        "(adapt/deploy.py); unset: swaps disabled",
        env="DSPINE_ADMIN_KEY",
    )
    read_key: str | None = option(
        None,
        "bearer key of the record and drafter reads (GET /v1/dspine/requests, /v1/dspine/requests/ID: completions "
        "and token ids; GET /v1/dspine/drafter); the admin key opens them too; neither set: they answer 403. "
        "`dspine proxy` reads the same variable to fetch the records of streamed requests",
        env="DSPINE_READ_KEY",
    )
    request_timeout_s: float | None = option(
        None,
        "seconds a request may decode before it is aborted (finish_reason abort, recorded); a request's own "
        "`timeout` field may ask for less (none: no limit)",
        flag="--request-timeout",
    )
    max_body_bytes: int = option(
        32 * 2**20, "refuse a request body larger than this (413), from its Content-Length before reading it"
    )
    body_timeout_s: float = option(
        30.0,
        "seconds a request body may take to arrive whole (408 after that: a slow or short body never holds a "
        "connection)",
        flag="--body-timeout",
    )
    draft_dtype: str | None = None  # drafters swapped in decode in it (checkpoint.draft_dtype; None: the target's)

    def __post_init__(self):
        if self.max_batch < 1 or self.max_queue < 1 or self.max_body_bytes < 1:
            raise ValueError("--max-batch, --max-queue and --max-body-bytes must be >= 1")
        if self.grace_s < 0 or (self.request_timeout_s is not None and self.request_timeout_s <= 0):
            raise ValueError("--grace-seconds must be >= 0 and --request-timeout > 0")
        if self.body_timeout_s <= 0:
            raise ValueError("--body-timeout must be > 0")
