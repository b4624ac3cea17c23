"""`python -m dspine.serve.litellm_main [litellm options]`: LiteLLM's own proxy CLI, with dspine's request gate
(serve.gate) in front of its app. `dspine proxy` starts this instead of the `litellm` script; the models the
gate knows come from DSPINE_PROXY_MODELS (comma-separated), the key from DSPINE_PROXY_KEY."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import (the cost map is local)


def main() -> None:
    from litellm.proxy.proxy_cli import run_server
    from litellm.proxy.proxy_server import app

    from dspine.serve.gate import RequestGate

    models = {m for m in os.environ.get("DSPINE_PROXY_MODELS", "").split(",") if m}
    app.add_middleware(RequestGate, models=models)  # before uvicorn starts the app (one worker: this module's app)
    run_server(prog_name="litellm")


if __name__ == "__main__":
    main()
