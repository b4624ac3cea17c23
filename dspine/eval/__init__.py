"""Evaluation: acceptance per benchmark x temperature through the engine, replay, the engine speed bench."""
