"""`dspine serve` (the OpenAI-compatible server), `dspine proxy` (LiteLLM in front, recording acceptance) and
`dspine dashboard`."""

from __future__ import annotations

import os
import sys

from dspine.cli.common import (
    UsageError,
    add_draft_dtype,
    add_drafter,
    add_engine_options,
    add_target,
    drafter_dtype,
    engine_from_args,
    split_drafter_spec,
    torch_dtype,
)
from dspine.config import add_arguments
from dspine.serve.config import ServeConfig


def add_serve(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible server over the embedded engine",
        description="Serve /v1/chat/completions, /v1/completions (streaming and not), /v1/models, "
        "/health and /metrics over the embedded engine, answering acceptance in SGLang's "
        "shape (return_spec_tokens_details / return_meta_info).",
    )
    add_target(s)
    add_draft_dtype(s)
    add_drafter(s, "builtin for the built-in target, else none")
    add_engine_options(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    add_arguments(s, ServeConfig)
    s.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="WORKLOAD[/LEVEL]=CHECKPOINT",
        help="another drafter beside the default one for the requests of a workload (metadata.workload; /LEVEL: "
        "and reasoning_effort), repeatable, e.g. tool=runs/adapted/tool or swe/high=none (AR); a request takes "
        "the most specific route that matches it, else --drafter",
    )


def add_proxy(sub) -> None:
    px = sub.add_parser(
        "proxy",
        help="a LiteLLM proxy in front of dspine/SGLang backends, recording acceptance",
        description="Write a LiteLLM config for the given backends and run the real LiteLLM proxy "
        "(bound to 127.0.0.1). Every request is recorded once — model, drafter, "
        "workload (request metadata.workload), thinking level (reasoning_effort), "
        "tokens, tau, verify rounds, per-slot histogram, latency — in a SQLite store "
        "that `dspine dashboard` reads, and in Prometheus metrics. The master key is "
        "read from the environment variable DSPINE_PROXY_KEY; clients send it as "
        "their API key.",
    )
    px.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="NAME=URL[@SERVED]",
        help="a backend (repeatable): the model name clients use = the backend's OpenAI base URL, "
        "e.g. smol=http://127.0.0.1:8000/v1 (@SERVED: the backend's own model name, default dspine); one name "
        "given several URLs is served by those replicas, each request by one of them at random",
    )
    px.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="WORKLOAD[/LEVEL]=BACKEND",
        help="send the requests of a workload (metadata.workload; /LEVEL: and reasoning_effort) to a backend "
        "whatever model they name (repeatable), e.g. tool=smol-tool: backends of one target whose drafters "
        "were adapted per workload (one dspine serve can also hold them all: POST /v1/dspine/drafter with a route)",
    )
    px.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    px.add_argument("--port", type=int, default=4000, help="port (default: %(default)s)")
    px.add_argument("--db", default="runs/proxy/acceptance.db", help="SQLite acceptance store (default: %(default)s)")
    px.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve the proxy's Prometheus metrics on 127.0.0.1:PORT (default: off)",
    )
    px.add_argument(
        "--workdir", default="runs/proxy", help="where the LiteLLM config is written (default: %(default)s)"
    )
    px.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive whole; slower ones get 408 (default: %(default)s)",
    )


def add_dashboard(sub) -> None:
    db = sub.add_parser(
        "dashboard",
        help="web page over the acceptance store",
        description="Serve a page with tau by workload x thinking level, per-slot acceptance "
        "curves, tau over time and requests/s, read from the proxy's SQLite store.",
    )
    db.add_argument("--db", default="runs/proxy/acceptance.db", help="SQLite acceptance store (default: %(default)s)")
    db.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    db.add_argument("--port", type=int, default=8050, help="port (default: %(default)s)")
    db.add_argument("--bucket-seconds", type=float, default=60.0, help="time-series bucket (default: %(default)s)")
    db.add_argument(
        "--loop",
        help="the adaptation loop's folder (adapt/loop.py --work): also show each iteration's held-out tau base vs "
        "adapted per workload x level and the deploy history (read on every refresh)",
    )


def cmd_serve(a) -> int:
    from dspine.checkpoint import load_drafter, resolve_drafter
    from dspine.config import from_arguments
    from dspine.serve.server import ServeConfig, drafter_label, serve
    from dspine.target import load_target

    try:
        cfg = from_arguments(ServeConfig, a, draft_dtype=a.draft_dtype)
    except ValueError as e:
        raise UsageError(str(e)) from None
    spec, suffix = split_drafter_spec(a.drafter)
    a.drafter = resolve_drafter(spec, a.target, default=True)
    from dspine.serve.protocol import split_route

    routes = {}
    for text in a.route:
        try:
            route, path = split_route(text, "CHECKPOINT")
        except ValueError as e:
            raise UsageError(str(e)) from None
        routes[route] = resolve_drafter(path, a.target) or path
    target = load_target(a.target, dtype=torch_dtype(a.dtype), device=a.device)
    drafter = load_drafter(a.drafter, target, dtype=drafter_dtype(a, target), device=a.device) if a.drafter else None
    name = drafter_label(a.drafter) if a.drafter else None
    engine = engine_from_args(a, target, drafter, suffix)
    serve(engine, a.host, a.port, cfg, drafter_name=name, drafter_path=a.drafter, routes=routes)
    return 0


def cmd_proxy(a) -> int:
    import signal

    from dspine.serve.gate import GRACE_S
    from dspine.serve.proxy import (
        ProxyConfig,
        backend_read_key,
        parse_backend,
        parse_route,
        start_proxy,
        stop_proxy,
    )

    cfg = ProxyConfig(
        backends=[parse_backend(b) for b in a.backend],
        routes=dict(parse_route(r) for r in a.route),
        host=a.host,
        port=a.port,
        db=a.db,
        metrics_port=a.metrics_port,
        workdir=a.workdir,
        body_timeout_s=a.body_timeout,
    )
    proc = start_proxy(cfg, log=sys.stdout)
    print(f"dspine proxy: LiteLLM on http://{a.host}:{a.port}/v1 (store {a.db}); Ctrl-C stops it", file=sys.stderr)
    if not backend_read_key():
        print(
            "dspine proxy: DSPINE_READ_KEY is not set, so the records of dspine serve backends (streamed "
            "requests' acceptance, agent traffic's token ids) cannot be read: set it as on `dspine serve --read-key`",
            file=sys.stderr,
        )

    def stop(signum, frame):  # SIGTERM stops it like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the proxy drains first (503 to new requests): wait as long as it may
        return stop_proxy(proc, timeout=GRACE_S + 15)


def cmd_dashboard(a) -> int:

    from dspine.serve.dashboard import serve_dashboard

    if not os.path.isfile(a.db):
        raise UsageError(f"no acceptance store at {a.db} (start `dspine proxy --db {a.db}` first)")
    if a.loop and not os.path.isdir(a.loop):
        raise UsageError(f"--loop {a.loop}: no such folder (adapt/loop.py's --work)")
    print(f"dspine dashboard: http://{a.host}:{a.port}/", file=sys.stderr)
    serve_dashboard(a.db, a.host, a.port, a.bucket_seconds, a.loop)
    return 0
