"""gpulayer runtime."""
