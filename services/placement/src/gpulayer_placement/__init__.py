"""gpulayer placement service."""
