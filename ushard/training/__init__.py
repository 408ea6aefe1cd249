"""Training: optimizer, model state, the jitted step, and the loop around it."""
