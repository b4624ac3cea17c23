"""Adaptation (to come): Ray jobs that collect agent traces, fine-tune, replay, gate and deploy drafters."""
