"""Training: target-regenerated data, losses, the lockstep loop, the acceptance recipe, one pipeline entry."""
