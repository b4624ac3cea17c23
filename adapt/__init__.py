"""Adaptation: Ray jobs over agent traces. `collect.py` (collection.py) collects them; fine-tuning, replay, gating and
deployment are to come."""
