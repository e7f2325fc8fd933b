"""gpulayer detection: what this machine can do (devices, drivers, GPU APIs, frameworks).

One small module per source behind one protocol (``base.Probe``), listed in ``registry``.
``detect_capabilities`` is the public API: the probe service publishes what it returns, and
``gpulayer check`` / ``gpulayer probe`` show it to a person at the node. Nothing here imports a
service.
"""

from gpulayer_detection.registry import detect_capabilities

__all__ = ["detect_capabilities"]
