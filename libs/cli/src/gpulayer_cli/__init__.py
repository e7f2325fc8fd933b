"""gpulayer cli."""
