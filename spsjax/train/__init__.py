"""Training: optimizer, losses (LM and distillation), checkpoints and the training loop."""
