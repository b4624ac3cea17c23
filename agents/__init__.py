"""Agent harnesses driving an OpenAI-compatible endpoint: swe (mini-swe-agent), tool (tau-bench-style customer
service), office (OfficeBench); their shared base, the jail their tools run in, and the trace format."""
