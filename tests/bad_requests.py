"""Bad and hostile requests — chat completions, the Responses API and text completions — each with the 4xx and the
words its answer must carry: the same table is sent to `dspine serve` directly (test_server) and through the
LiteLLM proxy (test_proxy)."""

CHAT = {
    "model": "smol",
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 24,
    "temperature": 0,
}
RESP = {"model": "smol", "input": "Name three colours.", "max_output_tokens": 24, "temperature": 0}
CMPL = {"model": "smol", "prompt": "Name three colours.", "max_tokens": 8, "temperature": 0}
JSON = "application/json"
CHAT_PATH, RESP_PATH, CMPL_PATH = "/v1/chat/completions", "/v1/responses", "/v1/completions"


def case(name, body=None, raw=None, status=400, needle="", ctype=JSON, path=CHAT_PATH):
    return name, body, raw, status, needle, ctype, path


def resp(name, body=None, needle="", **kw):
    return case(f"responses: {name}", body, needle=needle, path=RESP_PATH, **kw)


def cmpl(name, body=None, needle="", **kw):
    return case(f"completions: {name}", body, needle=needle, path=CMPL_PATH, **kw)


def _input(*items):
    return {**RESP, "input": list(items)}


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
    # the Responses API (serve.responses): the same checks, and what a server without state cannot do
    resp("malformed JSON", raw=b"{not json", needle="not valid JSON"),
    resp("JSON array body", raw=b"[1]", needle="must be a JSON object"),
    resp("form content type", raw=b"model=smol", needle="takes a JSON body", ctype="application/x-www-form-urlencoded"),
    resp("missing input", {"model": "smol"}, needle="'input' must be a string or a non-empty list"),
    resp("empty input list", {**RESP, "input": []}, needle="non-empty list"),
    resp("input a number", {**RESP, "input": 7}, needle="'input' must be"),
    resp("input item not an object", _input("hi"), needle="input[0] must be an object"),
    resp("unknown item type", _input({"type": "computer_call", "id": "x"}), needle="'computer_call' is not supported"),
    resp("tool role message", _input({"role": "tool", "content": "x"}), needle="role must be"),
    resp("content a number", _input({"role": "user", "content": 5}), needle="content must be a string or a list"),
    resp(
        "image part",
        _input({"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}),
        needle="reads text only",
    ),
    resp("unknown part type", _input({"role": "user", "content": [{"type": "video"}]}), needle="unknown part type"),
    resp(
        "part text a number",
        _input({"role": "user", "content": [{"type": "input_text", "text": 3}]}),
        needle="text must be a string",
    ),
    resp(
        "function_call without arguments",
        _input({"type": "function_call", "call_id": "c1", "name": "f"}),
        needle="arguments must be a string",
    ),
    resp(
        "function_call_output without call_id",
        _input({"type": "function_call_output", "output": "x"}),
        needle="call_id",
    ),
    resp("instructions a number", {**RESP, "instructions": 1}, needle="'instructions' must be a string"),
    resp("previous_response_id", {**RESP, "previous_response_id": "resp_1"}, needle="keeps no conversations"),
    resp("conversation", {**RESP, "conversation": "conv_1"}, needle="keeps no conversations"),
    resp("stored prompt", {**RESP, "prompt": {"id": "pmpt_1"}}, needle="keeps no conversations"),
    resp("background", {**RESP, "background": True}, needle="answered while the request is open"),
    resp("hosted web search", {**RESP, "tools": [{"type": "web_search"}]}, needle="only function tools"),
    resp("function tool without a name", {**RESP, "tools": [{"type": "function"}]}, needle="tools[0].name"),
    resp("tools not a list", {**RESP, "tools": {"type": "function"}}, needle="'tools' must be a list"),
    resp("tool_choice of a hosted tool", {**RESP, "tool_choice": {"type": "file_search"}}, needle="tool_choice"),
    resp("json_schema output", {**RESP, "text": {"format": {"type": "json_schema"}}}, needle="text only"),
    resp("unknown field", {**RESP, "frequency": 1}, needle="unknown parameter"),
    resp("n", {**RESP, "n": 2}, needle="unknown parameter"),
    resp("negative max_output_tokens", {**RESP, "max_output_tokens": -1}, needle="'max_output_tokens' must be"),
    resp("max_output_tokens as text", {**RESP, "max_output_tokens": "8"}, needle="'max_output_tokens' must be"),
    resp("reasoning not an object", {**RESP, "reasoning": "high"}, needle="'reasoning' must be an object"),
    resp("invalid reasoning effort", {**RESP, "reasoning": {"effort": "extreme"}}, needle="reasoning_effort"),
    resp("temperature > 2", {**RESP, "temperature": 2.5}, needle="temperature"),
    resp("top_p 0", {**RESP, "top_p": 0}, needle="top_p"),
    resp("stream not a boolean", {**RESP, "stream": "yes"}, needle="stream"),
    resp("metadata not an object", {**RESP, "metadata": "swe"}, needle="metadata"),
    resp("seed past 64 bits", {**RESP, "seed": 2**64}, needle="seed"),
    resp("oversized input", {**RESP, "input": "word " * 400}, needle="at most 200"),
    resp("unknown model", {**RESP, "model": "gpt-9"}, status=404, needle="does not exist"),
    # text completions
    cmpl("malformed JSON", raw=b"{not json", needle="not valid JSON"),
    cmpl("missing prompt", {"model": "smol", "max_tokens": 4}, needle="'prompt' is required"),
    cmpl("empty prompt", {**CMPL, "prompt": ""}, needle="prompt"),
    cmpl("prompt a number", {**CMPL, "prompt": 5}, needle="prompt"),
    cmpl("several prompts", {**CMPL, "prompt": ["a", "b"]}, needle="one prompt per request"),
    cmpl("token id past the vocabulary", {**CMPL, "prompt": [1, 10**9]}, needle="token ids must be in"),
    cmpl("echo", {**CMPL, "echo": True}, needle="echo"),
    cmpl("best_of 3", {**CMPL, "best_of": 3}, needle="best_of"),
    cmpl("suffix", {**CMPL, "suffix": "end"}, needle="suffix"),
    cmpl("negative max_tokens", {**CMPL, "max_tokens": -5}, needle="max_tokens"),
    cmpl("temperature as text", {**CMPL, "temperature": "0.5"}, needle="temperature"),
    cmpl("stream not a boolean", {**CMPL, "stream": "yes"}, needle="stream"),
    cmpl("n = 0", {**CMPL, "n": 0}, needle="'n'"),
    cmpl("empty stop string", {**CMPL, "stop": ["ok", ""]}, needle="stop"),
    cmpl("seed past 64 bits", {**CMPL, "seed": 2**64}, needle="seed"),
    cmpl("oversized prompt", {**CMPL, "prompt": "word " * 400}, needle="at most 200"),
    cmpl("unknown model", {**CMPL, "model": "gpt-9"}, status=404, needle="does not exist"),
]
