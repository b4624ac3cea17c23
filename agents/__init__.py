"""Agent harnesses (to come): SWE, tool-use and office agents driving an OpenAI-compatible endpoint."""
