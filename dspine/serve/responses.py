"""The OpenAI Responses API (`POST /v1/responses`) over the chat path: what the OpenAI Agents SDK's default model
and other Responses clients send, answered by the same decoding, records and acceptance as chat completions.

Design choices:
- **A translation, not a second server.** A Responses body becomes a chat-completions body (`to_chat`): `input`
  (a string, or items — messages with text parts, `function_call` and `function_call_output` items, reasoning
  items skipped), `instructions` as the first system message, flat function `tools`, `tool_choice`,
  `max_output_tokens`, `reasoning.effort`, `metadata` and dspine's own request fields pass on. The chat answer
  becomes a `response` object (`response_object`): a reasoning item for a thinking reply, a message item with
  `output_text`, one `function_call` item per tool call, usage as input/output tokens. A stream is the chat
  stream re-emitted as Responses events (`stream_events`: created, output items and content parts added,
  `output_text` deltas, `function_call_arguments`, done, then completed or incomplete) — so both surfaces decode,
  abort and record alike.
- **No server-side state.** The server keeps no conversations: `previous_response_id`, `conversation`,
  `background` and stored prompts are refused with a 400 that says to send the whole conversation as `input`;
  so are hosted tools (web or file search, computer use) and image or file inputs, which a text target cannot
  take. Unknown fields are refused by name, as OpenAI does.
- **One id.** A response's id is the request's own id, so `GET /v1/dspine/requests/{id}` (what the proxy's
  callback reads) finds its record whichever surface served it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from dspine.serve.protocol import RequestInvalid

# fields taken (and translated); dspine's own extensions pass on to the chat request unchanged
_FIELDS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "metadata",
    "parallel_tool_calls",
    "reasoning",
    "text",
    "store",
    "user",
    "include",
    "truncation",
    "top_logprobs",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "stream_options",
    "previous_response_id",
    "conversation",
    "background",
    "prompt",
    "max_tool_calls",
}
_PASS_ON = {
    "seed",
    "return_token_ids",
    "record_token_ids",
    "return_spec_tokens_details",
    "return_meta_info",
    "stop",
    "timeout",
}
_STATEFUL = ("previous_response_id", "conversation", "prompt")
_NO_STATE = "this server keeps no conversations: send the whole conversation as `input`"


def _text(content, where: str) -> str:
    """A message's content (a string, or text parts) -> its text; other parts are refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestInvalid(f"{where}.content must be a string or a list of parts", "input")
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            if not isinstance(part.get("text"), str):
                raise RequestInvalid(f"{where}.content[{k}].text must be a string", "input")
            out.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise RequestInvalid(
                f"{where}.content[{k}]: {kind} is not supported (this target reads text only)", "input"
            )
        else:
            raise RequestInvalid(f"{where}.content[{k}]: unknown part type {kind!r}", "input")
    return "".join(out)


def _messages(items, instructions) -> list[dict]:
    """`input` (+ `instructions`) -> chat messages; consecutive function calls join one assistant message."""
    msgs: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestInvalid("'instructions' must be a string", "instructions")
        msgs.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*msgs, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestInvalid("'input' must be a string or a non-empty list of items", "input")
    for k, it in enumerate(items):
        if not isinstance(it, dict):
            raise RequestInvalid(f"input[{k}] must be an object", "input")
        _add_item(msgs, it, f"input[{k}]")
    return msgs


def _add_item(msgs: list[dict], it: dict, where: str) -> None:
    kind = it.get("type", "message")
    if kind == "message":
        role = it.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise RequestInvalid(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
        msgs.append({"role": "system" if role == "developer" else role, "content": _text(it.get("content"), where)})
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(it.get(key), str):
                raise RequestInvalid(f"{where}.{key} must be a string", "input")
        fn = {"name": it["name"], "arguments": it["arguments"]}
        call = {"id": it["call_id"], "type": "function", "function": fn}
        last = msgs[-1] if msgs else None
        if last and last["role"] == "assistant" and last.get("tool_calls") is not None and not last["content"]:
            last["tool_calls"].append(call)
        else:
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(it.get("call_id"), str):
            raise RequestInvalid(f"{where}.call_id must be a string", "input")
        out = it.get("output")
        out = out if isinstance(out, str) else _text(out, where) if isinstance(out, list) else json.dumps(out)
        msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": out})
    elif kind != "reasoning":  # an earlier turn's reasoning is dropped, as templates drop reasoning_content
        raise RequestInvalid(f"{where}: item type {kind!r} is not supported", "input")


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise RequestInvalid("'tools' must be a list", "tools")
    out = []
    for k, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise RequestInvalid(f"tools[{k}]: only function tools are supported, got {kind!r}", "tools")
        if not isinstance(t.get("name"), str):
            raise RequestInvalid(f"tools[{k}].name must be a string", "tools")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _check_fields(body: dict) -> None:
    """Fields refused before any translation: unknown ones, server state, formats and values it cannot take."""
    unknown = sorted(set(body) - _FIELDS - _PASS_ON)
    if unknown:
        raise RequestInvalid(f"unknown parameter(s) {unknown}", unknown[0])
    for key in _STATEFUL:
        if body.get(key) is not None:
            raise RequestInvalid(f"'{key}' is not supported: {_NO_STATE}", key)
    if body.get("background"):
        raise RequestInvalid(
            "'background' is not supported: responses are answered while the request is open", "background"
        )
    text = body.get("text")
    fmt = ((text.get("format") or {}).get("type", "text")) if isinstance(text, dict) else "text"
    if fmt != "text":
        raise RequestInvalid(f"text.format {fmt!r} is not supported (text only)", "text")
    limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise RequestInvalid("'max_output_tokens' must be a positive integer", "max_output_tokens")
    reasoning = body.get("reasoning")
    if reasoning is not None and not (isinstance(reasoning, dict) and set(reasoning) <= {"effort", "summary"}):
        raise RequestInvalid("'reasoning' must be an object {effort, summary}", "reasoning")


def to_chat(body) -> dict:
    """A Responses request body -> the chat-completions body that decodes it; RequestInvalid naming what is wrong."""
    if not isinstance(body, dict):
        raise RequestInvalid("the body must be a JSON object", None)
    _check_fields(body)
    chat = {"messages": _messages(body.get("input"), body.get("instructions"))}
    for src, dst in (
        ("model", "model"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stream", "stream"),
        ("max_output_tokens", "max_tokens"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("metadata", "metadata"),
        ("user", "user"),
    ):
        if body.get(src) is not None:
            chat[dst] = body[src]
    chat.update({k: body[k] for k in _PASS_ON if k in body})
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise RequestInvalid("tool_choice: 'none', 'auto', 'required' or {type: function, name}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _envelope(body: dict, rid: str, created: int, model: str, status: str) -> dict:
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "text": {"format": {"type": "text"}},
        "reasoning": body.get("reasoning") or {"effort": None},
        "store": False,
        "usage": None,
    }


def _usage(u: dict | None) -> dict | None:
    if not u:
        return None
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _items(content: str | None, calls: list[dict], reasoning: str | None) -> list[dict]:
    out = []
    if reasoning:
        out.append(
            {"type": "reasoning", "id": _item_id("rs"), "summary": [{"type": "summary_text", "text": reasoning}]}
        )
    if content:
        part = {"type": "output_text", "text": content, "annotations": []}
        out.append(
            {"type": "message", "id": _item_id("msg"), "status": "completed", "role": "assistant", "content": [part]}
        )
    for c in calls:
        fn = c["function"]
        out.append(
            {
                "type": "function_call",
                "id": _item_id("fc"),
                "call_id": c["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
        )
    return out


def _finished(doc: dict, finish: str | None) -> dict:
    if finish == "length":
        doc.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    elif finish == "abort":
        doc.update(status="incomplete", incomplete_details={"reason": "interrupted"})
    else:
        doc["status"] = "completed"
    return doc


def response_object(chat: dict, body: dict) -> dict:
    """A chat completion (one choice) -> the `response` object answering the Responses request `body`."""
    choice = chat["choices"][0]
    msg = choice["message"]
    doc = _envelope(body, chat["id"], chat["created"], chat["model"], "completed")
    doc["output"] = _items(msg.get("content"), msg.get("tool_calls") or [], msg.get("reasoning_content"))
    doc["usage"] = _usage(chat.get("usage"))
    for key in ("meta_info", "sglext", "prompt_token_ids"):  # dspine's own extensions, when asked for
        if key in chat:
            doc[key] = chat[key]
    if "token_ids" in choice:
        doc["token_ids"] = choice["token_ids"]
    return _finished(doc, choice.get("finish_reason"))


def _event(kind: str, seq: int, **fields) -> str:
    return f"event: {kind}\ndata: " + json.dumps({"type": kind, "sequence_number": seq, **fields}) + "\n\n"


class _Events:
    """The Responses events of one streamed response, numbered in order, with the response object they build."""

    def __init__(self, body: dict, rid: str, model: str):
        self.seq = 0
        self.doc = _envelope(body, rid, int(time.time()), model, "in_progress")
        self.text, self.msg_id, self.msg_index = "", None, None

    def ev(self, kind: str, **fields) -> str:
        self.seq += 1
        return _event(kind, self.seq - 1, **fields)

    def whole_items(self, items: list[dict]) -> list[str]:
        """Items complete at once (reasoning, function calls): added, then done."""
        out = []
        for item in items:
            self.doc["output"].append(item)
            at = len(self.doc["output"]) - 1
            if item["type"] == "function_call":
                out.append(self.ev("response.output_item.added", output_index=at, item={**item, "arguments": ""}))
                args = item["arguments"]
                out.append(
                    self.ev("response.function_call_arguments.delta", item_id=item["id"], output_index=at, delta=args)
                )
                out.append(
                    self.ev(
                        "response.function_call_arguments.done", item_id=item["id"], output_index=at, arguments=args
                    )
                )
            else:
                out.append(self.ev("response.output_item.added", output_index=at, item=item))
            out.append(self.ev("response.output_item.done", output_index=at, item=item))
        return out

    def text_delta(self, piece: str) -> list[str]:
        out = []
        if self.msg_id is None:  # the message item opens with its first text
            self.msg_id, self.msg_index = _item_id("msg"), len(self.doc["output"])
            self.doc["output"].append(None)
            item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}
            out.append(self.ev("response.output_item.added", output_index=self.msg_index, item=item))
            part = {"type": "output_text", "text": "", "annotations": []}
            where = {"item_id": self.msg_id, "output_index": self.msg_index, "content_index": 0}
            out.append(self.ev("response.content_part.added", **where, part=part))
        self.text += piece
        where = {"item_id": self.msg_id, "output_index": self.msg_index, "content_index": 0}
        out.append(self.ev("response.output_text.delta", **where, delta=piece))
        return out

    def message_done(self) -> list[str]:
        if self.msg_id is None:
            return []
        part = {"type": "output_text", "text": self.text, "annotations": []}
        where = {"item_id": self.msg_id, "output_index": self.msg_index, "content_index": 0}
        item = {"type": "message", "id": self.msg_id, "status": "completed", "role": "assistant", "content": [part]}
        self.doc["output"][self.msg_index] = item
        return [
            self.ev("response.output_text.done", **where, text=self.text),
            self.ev("response.content_part.done", **where, part=part),
            self.ev("response.output_item.done", output_index=self.msg_index, item=item),
        ]


async def stream_events(chat_sse: AsyncGenerator[str, None], body: dict, model: str) -> AsyncIterator[str]:
    """The chat stream (SSE `data:` chunks of one choice) re-emitted as Responses streaming events; closing this
    stream closes the chat stream (a client that hangs up aborts the decode as on chat completions)."""
    try:
        async for e in _translate(chat_sse, body, model):
            yield e
    finally:
        await chat_sse.aclose()


async def _translate(chat_sse: AsyncIterator[str], body: dict, model: str) -> AsyncIterator[str]:
    out: _Events | None = None
    reasoning, calls, finish, usage = "", {}, None, None
    async for raw in chat_sse:
        if not raw.startswith("data: ") or raw.startswith("data: [DONE]"):
            continue
        chunk = json.loads(raw[6:])
        if out is None:
            out = _Events(body, chunk.get("id") or _item_id("resp"), model)
            yield out.ev("response.created", response=out.doc)
            yield out.ev("response.in_progress", response=out.doc)
        if "error" in chunk:
            message = chunk["error"].get("message")
            yield out.ev("error", code=None, message=message, param=None)
            out.doc.update(status="failed", error={"code": "server_error", "message": message})
            yield out.ev("response.failed", response=out.doc)
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            finish = choice.get("finish_reason") or finish
            reasoning += delta.get("reasoning_content") or ""
            calls.update({c.get("index", len(calls)): c for c in delta.get("tool_calls") or []})
            if delta.get("content"):
                if out.msg_id is None and reasoning:  # a thinking reply's reasoning is whole before its content
                    for e in out.whole_items(_items(None, [], reasoning)):
                        yield e
                    reasoning = ""
                for e in out.text_delta(delta["content"]):
                    yield e
    if out is None:
        return
    for e in [*out.whole_items(_items(None, [], reasoning)), *out.message_done()]:
        yield e
    for e in out.whole_items(_items(None, [c for _, c in sorted(calls.items())], None)):
        yield e
    out.doc["usage"] = _usage(usage)
    _finished(out.doc, finish)
    yield out.ev("response.completed" if out.doc["status"] == "completed" else "response.incomplete", response=out.doc)
