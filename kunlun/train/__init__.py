"""Training and evaluation machinery: optimizer, train step, checkpoints, metrics, progress."""
