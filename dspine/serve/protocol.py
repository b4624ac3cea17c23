"""The OpenAI request surface `dspine serve` accepts, as typed models, and tool calling on a plain target.

Requests: chat messages with string content or lists of text parts, assistant messages whose content is null
and that carry `tool_calls`, `tool` messages with a `tool_call_id`, `tools` and `tool_choice` (none / auto /
required / a named function); unknown fields are ignored, as OpenAI-compatible servers do, but every known
field is checked and a wrong one is named in the 400. `n` (choices, decoded side by side), `logprobs` /
`top_logprobs` (the target's own distribution) and presence/frequency penalties are honoured; known fields
the engine does not implement (`logit_bias`, `response_format` other than text, legacy `functions`, predicted
outputs, web search, audio, a service tier other than auto/default, completions' `echo` / `best_of` / `suffix`)
are refused by name rather than silently ignored; `parallel_tool_calls: false` keeps the first call only.

Tools reach the target through its chat template when the template has a tools section (`tools=` is passed
to it); otherwise they go into a system block (`tools_system_block`) in the Hermes/Qwen layout:

    # Tools
    ...one JSON schema per line between <tools> and </tools>, then how to call:
    <tool_call>{"name": "<function name>", "arguments": {...}}</tool_call>

and earlier tool calls and results are written back in the same format (an assistant turn holding its
<tool_call> blocks; a tool result inside <tool_response></tool_response> as a user turn). Generated text is
parsed back (`parse_tool_calls`): every <tool_call> block holding a JSON object with a name and arguments
becomes one entry of `tool_calls` (finish_reason "tool_calls"); without blocks, a reply that is a single JSON
object naming an offered function is one call. Anything malformed stays plain content.
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning_effort values
# a drafter route: WORKLOAD or WORKLOAD/LEVEL (the server's per-workload drafters, the proxy's per-workload backends)
ROUTE = re.compile(rf"[A-Za-z0-9_.-]{{1,64}}(/({'|'.join(EFFORTS)}))?")
ROUTE_FORM = f"WORKLOAD or WORKLOAD/LEVEL (LEVEL one of {'/'.join(EFFORTS)})"


def route_of_request(routes: dict, workload, level: str | None):
    """The most specific of `routes` for a request: WORKLOAD/LEVEL, then WORKLOAD; None when neither is there."""
    return routes.get(f"{workload}/{level or 'none'}") or routes.get(str(workload))


def split_route(text: str, value: str) -> tuple[str, str]:
    """ROUTE=VALUE (a --route option) -> (route, value); ValueError naming the expected form."""
    route, sep, rest = text.partition("=")
    route, rest = route.strip(), rest.strip()
    if not sep or not rest or not ROUTE.fullmatch(route):
        raise ValueError(f"--route {text!r} is not ROUTE={value}, ROUTE being {ROUTE_FORM}")
    return route, rest


MAX_N = 16  # choices per request


def _not_text(v):
    """Numbers arrive as JSON numbers: a string or a boolean is refused rather than coerced."""
    if isinstance(v, (str, bool)):
        raise ValueError(f"must be a number, got {v!r}")
    return v


Int = Annotated[int, BeforeValidator(_not_text)]
Float = Annotated[float, BeforeValidator(_not_text), Field(allow_inf_nan=False)]
Bool = Annotated[bool, Field(strict=True)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str = "{}"

    @model_validator(mode="before")
    @classmethod
    def _arguments_as_text(cls, v):
        if isinstance(v, dict) and isinstance(v.get("arguments"), dict):  # some clients send the object itself
            v = {**v, "arguments": json.dumps(v["arguments"])}
        return v


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                f"a {self.role} message needs content (only an assistant message with tool_calls may have none)"
            )
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Model):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class _Request(_Model):
    model: str | None = None
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[Int, Field(ge=0)] | None = None
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
    seed: Annotated[int, Field(strict=True, ge=-(2**63), le=2**64 - 1)] | None = None  # what a torch generator takes
    stream: Bool = False
    metadata: dict[str, Any] | None = None
    reasoning_effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]
    return_spec_tokens_details: Bool = False
    return_meta_info: Bool = False
    return_token_ids: Bool = False  # vLLM's field: prompt_token_ids (top level) and token_ids (per choice)
    record_token_ids: Bool = False  # dspine's: the server's record keeps the exact ids, the reply does not carry them
    ignore_eos: Bool = False  # vLLM's and SGLang's field: decode past the end-of-sequence token
    user: str | None = None
    stream_options: dict[str, Any] | None = None  # usage always comes in the last chunk
    store: Bool | None = None  # every request is recorded by the server anyway (/v1/dspine/requests)
    n: Annotated[Int, Field(ge=1, le=MAX_N)] = 1
    timeout: Annotated[Float, Field(gt=0)] | None = None  # seconds this request may decode (then aborted)
    presence_penalty: Annotated[Float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] = 0.0


# Known OpenAI fields the engine does not implement: refused by name unless given a value that means "off"
# (field -> that test), rather than silently ignored.
UNSUPPORTED = {
    "logit_bias": lambda v: v == {},
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
    "functions": lambda v: False,  # the legacy form of tools
    "function_call": lambda v: False,
    "prediction": lambda v: False,  # predicted outputs
    "web_search_options": lambda v: False,
    "audio": lambda v: False,
    "modalities": lambda v: v == ["text"],
    "service_tier": lambda v: v in ("auto", "default"),
    "echo": lambda v: v is False,
    "best_of": lambda v: v == 1,
    "suffix": lambda v: v == "",
}


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _choice_names_a_tool(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, not among the tools {names}")
        return self

    def active_tools(self) -> list[Tool]:
        """The tools the model is offered (none with tool_choice "none")."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    def top_k_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _one_prompt(v):
    """A completions prompt as OpenAI takes it — a string, token ids, or a list holding one of either — -> the
    string or the ids; several prompts in one request are refused (send them as separate requests)."""
    if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
        if len(v) != 1:
            raise ValueError(f"one prompt per request, got {len(v)} (send them as separate requests)")
        v = v[0]
    if isinstance(v, str) and v:
        return v
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    raise ValueError("must be a non-empty string or a non-empty list of token ids")


class CompletionRequest(_Request):
    prompt: Annotated[str | list[int], BeforeValidator(_one_prompt)]
    logprobs: Annotated[Int, Field(ge=0, le=5)] | None = None  # the legacy form: how many top tokens

    def top_k_logprobs(self) -> int | None:
        return self.logprobs


# ---- responses (built with every field given and dumped with exclude_unset: absent stays absent, null stays null)
class PromptTokensDetails(_Model):
    cached_tokens: int  # prompt tokens reused from the prefix cache, not prefilled again


class Usage(_Model):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class AssistantMessage(_Model):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # a thinking target's reasoning (its <think> block), apart from content


class ChatChoice(_Model):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None


class TextChoice(_Model):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None


class Delta(_Model):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # each with its "index", as OpenAI streams them


class DeltaChoice(_Model):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None  # on the last chunk, with return_token_ids


class Completion(_Model):
    """A chat.completion, text_completion or one streamed chunk; SGLang's sglext / meta_info ride along."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["chat.completion", "chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ChatChoice | TextChoice | DeltaChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None

    def dump(self) -> dict:
        return self.model_dump(exclude_unset=True)


class RequestInvalid(ValueError):
    """A request that does not fit the models: the message names the field."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def read_json(raw: bytes, content_type: str = "application/json") -> Any:
    """A request body -> its JSON value, or RequestInvalid naming what is wrong with it (and the Content-Type,
    when that was not JSON either)."""
    try:
        body = json.loads(raw or b"null")
        json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate (\\ud800) cannot be encoded
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        sent = (
            ""
            if "json" in content_type
            else f" (sent as {content_type or 'no Content-Type'}: this endpoint takes a JSON body)"
        )
        raise RequestInvalid(f"the request body is not valid JSON: {e}{sent}", None) from None
    except RecursionError:
        raise RequestInvalid("the request body is nested too deeply", None) from None
    except UnicodeEncodeError:
        raise RequestInvalid("the request body holds invalid Unicode (a lone surrogate)", None) from None
    except ValueError as e:  # an integer past the interpreter's digit limit, and any other unreadable value
        raise RequestInvalid(f"the request body cannot be read: {e}", None) from None
    return body


ERROR_TYPES = {
    401: "auth_error",
    404: "not_found_error",
    405: "method_not_allowed",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def key_matches(given: str | None, *keys: str | None) -> bool:
    """Whether `given` is one of the keys that are set, compared in constant time; no key set: nothing matches."""
    import hmac

    return given is not None and any(k and hmac.compare_digest(given.encode(), k.encode()) for k in keys)


def bearer_matches(authorization: str | None, *keys: str | None) -> bool:
    """Whether an Authorization header is `Bearer K` for one of the keys that are set (key_matches)."""
    auth = authorization or ""
    return auth.lower().startswith("bearer ") and key_matches(auth[7:], *keys)


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """A refusal in OpenAI's error shape (the server's and the proxy's)."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def parse_request(body: Any, chat: bool, refuse_unsupported: bool = True) -> ChatRequest | CompletionRequest:
    """A JSON body -> the checked request, or RequestInvalid naming the field. `refuse_unsupported=False` (the
    proxy's gate, in front of backends that may implement them) lets the UNSUPPORTED fields through."""
    if not isinstance(body, dict):
        raise RequestInvalid("the request body must be a JSON object", None)
    for name, off in UNSUPPORTED.items() if refuse_unsupported else ():
        if body.get(name) is not None and not off(body[name]):
            raise RequestInvalid(
                f"'{name}' is not supported by this server yet (got {body[name]!r}); leave it out", name
            )
    try:
        return (ChatRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"] if not str(x).startswith(("function-after", "function-before"))]
        field = ".".join(loc) or "body"
        if err["type"] == "missing" and loc == ["messages"]:
            msg = "'messages' is required: a non-empty list of {role, content}"
        elif err["type"] == "missing" and loc == ["prompt"]:
            msg = "'prompt' is required: a non-empty string or token ids"
        else:
            got = f" (got {err['input']!r})" if _short(err.get("input")) and "got" not in err["msg"] else ""
            msg = f"'{field}': {err['msg'].removeprefix('Value error, ')}{got}"
        raise RequestInvalid(msg, loc[0] if loc else None) from None


def _short(v) -> bool:
    return isinstance(v, (int, float, str, bool)) and len(repr(v)) <= 80


# ---- logprobs out ------------------------------------------------------------------------------------------
def logprobs_doc(entries: list, decode, chat: bool) -> dict:
    """engine logprobs ([(logprob, [(id, logprob)])] per token, with the token ids) -> OpenAI's shape: chat
    {"content": [{token, logprob, bytes, top_logprobs}]}; completions {tokens, token_logprobs, top_logprobs,
    text_offset}. `entries`: [(token id, (logprob, top))]; `decode`: id -> text."""
    if chat:

        def item(t, lp):
            text = decode(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]} for t, (lp, top) in entries]}
    tokens = [decode(t) for t, _ in entries]
    offsets = list(itertools.accumulate((len(x) for x in tokens[:-1]), initial=0)) if tokens else []
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, (lp, _) in entries],
        "top_logprobs": [{decode(i): v for i, v in top} for _, (_, top) in entries],
        "text_offset": offsets,
    }


# ---- tools into the prompt ---------------------------------------------------------------------------------
def template_has_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def tools_system_block(tools: list[Tool], tool_choice) -> str:
    from dspine.target import tools_system_text  # torch: not imported where only requests are checked (the proxy)

    text = tools_system_text([t.model_dump(exclude_none=True) for t in tools])
    if tool_choice == "required":
        text += "\n\nCall at least one function."
    elif isinstance(tool_choice, NamedToolChoice):
        text += f"\n\nCall the function {tool_choice.function.name}."
    return text


def _arguments(c: ToolCall):
    """A call's arguments as the object they encode (the client's text when it is not JSON)."""
    try:
        return json.loads(c.function.arguments)
    except json.JSONDecodeError:
        return c.function.arguments


def _call_block(c: ToolCall) -> str:
    return "<tool_call>\n" + json.dumps({"name": c.function.name, "arguments": _arguments(c)}) + "\n</tool_call>"


def template_messages(req: ChatRequest, native_tools: bool) -> tuple[list[dict], dict]:
    """-> (messages for the chat template, extra template kwargs). With `native_tools` the template renders
    tools, tool calls and tool results itself; otherwise they become text in the documented format."""
    tools = req.active_tools()
    if native_tools:
        msgs = []
        for m in req.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [
                    {
                        "type": "function",
                        "id": c.id,
                        "function": {"name": c.function.name, "arguments": _arguments(c)},
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            msgs.append(d)
        return msgs, ({"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {})
    msgs = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        if m.role == "tool":
            msgs.append({"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
        elif m.tool_calls:
            blocks = "\n".join(_call_block(c) for c in m.tool_calls)
            msgs.append({"role": "assistant", "content": (m.text() + "\n" if m.text() else "") + blocks})
        else:
            msgs.append({"role": role, "content": m.text()})
    if tools:
        block = tools_system_block(tools, req.tool_choice)
        if msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + block}
        else:
            msgs.insert(0, {"role": "system", "content": block})
    return msgs, {}


# ---- tool calls out of the generated text ------------------------------------------------------------------
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"


def _one_call(raw: str, names: set[str] | None) -> dict | None:
    """JSON text of one call -> an OpenAI tool call, or None when it is not a well-formed call of an offered
    function."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict) or (names is not None and obj["name"] not in names):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args)},
    }


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str | None, list[dict]]:
    """Generated text -> (content, tool_calls). Content is the text outside the <tool_call> blocks (None
    when empty); with no parsable call the whole text is the content and the list is empty. `names`: the
    offered functions (a call to any other is not a call)."""
    blocks = list(_BLOCK.finditer(text))
    if blocks:
        calls = [_one_call(b.group(1), names) for b in blocks]
        if None in calls:
            return text, []
        return _BLOCK.sub("", text).strip() or None, calls
    stripped = text.strip()
    call = _one_call(stripped, names) if names is not None and stripped.startswith("{") else None
    return (None, [call]) if call is not None else (text, [])


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """A thinking target's reply -> (reasoning, the rest): the <think> block apart from what follows it (Qwen3's
    own chat template splits a turn the same way). A reply cut inside its block is all reasoning; a reply without
    one has none."""
    head = text.lstrip("\n")
    if THINK_CLOSE in head:
        reasoning, rest = head.split(THINK_CLOSE, 1)
        return reasoning.removeprefix(THINK_OPEN).strip("\n"), rest.lstrip("\n")
    if head.startswith(THINK_OPEN):
        return head[len(THINK_OPEN) :].strip("\n"), ""
    return None, text


def streamable_prefix(text: str) -> str:
    """With tools offered: the part of the text so far that is surely content — everything before a
    <tool_call> tag (or before a tail that could be the start of one); nothing while the reply could be a
    bare JSON call."""
    if text.lstrip().startswith("{"):
        return ""
    i = text.find(TOOL_CALL_OPEN)
    if i >= 0:
        return text[:i]
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-k:]):
            return text[:-k]
    return text
