"""The OpenAI surface of `dspine serve`, apart from the scheduler: a request body checked and turned into engine
input (`Parsed`), the replies shaped as OpenAI answers them (whole, or streamed as SSE chunks by `Stream`), with
acceptance in SGLang's shape, tool calls parsed from the reply, and refusals in OpenAI's error shape. `reasoning_effort`
(none/minimal/low/medium/high/xhigh) is mapped onto the target: Qwen3's `enable_thinking`; others a system note.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dspine.sampling import SamplingParams
from dspine.serve.protocol import (
    THINK_CLOSE,
    THINK_OPEN,
    AssistantMessage,
    ChatChoice,
    ChatRequest,
    Completion,
    Delta,
    DeltaChoice,
    PromptTokensDetails,
    RequestInvalid,
    TextChoice,
    Usage,
    error_body,
    logprobs_doc,
    parse_request,
    parse_tool_calls,
    split_reasoning,
    streamable_prefix,
    template_has_tools,
    template_messages,
)
from dspine.serve.protocol import read_json as protocol_read_json
from dspine.serve.records import RequestRecord
from dspine.target import has_thinking_mode

if TYPE_CHECKING:
    from dspine.serve.service import Service

REASONING_BUDGET = {"minimal": 64, "low": 256, "medium": 1024, "high": 4096, "xhigh": 8192}


def thinking_mode(model_type: str) -> dict:
    """How `reasoning_effort` reaches this target, as /v1/models reports it and `dspine serve` says at start."""
    if has_thinking_mode(model_type):
        return {"mode": "enable_thinking", "detail": "none: enable_thinking=False; any other level: True"}
    budget = ", ".join(f"{k} {v}" for k, v in REASONING_BUDGET.items())
    return {
        "mode": "system_note",
        "detail": "the target has no thinking mode: minimal..xhigh add a system note asking "
        f"for step-by-step reasoning within a token budget ({budget}); none adds nothing",
    }


def apply_reasoning_effort(model_type: str, messages: list[dict], effort: str) -> tuple[list[dict], dict]:
    """-> (messages, chat-template kwargs) for the target's notion of thinking (see thinking_mode)."""
    if thinking_mode(model_type)["mode"] == "enable_thinking":
        return messages, {"enable_thinking": effort != "none"}
    if effort == "none":
        return messages, {}
    note = (
        f"Reasoning effort: {effort}. Think step by step before answering, using at most "
        f"{REASONING_BUDGET[effort]} tokens of reasoning, then give the answer."
    )
    if messages and messages[0].get("role") == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note}] + messages[1:], {}
    return [{"role": "system", "content": note}] + messages, {}


def chat_prompt_ids(tokenizer, model_type: str, req: ChatRequest, effort: str) -> list[int]:
    """The prompt token ids of a chat request, as this server renders it: tools natively where the chat template
    has them (else as text), the reasoning effort as the target understands it, the target's chat template. The
    replay job renders with it too, so its cuts are made on the ids the server will see."""
    from dspine.target import chat_template_ids

    msgs, kw = template_messages(req, template_has_tools(getattr(tokenizer, "chat_template", None)))
    msgs, kw2 = apply_reasoning_effort(model_type, msgs, effort)
    return chat_template_ids(tokenizer, msgs, **kw, **kw2)


@dataclass
class Parsed:
    """A checked request, ready for the engine."""

    ids: list[int]
    params: SamplingParams
    effort: str
    stream: bool
    workload: str
    details: bool
    meta_info: bool
    token_ids: bool
    tool_names: set[str] | None  # the offered functions; None: no tools, the reply is plain content
    one_call: bool = False  # parallel_tool_calls false: at most one tool call per reply
    record_ids: bool = False  # the record keeps the token ids (token_ids, or record_token_ids: the proxy's agents)
    reasoning: bool = False  # a thinking target asked to think: its <think> block goes out as reasoning_content
    n: int = 1  # choices
    timeout_s: float | None = None  # decoding longer than this aborts the request
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")


class BadRequest(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after = status, param, code, retry_after


class OpenAIShaping:
    """Parsing and reply shaping for a Service (its `engine` and `cfg`): what turns a body into a `Parsed` request
    and a finished request into OpenAI's answer."""

    @staticmethod
    def template_hash(tokenizer) -> str | None:
        template = getattr(tokenizer, "chat_template", None)
        return hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None

    def parse(self, body, chat: bool) -> Parsed:
        try:
            req = parse_request(body, chat)
        except RequestInvalid as e:
            raise BadRequest(str(e), param=e.param) from None
        if req.model is not None and req.model != self.cfg.model_name:
            raise BadRequest(
                f"model {req.model!r} does not exist; this server serves {self.cfg.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        effort = req.reasoning_effort or "none"
        tools: list = []
        if chat:
            tools = req.active_tools()
            ids = self._chat_ids(req, effort)
        elif isinstance(req.prompt, str):
            ids = self.engine.target.encode(req.prompt)
        else:  # token ids, as OpenAI and SGLang take them
            ids, vocab = list(req.prompt), self.engine.target.info.vocab_size
            if not all(0 <= t < vocab for t in ids):
                raise BadRequest(f"'prompt': token ids must be in [0, {vocab})", param="prompt")
        where = "messages" if chat else "prompt"
        if not ids:
            raise BadRequest("the prompt is empty", param=where)
        if len(ids) > self.max_prompt:
            raise BadRequest(
                f"the prompt has {len(ids)} tokens; at most {self.max_prompt} are accepted",
                param=where,
                code="context_length_exceeded",
            )
        room = self.engine.target.info.max_position_embeddings - len(ids)  # the context window left
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is not None and max_tokens > room:  # refused, as OpenAI does, rather than clamped
            key = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
            raise BadRequest(
                f"'{key}' is {max_tokens}, but the prompt's {len(ids)} tokens leave room for at most "
                f"{room} in the context window",
                param=key,
                code="context_length_exceeded",
            )
        max_tokens = max_tokens or min(256, room)
        stop = ([req.stop] if req.stop else []) if isinstance(req.stop, str) else list(req.stop or [])
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            stop=stop,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logprobs=req.top_k_logprobs(),
        )
        meta = req.metadata or {}
        return Parsed(
            ids=ids,
            params=params,
            effort=effort,
            stream=req.stream,
            workload=str(meta.get("workload", "default")),
            details=req.return_spec_tokens_details,
            meta_info=req.return_meta_info,
            token_ids=req.return_token_ids,
            record_ids=req.return_token_ids or req.record_token_ids,
            tool_names={t.function.name for t in tools} if tools else None,
            one_call=chat and req.parallel_tool_calls is False,
            reasoning=chat and effort != "none" and has_thinking_mode(self.engine.target.info.model_type),
            n=req.n,
            timeout_s=min((t for t in (req.timeout, self.cfg.request_timeout_s) if t), default=None),
        )

    def _chat_ids(self, req: ChatRequest, effort: str) -> list[int]:
        tgt = self.engine.target
        try:
            return chat_prompt_ids(tgt.tokenizer, tgt.info.model_type, req, effort)
        except Exception as e:  # a chat template that rejects these messages
            raise BadRequest(f"cannot apply the chat template: {e}", param="messages") from None

    def extras(self, req: Parsed, rec: RequestRecord) -> dict:
        out = {}
        spec = rec.spec() or {"spec_accept_length": 1.0, "spec_verify_ct": 0}
        if req.details:
            out["sglext"] = {"spec_tokens_details": spec, "reasoning_effort": rec.thinking}
        if req.meta_info:
            out["meta_info"] = {
                **spec,
                "id": rec.request_id,
                "prompt_tokens": rec.prompt_tokens,
                "cached_tokens": rec.cached_tokens or 0,
                "completion_tokens": rec.completion_tokens,
                "reasoning_effort": rec.thinking,
            }
        if req.token_ids:
            out["prompt_token_ids"] = rec.prompt_token_ids
        return out

    def choice_extras(self, req: Parsed, res, chat: bool) -> dict:
        """A choice's token ids (return_token_ids) and logprobs (when asked), from its GenerationResult."""
        out = {"token_ids": list(res.token_ids)} if req.token_ids else {}
        if res.logprobs is not None:
            decode = lambda t: self.engine.target.decode([t])
            out["logprobs"] = logprobs_doc(list(zip(res.token_ids, res.logprobs)), decode, chat)
        return out

    def reply(self, req: Parsed, text: str, finish_reason: str) -> tuple[str | None, list[dict], str, str | None]:
        """(content, tool_calls, finish_reason, reasoning) of a finished generation: a thinking reply's <think>
        block apart, then tool calls parsed from what follows it."""
        reasoning, text = split_reasoning(text) if req.reasoning else (None, text)
        if req.tool_names is None:
            return text, [], finish_reason, reasoning
        content, calls = parse_tool_calls(text, req.tool_names)
        if calls:
            return content, calls[:1] if req.one_call else calls, "tool_calls", reasoning
        return text, [], finish_reason, reasoning

    def response(self, req: Parsed, rec: RequestRecord, results: list, chat: bool) -> dict:
        choices = []
        for i, res in enumerate(results):
            extra = self.choice_extras(req, res, chat)
            if chat:
                content, calls, finish, reasoning = self.reply(req, res.text, res.finish_reason)
                message = AssistantMessage(
                    role="assistant",
                    content=content,
                    **({"tool_calls": calls} if calls else {}),
                    **({"reasoning_content": reasoning} if reasoning is not None else {}),
                )
                choices.append(ChatChoice(index=i, message=message, finish_reason=finish, **extra))
            else:
                choices.append(TextChoice(index=i, text=res.text, finish_reason=res.finish_reason, **extra))
        return Completion(
            id=rec.request_id,
            object="chat.completion" if chat else "text_completion",
            created=int(rec.ts),
            model=rec.model,
            choices=choices,
            usage=usage(rec),
            **self.extras(req, rec),
        ).dump()


def usage(rec: RequestRecord) -> Usage:
    return Usage(
        prompt_tokens=rec.prompt_tokens,
        completion_tokens=rec.completion_tokens,
        total_tokens=rec.prompt_tokens + rec.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=rec.cached_tokens or 0),
    )


class Stream:
    """One streamed choice: tokens arrive from the decoding thread, text goes out as SSE chunks. Text that
    could still become a stop string is held back; with tools offered, text that could be a tool call is too,
    and the calls go out as `tool_calls` deltas once the reply is complete. The choice's logprobs ride on its
    last chunk."""

    def __init__(self, service: Service, req: Parsed, chat: bool, index: int = 0):
        self.service, self.req, self.chat, self.index = service, req, chat, index
        self.hold = max((len(s) for s in req.params.stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""
        self.thought = ""  # reasoning sent (a thinking reply's <think> block goes out as reasoning_content)
        self.created = int(time.time())

    def chunk(
        self,
        delta: dict | None = None,
        text: str | None = None,
        finish=None,
        usage=None,
        extra=None,
        ids: dict | None = None,
    ) -> str:
        i = self.index
        if self.chat:
            choice = DeltaChoice(index=i, delta=Delta(**(delta or {})), finish_reason=finish, **(ids or {}))
        else:
            choice = TextChoice(index=i, text=text or "", finish_reason=finish, **(ids or {}))
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        done = {"usage": usage} if usage is not None else {}
        doc = Completion(
            id=self.req.id,
            object=obj,
            created=self.created,
            model=self.service.cfg.model_name,
            choices=[choice],
            **done,
            **(extra or {}),
        )
        return "data: " + json.dumps(doc.dump()) + "\n\n"

    def content(self, text: str) -> str:
        return self.chunk({"role": "assistant", "content": text}, text)

    def reasoning(self, text: str) -> tuple[str | None, str | None]:
        """A thinking reply so far -> (a reasoning_content delta or None, the content so far, or None while the
        <think> block is still open)."""
        head = text.lstrip("\n")
        if not (head.startswith(THINK_OPEN) or THINK_OPEN.startswith(head)):
            return None, text  # no block: all content
        if THINK_CLOSE in head:
            reasoning, rest = split_reasoning(text)
            delta = reasoning[len(self.thought) :] if reasoning and len(reasoning) > len(self.thought) else None
            self.thought = reasoning or self.thought
            return delta, rest
        inner = head[len(THINK_OPEN) :].lstrip("\n") if head.startswith(THINK_OPEN) else ""
        safe = inner[: max(0, len(inner) - len(THINK_CLOSE) + 1)].rstrip("\n")  # a closing tag may be forming
        if len(safe) <= len(self.thought) or safe.endswith("\ufffd"):
            return None, None
        delta, self.thought = safe[len(self.thought) :], safe
        return delta, None

    def progress(self) -> str | None:
        """The chunk for the text decoded so far that is safe to send, if any."""
        text = self.service.engine.target.decode(self.tokens)
        if self.req.reasoning:
            delta, text = self.reasoning(text)
            if delta:
                return self.chunk({"role": "assistant", "reasoning_content": delta})
            if text is None:
                return None
        safe = text[: len(text) - self.hold] if self.hold else text
        if safe.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence: wait for the next token
        if self.req.tool_names is not None:
            safe = streamable_prefix(safe)
        if len(safe) <= len(self.sent):
            return None
        out, self.sent = safe[len(self.sent) :], safe
        return self.content(out)

    def finish(self, res, rec: RequestRecord | None) -> list[str]:
        """The choice's last chunks; with the request's record (the last choice), usage and extras ride along."""
        # completions never carry tools, so their text comes back whole
        content, calls, finish, reasoning = self.service.reply(self.req, res.text, res.finish_reason)
        out = []
        if reasoning and len(reasoning) > len(self.thought) and reasoning.startswith(self.thought):
            out.append(self.chunk({"role": "assistant", "reasoning_content": reasoning[len(self.thought) :]}))
        rest = content or ""
        if len(rest) > len(self.sent) and rest.startswith(self.sent):
            out.append(self.content(rest[len(self.sent) :]))
        for i, c in enumerate(calls):
            out.append(self.chunk({"role": "assistant", "tool_calls": [{"index": i, **c}]}))
        ids = self.service.choice_extras(self.req, res, self.chat)
        if rec is None:
            out.append(self.chunk(None, None, finish, ids=ids))
        else:
            out.append(self.chunk(None, None, finish, usage(rec), self.service.extras(self.req, rec), ids))
        return out


def read_json(raw: bytes, content_type: str = "application/json"):
    """A request body -> its JSON value, or BadRequest naming what is wrong with it."""
    try:
        return protocol_read_json(raw, content_type)
    except RequestInvalid as e:
        raise BadRequest(str(e)) from None


def error_response(service: Service, e: BadRequest):
    """A refusal in OpenAI's error shape (Retry-After on 429 / 503), counted by status."""
    from fastapi.responses import JSONResponse

    service.metrics.errors.labels(str(e.status)).inc()
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return JSONResponse(error_body(str(e), e.status, e.param, e.code), status_code=e.status, headers=headers)
