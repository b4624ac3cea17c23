"""`python -m dspine.serve.litellm_main [litellm options]`: LiteLLM's own proxy CLI, with dspine's request gate
(serve.gate) in front of its app. `dspine proxy` starts this instead of the `litellm` script; the models the
gate knows come from DSPINE_PROXY_MODELS (comma-separated), the key from DSPINE_PROXY_KEY. Its first SIGTERM
drains (serve.gate.drain_then) before uvicorn's shutdown closes the port."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import (the cost map is local)


def main() -> None:
    import signal

    import uvicorn
    from litellm.proxy.proxy_cli import run_server
    from litellm.proxy.proxy_server import app

    from dspine.serve.gate import DRAIN, RequestGate, drain_then

    models = {m for m in os.environ.get("DSPINE_PROXY_MODELS", "").split(",") if m}
    app.add_middleware(RequestGate, models=models)  # before uvicorn starts the app (one worker: this module's app)
    exit_now = uvicorn.Server.handle_exit

    def handle_exit(self, sig, frame):  # the first SIGTERM drains (503 + Retry-After to new requests), then exits
        if sig == signal.SIGTERM and DRAIN["since"] is None:
            drain_then(lambda: exit_now(self, sig, frame))
        else:  # SIGINT, or a second SIGTERM: uvicorn's own shutdown now
            exit_now(self, sig, frame)

    uvicorn.Server.handle_exit = handle_exit  # before LiteLLM's CLI makes its uvicorn.Server (which binds it)
    run_server(prog_name="litellm")


if __name__ == "__main__":
    main()
