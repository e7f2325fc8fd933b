"""gpulayer executor service."""
