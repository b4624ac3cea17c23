"""What runs inside the LiteLLM proxy process: the acceptance callback and the key check.

`DSpineLogger` (a LiteLLM `CustomLogger`) records every successful request once: model, drafter, workload
(request `metadata.workload`, which LiteLLM keeps for callbacks), thinking level, tokens, τ, verify rounds,
per-slot histogram, latency — into the SQLite store (store.py) and Prometheus metrics labelled by workload
and thinking level (served on 127.0.0.1:DSPINE_PROXY_METRICS_PORT).

Where acceptance comes from: LiteLLM passes a backend's extra top-level fields (`meta_info`, `sglext`)
only on non-streaming responses, but it keeps the backend's response id for both. So the callback asks
the backend for its own record, `GET {api_base}/dspine/requests/{id}` (dspine serve), and falls back to the
response's `meta_info` / `sglext.spec_tokens_details` (SGLang, non-streaming). A request whose acceptance
cannot be found is still stored (τ empty) and counted in `dspine_proxy_lost_acceptance_total`.

`auth` replaces LiteLLM's key check (which, without a database, answers 400 "No connected db" to a wrong
key) with a constant-time comparison against the master key: a missing or wrong key gets 401.

Configured through the environment that `dspine proxy` sets: DSPINE_PROXY_DB, DSPINE_PROXY_METRICS_PORT,
DSPINE_PROXY_KEY; the backends' records are read with DSPINE_READ_KEY (dspine serve's --read-key; else
DSPINE_ADMIN_KEY).
"""

from __future__ import annotations

import asyncio
import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import (the cost map is local)

from litellm.integrations.custom_logger import CustomLogger

from dspine.serve.gate import COUNTS, KEY_REFUSED, key_matches
from dspine.serve.metrics import AcceptanceMetrics
from dspine.serve.proxy import backend_read_key
from dspine.serve.records import RequestRecord, acceptance_from_response, cached_of, first_choice, reply_ids
from dspine.serve.store import AcceptanceStore

_METRICS = None


def _metrics(port: int) -> AcceptanceMetrics:
    """Prometheus metrics of this process (serve.metrics, `dspine_proxy_*`), served once on 127.0.0.1:port."""
    global _METRICS
    if _METRICS is None:
        from prometheus_client import start_http_server

        _METRICS = AcceptanceMetrics("dspine_proxy", ("model", "drafter", "workload", "thinking"))
        if port:
            start_http_server(port, addr="127.0.0.1")
    return _METRICS


class DSpineLogger(CustomLogger):
    def __init__(
        self,
        db: str,
        metrics_port: int = 0,
        fetch_timeout_s: float = 10.0,
        routes: dict | None = None,
        api_bases: dict | None = None,
        read_key: str | None = None,
    ):
        super().__init__()
        self.read_key = read_key  # the backends' read key (dspine serve --read-key): their records are behind it
        self.routes = routes or {}  # WORKLOAD or WORKLOAD/LEVEL -> backend name (ProxyConfig.routes)
        # model name -> its backends' OpenAI bases (several: replicas), where their records are asked for
        self.api_bases = api_bases or {}
        self.store = AcceptanceStore(db)
        self.metrics = _metrics(metrics_port)
        self.fetch_timeout_s = fetch_timeout_s

    @classmethod
    def from_env(cls) -> DSpineLogger:
        return cls(
            os.environ["DSPINE_PROXY_DB"],
            int(os.environ.get("DSPINE_PROXY_METRICS_PORT", "0") or 0),
            routes=json.loads(os.environ.get("DSPINE_PROXY_ROUTES") or "{}"),
            api_bases=json.loads(os.environ.get("DSPINE_PROXY_API_BASES") or "{}"),
            read_key=backend_read_key(),
        )

    async def async_pre_call_hook(self, user_api_key_dict, cache, data: dict, call_type):
        """Pass the workload on to the backend (LiteLLM keeps request metadata to itself), so the server's own
        record and metrics carry the same label; agent traffic (a request with a workload) also asks the backend
        to keep its exact token ids in its record (`record_token_ids`: the client's reply gets no fields it did
        not ask for), which the callback stores as a trace row. A route for the workload (and level)
        sends the request to its backend. A request's `timeout` goes on to the backend, where it limits the
        decode as it does on the server (LiteLLM would take it as its own upstream timeout)."""
        if data.get("timeout") is not None:  # the request's decode limit, as on the server
            data["extra_body"] = {**(data.get("extra_body") or {}), "timeout": data.pop("timeout")}
        md = data.get("metadata") or {}
        workload = md.get("workload") if isinstance(md, dict) else None
        if workload is not None and self.routes:
            from dspine.serve.protocol import route_of_request

            backend = route_of_request(self.routes, workload, data.get("reasoning_effort"))
            if backend:
                data["model"] = backend
        if workload is not None:
            extra = dict(data.get("extra_body") or {})
            extra["metadata"] = {**(extra.get("metadata") or {}), "workload": str(workload)}
            extra["record_token_ids"] = True  # kept in the backend's record, not added to the client's reply
            data["extra_body"] = extra
        return data

    async def async_post_call_success_hook(self, data: dict, user_api_key_dict, response):
        """Lift what the client asked for from the reply's first choice to its top level (`lift_choice_fields`):
        LiteLLM's SDK, which the agents call the proxy with, drops a proxy reply's per-choice extras."""
        lift_choice_fields(response, data)
        return response

    def served_by(self, group: str | None, call_base: str | None) -> str | None:
        """The configured base of the backend that answered: of the model's replicas, the one LiteLLM called
        (its api_base for the call; that of a Responses call ends in /responses), else the model's only one."""
        bases = self.api_bases.get(group) or []
        call = (call_base or "").rstrip("/")
        hit = [b for b in bases if call == b.rstrip("/") or call.startswith(b.rstrip("/") + "/")]
        if hit:
            return max(hit, key=len)
        return bases[0] if len(bases) == 1 else call_base

    async def _backend_record(self, api_base: str | None, rid: str | None) -> dict | None:
        """The backend's record of request `rid`. A dspine backend that has not finished it yet (a stream the
        client abandoned ends at the backend's next round) answers 404 "no finished request": asked again
        until fetch_timeout_s; any other answer (an SGLang backend has no such route) is final."""
        if not api_base or not rid:
            return None
        import httpx

        url = api_base.rstrip("/") + f"/dspine/requests/{rid}"
        deadline = asyncio.get_running_loop().time() + self.fetch_timeout_s
        try:
            auth = {"Authorization": f"Bearer {self.read_key}"} if self.read_key else {}
            async with httpx.AsyncClient(timeout=self.fetch_timeout_s, headers=auth) as c:
                while True:
                    r = await c.get(url)
                    if r.status_code == 200:
                        return r.json()
                    pending = r.status_code == 404 and "no finished request" in r.text
                    if not pending or asyncio.get_running_loop().time() > deadline:
                        return None
                    await asyncio.sleep(0.25)
        except (httpx.HTTPError, ValueError):
            return None

    async def async_post_call_failure_hook(
        self, request_data, original_exception, user_api_key_dict, traceback_str=None
    ):
        """A backend that cannot be reached answers 503 (LiteLLM says 500), naming the model."""
        if _unreachable(original_exception):
            from fastapi import HTTPException

            model = request_data.get("model")
            return HTTPException(503, f"the backend of model {model!r} cannot be reached; retry later")
        return None

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        lp = kwargs.get("litellm_params") or {}
        md = lp.get("metadata") or {}
        user_md = md.get("requester_metadata") or md
        opt = kwargs.get("optional_params") or {}
        rid = backend_id(getattr(response_obj, "id", None))
        group = md.get("model_group") or kwargs.get("model")
        backend = await self._backend_record(self.served_by(group, lp.get("api_base")), rid)
        spec, source = None, None
        if backend is not None:
            spec, source = backend.get("spec"), "backend_record"
        if spec is None:
            spec = acceptance_from_response(response_obj)
            source = "response" if spec is not None else source
        hist = spec.get("spec_correct_drafts_histogram") if spec else None
        usage = getattr(response_obj, "usage", None)
        b = backend or {}
        rec = RequestRecord(
            request_id=rid or kwargs.get("litellm_call_id"),
            model=str(group),
            drafter=b.get("drafter"),
            method=b.get("method"),
            workload=str(user_md.get("workload") or b.get("workload") or "default"),
            thinking=str(b.get("thinking") or opt.get("reasoning_effort") or user_md.get("thinking") or "none"),
            stream=bool(kwargs.get("stream") or opt.get("stream")),
            # the backend's own counts where it has them (LiteLLM estimates a stream the client abandoned)
            prompt_tokens=b.get("prompt_tokens", getattr(usage, "prompt_tokens", getattr(usage, "input_tokens", None))),
            completion_tokens=b.get(
                "completion_tokens", getattr(usage, "completion_tokens", getattr(usage, "output_tokens", None))
            ),
            cached_tokens=b.get("cached_tokens", cached_of(usage)),
            accept_hist=hist,
            latency_s=(end_time - start_time).total_seconds(),
            source=source,
            finish_reason=b.get("finish_reason"),
            text=b.get("text"),
            # a backend without records (SGLang) carries the ids on the reply when the client asked for them
            prompt_token_ids=b.get("prompt_token_ids") or reply_ids(response_obj, "prompt_token_ids"),
            completion_token_ids=b.get("completion_token_ids") or reply_ids(response_obj, "token_ids"),
        )
        trace = None
        if rec.prompt_token_ids:
            choice = (getattr(response_obj, "choices", None) or [None])[0]
            calls = getattr(getattr(choice, "message", None), "tool_calls", None) or []
            trace = {
                "episode_id": user_md.get("episode_id"),
                "task_id": user_md.get("task_id"),
                "messages": kwargs.get("messages") or [],
                "tools": opt.get("tools") or [],
                "tool_calls": [c.model_dump() if hasattr(c, "model_dump") else c for c in calls],
                "sampling": {
                    k: opt.get(k)
                    for k in ("temperature", "top_p", "max_tokens", "reasoning_effort")
                    if opt.get(k) is not None
                },
            }
        fresh = await asyncio.to_thread(self.store.append, rec, trace)
        COUNTS["logged"] += 1  # what the proxy's shutdown waits for (gate._draining_logs)
        if not fresh:
            return
        self.metrics.observe(rec)
        if hist is None and (rec.drafter is not None or backend is None):
            self.metrics.lost.labels(model=rec.model).inc()


def lift_choice_fields(resp, request: dict) -> None:
    """Per-choice token ids and acceptance (SGLang 0.5.17's `prompt_token_ids`, `token_ids`, `meta_info`; dspine
    serve's completion `token_ids`) copied to the reply's top level as `prompt_token_ids`, `completion_token_ids`
    and `meta_info` — only those the request asked for (return_token_ids, return_meta_info) and not already there."""
    asked = {**(request.get("extra_body") or {}), **request}
    _, psf = first_choice(resp)
    pairs = []
    if asked.get("return_token_ids"):
        pairs += [("prompt_token_ids", "prompt_token_ids"), ("token_ids", "completion_token_ids")]
    if asked.get("return_meta_info"):
        pairs.append(("meta_info", "meta_info"))
    for src, dst in pairs:
        if psf.get(src) is not None and getattr(resp, dst, None) is None:
            setattr(resp, dst, psf[src])


def backend_id(rid: str | None) -> str | None:
    """The backend's own id of a response: LiteLLM hands Responses API answers out under an id of its own
    (`resp_` + base64 of provider, deployment and the backend's id; a stream's encrypted as well), which the
    backend's records do not know."""
    if not rid or not rid.startswith("resp_"):
        return rid
    from litellm.proxy.hooks.responses_id_security import decrypted_response_id
    from litellm.responses.utils import ResponsesAPIRequestUtils

    rid = decrypted_response_id(rid)  # a stream's id is encrypted with the proxy's key first
    return ResponsesAPIRequestUtils.decode_responses_api_response_id(rid).get("response_id") or rid


def _unreachable(e: BaseException) -> bool:
    """Whether an exception (or one it was raised from) is a failed connection to the backend: httpx's connect
    errors or the OpenAI SDK's APIConnectionError (not LiteLLM's subclass of it, which also wraps its own bugs)."""
    import httpx
    import openai

    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
            return True
        if type(e) is openai.APIConnectionError:  # its APITimeoutError subclass is a slow backend, not a down one
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


async def auth(request, api_key: str):
    """LiteLLM custom_auth: the master key (DSPINE_PROXY_KEY) or 401."""
    from litellm.proxy._types import ProxyException, UserAPIKeyAuth

    if key_matches(api_key):
        return UserAPIKeyAuth(api_key=api_key)
    raise ProxyException(
        message=KEY_REFUSED,
        type="auth_error",
        param="api_key",
        code=401,
    )
