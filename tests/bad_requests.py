"""Bad and hostile chat requests, each with the 4xx and the words its answer must carry — the same table is
sent to `dspine serve` directly (test_server) and through the LiteLLM proxy (test_proxy)."""

CHAT = {
    "model": "smol",
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 24,
    "temperature": 0,
}
JSON = "application/json"


def case(name, body=None, raw=None, status=400, needle="", ctype=JSON):
    return name, body, raw, status, needle, ctype


def _msg(content):
    return {**CHAT, "messages": [{"role": "user", "content": content}]}


BAD = [
    # the body itself
    case("malformed JSON", raw=b"{not json", needle="not valid JSON"),
    case("empty body", raw=b"", needle="must be a JSON object"),
    case("JSON array body", raw=b"[1, 2]", needle="must be a JSON object"),
    case("invalid UTF-8", raw=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', needle="not valid JSON"),
    case(
        "form content type",
        raw=b"model=smol&max_tokens=4",
        needle="takes a JSON body",
        ctype="application/x-www-form-urlencoded",
    ),
    case("50k-deep nesting", raw=b"[" * 50_000, needle="nested too deeply"),
    case("lone surrogate", raw=b'{"messages": [{"role": "user", "content": "\\ud800"}]}', needle="lone surrogate"),
    case(
        "NaN temperature",
        raw=b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        needle="finite number",
    ),
    case(
        "Infinity top_p",
        raw=b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        needle="finite number",
    ),
    # messages
    case("missing messages", {"model": "smol", "max_tokens": 4}, needle="messages"),
    case("empty messages", {**CHAT, "messages": []}, needle="messages"),
    case("messages not a list", {**CHAT, "messages": "hi"}, needle="messages"),
    case("content 123", _msg(123), needle="messages.0.content"),
    case("user content null", _msg(None), needle="needs content"),
    case("unknown role", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, needle="messages.0.role"),
    case("tool result without id", {**CHAT, "messages": [{"role": "tool", "content": "4"}]}, needle="tool_call_id"),
    case(
        "tool call without function",
        {**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]},
        needle="tool_calls",
    ),
    case("oversized prompt", _msg("word " * 400), needle="at most 200"),
    # sampling and lengths
    case("negative max_tokens", {**CHAT, "max_tokens": -5}, needle="max_tokens"),
    case("max_tokens as a fraction", {**CHAT, "max_tokens": 1.5}, needle="max_tokens"),
    case("max_tokens beyond the context", {**CHAT, "max_tokens": 1_000_000_000}, needle="context window"),
    case("temperature < 0", {**CHAT, "temperature": -0.1}, needle="temperature"),
    case("temperature > 2", {**CHAT, "temperature": 2.5}, needle="temperature"),
    case("temperature as text", {**CHAT, "temperature": "0.5"}, needle="temperature"),
    case("top_p 0", {**CHAT, "top_p": 0}, needle="top_p"),
    case("negative top_k", {**CHAT, "top_k": -1}, needle="top_k"),
    case("empty stop string", {**CHAT, "stop": ["ok", ""]}, needle="stop"),
    case("seed as a fraction", {**CHAT, "seed": 1.5}, needle="seed"),
    case("seed past 64 bits", {**CHAT, "seed": 2**64}, needle="seed"),
    case("seed below -2**63", {**CHAT, "seed": -(2**63) - 1}, needle="seed"),
    case(
        "a 5000-digit integer",
        raw=b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",
        needle="cannot be read",
    ),
    case("n = 0", {**CHAT, "n": 0}, needle="'n'"),
    case("n above the limit", {**CHAT, "n": 17}, needle="'n'"),
    case("n as text", {**CHAT, "n": "2"}, needle="'n'"),
    case("presence_penalty above 2", {**CHAT, "presence_penalty": 3}, needle="presence_penalty"),
    case("frequency_penalty as text", {**CHAT, "frequency_penalty": "high"}, needle="frequency_penalty"),
    case("logprobs as a number", {**CHAT, "logprobs": 2}, needle="logprobs"),
    case("top_logprobs above 20", {**CHAT, "logprobs": True, "top_logprobs": 21}, needle="top_logprobs"),
    case("top_logprobs without logprobs", {**CHAT, "top_logprobs": 2}, needle="needs logprobs"),
    case("stream not a boolean", {**CHAT, "stream": "yes"}, needle="stream"),
    case("return_meta_info as text", {**CHAT, "return_meta_info": "yes"}, needle="return_meta_info"),
    case("invalid reasoning_effort", {**CHAT, "reasoning_effort": "extreme"}, needle="reasoning_effort"),
    case("metadata not an object", {**CHAT, "metadata": "swe"}, needle="metadata"),
    # tools and fields refused by name
    case("tools not a list", {**CHAT, "tools": {"type": "function"}}, needle="tools"),
    case("tool without a name", {**CHAT, "tools": [{"type": "function", "function": {}}]}, needle="tools.0"),
    case(
        "tool_choice names no tool",
        {**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        needle="not among the tools",
    ),
    case("json response_format", {**CHAT, "response_format": {"type": "json_object"}}, needle="response_format"),
    case("logit_bias", {**CHAT, "logit_bias": {"1": 5}}, needle="'logit_bias' is not supported"),
    case("legacy functions", {**CHAT, "functions": [{"name": "f", "parameters": {}}]}, needle="'functions'"),
    case("legacy function_call", {**CHAT, "function_call": "auto"}, needle="'function_call'"),
    case("predicted outputs", {**CHAT, "prediction": {"type": "content", "content": "x"}}, needle="'prediction'"),
    case("priority service tier", {**CHAT, "service_tier": "priority"}, needle="'service_tier'"),
    # the model
    case("unknown model", {**CHAT, "model": "gpt-9"}, status=404, needle="does not exist"),
]
