"""gpulayer's own version, which jobs can constrain with ``requires_core``."""

__version__ = "0.1.0"
