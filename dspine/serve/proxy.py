"""`dspine proxy`: a real LiteLLM proxy in front of dspine / SGLang backends, with acceptance recorded.

Writes a LiteLLM config (one model entry per backend, OpenAI-compatible `openai/<served name>` at the
backend's /v1), a callbacks module next to it that LiteLLM imports (litellm_hooks: the acceptance
logger, the key check, 503 for a backend that cannot be reached) and starts LiteLLM's proxy CLI bound to
127.0.0.1 with dspine's request gate in front of its app (serve.litellm_main, serve.gate: malformed requests get
the server's own 4xx before LiteLLM runs). The master key is required and only
ever read from the environment (never written to disk); LiteLLM's model cost map is read locally
(`LITELLM_LOCAL_MODEL_COST_MAP=True`: no network at start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dspine.config import ConfigError
from dspine.io import atomic_write_text

CALLBACKS_MODULE = "dspine_litellm_callbacks"
KEY_ENV = "DSPINE_PROXY_KEY"
READ_KEY_ENV = "DSPINE_READ_KEY"  # the backends' read key (dspine serve --read-key)


def backend_read_key(env=None) -> str | None:
    """What the records of dspine serve backends are read with: DSPINE_READ_KEY, else DSPINE_ADMIN_KEY."""
    env = os.environ if env is None else env
    return env.get(READ_KEY_ENV) or env.get("DSPINE_ADMIN_KEY") or None


@dataclass
class Backend:
    name: str  # the model name clients ask the proxy for
    api_base: str  # the backend's OpenAI base, e.g. http://127.0.0.1:8000/v1
    model: str = "dspine"  # the name the backend serves (dspine serve --served-model-name / SGLang's)


@dataclass
class ProxyConfig:
    backends: list[Backend] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 4000
    db: str = "runs/proxy/acceptance.db"
    metrics_port: int = 0  # > 0: Prometheus metrics of the proxy's records on 127.0.0.1:metrics_port
    workdir: str = "runs/proxy"
    timeout_s: float = 600.0
    body_timeout_s: float = 30.0  # a request body that has not arrived whole by then gets 408 (the request gate)
    # WORKLOAD or WORKLOAD/LEVEL -> backend name: a request with that metadata.workload (and reasoning_effort) goes
    # to that backend whatever model it named — for backends of one target with drafters adapted per workload
    routes: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        if not self.backends:
            raise ConfigError("proxy: at least one backend is needed (--backend NAME=URL)")
        if self.body_timeout_s <= 0:
            raise ConfigError("proxy: --body-timeout must be > 0")
        names = [b.name for b in self.backends]
        seen = [(b.name, b.api_base.rstrip("/")) for b in self.backends]
        if len(set(seen)) != len(seen):
            twice = sorted({f"{n}={u}" for n, u in seen if seen.count((n, u)) > 1})
            raise ConfigError(f"proxy: backend given twice: {twice} (replicas of one name need distinct URLs)")
        for b in self.backends:
            if not b.api_base.startswith(("http://", "https://")):
                raise ConfigError(f"proxy: backend {b.name!r} needs an http(s) URL, got {b.api_base!r}")
        from dspine.serve.protocol import ROUTE, ROUTE_FORM

        for route, name in self.routes.items():
            if not ROUTE.fullmatch(route):
                raise ConfigError(f"proxy: route {route!r} is not {ROUTE_FORM}")
            if name not in names:
                raise ConfigError(f"proxy: route {route!r} names backend {name!r}, not one of {names}")


def parse_backend(text: str) -> Backend:
    """NAME=URL or NAME=URL@SERVED_NAME."""
    if "=" not in text:
        raise ConfigError(f"--backend {text!r} is not NAME=URL")
    name, url = text.split("=", 1)
    served = "dspine"
    if "@" in url.split("//", 1)[-1]:
        url, served = url.rsplit("@", 1)
    return Backend(name=name.strip(), api_base=url.strip().rstrip("/"), model=served.strip())


def parse_route(text: str) -> tuple[str, str]:
    """ROUTE=BACKEND, e.g. tool=smol-tool or swe/high=smol-swe."""
    from dspine.serve.protocol import split_route

    try:
        return split_route(text, "BACKEND")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def litellm_config(cfg: ProxyConfig) -> dict:
    return {
        "model_list": [
            {
                "model_name": b.name,
                "litellm_params": {
                    "model": f"openai/{b.model}",
                    "api_base": b.api_base,
                    "api_key": "none",
                    "timeout": cfg.timeout_s,
                    "max_retries": 0,
                },
            }
            for b in cfg.backends
        ],
        "litellm_settings": {
            "callbacks": f"{CALLBACKS_MODULE}.handler",
            "num_retries": 0,
            "request_timeout": cfg.timeout_s,
        },
        # a name given several backends (replicas of one target) is one LiteLLM model group: each request goes to
        # one of them at random (simple-shuffle), so concurrent clients spread over the replicas. No cooldowns: a
        # failure (an endpoint the backend lacks, a 404) would cool a backend down and answer every other client 429
        # until it ends; a replica that is down answers the requests it draws 503 (the callbacks' unreachable
        # check), which clients retry
        "router_settings": {"disable_cooldowns": True, "routing_strategy": "simple-shuffle"},
        "general_settings": {
            "master_key": f"os.environ/{KEY_ENV}",
            "custom_auth": f"{CALLBACKS_MODULE}.auth",
            "always_include_stream_usage": True,  # a stream ends with its usage, as the server sends it
        },
    }


def api_bases(cfg: ProxyConfig) -> dict[str, list[str]]:
    """Model name -> the OpenAI bases of its backends (several: replicas), where the callbacks ask for records."""
    out: dict[str, list[str]] = {}
    for b in cfg.backends:
        out.setdefault(b.name, []).append(b.api_base)
    return out


def write_proxy_files(cfg: ProxyConfig) -> Path:
    """workdir/config.yaml (JSON is YAML) and the callbacks module LiteLLM imports from beside it."""
    cfg.validate()
    work = Path(cfg.workdir)
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        work / f"{CALLBACKS_MODULE}.py",
        '"""Written by `dspine proxy`: the hooks LiteLLM loads (see dspine/serve/litellm_hooks.py)."""\n'
        "from dspine.serve.litellm_hooks import DSpineLogger, auth  # noqa: F401\n\n"
        "handler = DSpineLogger.from_env()\n",
    )
    path = work / "config.yaml"
    atomic_write_text(path, json.dumps(litellm_config(cfg), indent=1) + "\n")
    return path


def proxy_env(cfg: ProxyConfig, key: str, read_key: str | None = None) -> dict:
    """The child's environment: the master key, the backends' read key (`read_key`, else DSPINE_READ_KEY as it
    is: what the records of dspine serve backends are read with), the store, metrics, models and routes."""
    if not key:
        raise ConfigError(f"the proxy needs a master key: set {KEY_ENV}")
    env = dict(os.environ)
    if read_key:
        env[READ_KEY_ENV] = read_key
    env.update(
        {
            KEY_ENV: key,
            "DSPINE_PROXY_DB": str(Path(cfg.db).resolve()),
            "DSPINE_PROXY_METRICS_PORT": str(cfg.metrics_port),
            "DSPINE_PROXY_MODELS": ",".join(dict.fromkeys(b.name for b in cfg.backends)),
            "DSPINE_PROXY_ROUTES": json.dumps(cfg.routes),
            "DSPINE_PROXY_API_BASES": json.dumps(api_bases(cfg)),
            "DSPINE_PROXY_BODY_TIMEOUT": str(cfg.body_timeout_s),
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_TELEMETRY": "False",
            "PYTHONPATH": os.pathsep.join(
                [str(Path(cfg.workdir).resolve())] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
            ),
        }
    )
    return env


# Runs first in the child: asks the kernel for SIGTERM when the parent dies (SIGKILL included), then becomes
# LiteLLM. If the parent is already gone by then, the child exits instead of serving as an orphan.
_WITH_PARENT = (
    "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 15, 0, 0, 0)\n"  # PR_SET_PDEATHSIG, SIGTERM
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def check_port_free(host: str, port: int, what: str) -> None:
    """ConfigError when something already listens there (LiteLLM would silently take another port)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # as the server will bind it (uvicorn sets SO_REUSEADDR): connections of a proxy just stopped, left in
        # TIME_WAIT, do not make the port busy; a listener does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"proxy: {what} {host}:{port} is busy ({e.strerror}); choose another port") from None


def start_proxy(cfg: ProxyConfig, key: str | None = None, log=None, read_key: str | None = None) -> subprocess.Popen:
    """Start LiteLLM (a child process in its own process group, ended by the kernel if this process dies) and
    return once it answers; raises if a port is busy, or if it dies or never answers. `read_key`: the dspine
    serve backends' read key (default: DSPINE_READ_KEY)."""
    from dspine.process import wait_http

    key = key if key is not None else os.environ.get(KEY_ENV, "")
    env = proxy_env(cfg, key, read_key)
    check_port_free(cfg.host, cfg.port, "port")
    if cfg.metrics_port:
        check_port_free("127.0.0.1", cfg.metrics_port, "metrics port")
    path = write_proxy_files(cfg)
    cmd = [
        sys.executable,
        "-m",
        "dspine.serve.litellm_main",
        "--config",
        str(path.resolve()),
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
    ]
    if sys.platform.startswith("linux"):
        cmd = [sys.executable, "-c", _WITH_PARENT, str(os.getpid()), *cmd]
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=cfg.workdir,
        stdout=log or subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_http(f"http://{cfg.host}:{cfg.port}/health/liveliness", proc, 180)
    return proc


def stop_proxy(proc: subprocess.Popen, timeout: float = 30) -> int:
    """End LiteLLM and everything in its process group."""
    import signal

    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()
