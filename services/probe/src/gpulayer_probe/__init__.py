"""gpulayer probe service."""
