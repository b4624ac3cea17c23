"""Serving: the OpenAI-compatible server, its protocol and metrics, the LiteLLM proxy, the acceptance store and
dashboard, the load test. fastapi, litellm and prometheus_client are imported only here."""
