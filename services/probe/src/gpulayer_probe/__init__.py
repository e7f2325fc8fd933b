"""gpulayer probe: detects devices, drivers, GPU APIs and frameworks; publishes capabilities.

``detect_capabilities`` is the public API (``gpulayer check`` calls it); ``gpulayer probe`` is
``gpulayer_probe.cli.main``; the service is the ``gpulayer-probe`` console script.
"""

from gpulayer_probe.registry import detect_capabilities

__all__ = ["detect_capabilities"]
