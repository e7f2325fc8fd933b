"""gpulayer matching: the pure placement rules, shared by the placement service and ``gpulayer
check``. No I/O, and nothing from ``services/``: requirements and node states in, a placement or
the reasons why not out (see ``matcher`` and ``docs/placement-rules.md``)."""

from gpulayer_matching.matcher import (
    NodeView,
    NoPlacement,
    Placement,
    explain,
    match,
    would_fit_when_idle,
)
from gpulayer_matching.profiles import profile_fit, profile_job

__all__ = [
    "NoPlacement",
    "NodeView",
    "Placement",
    "explain",
    "match",
    "profile_fit",
    "profile_job",
    "would_fit_when_idle",
]
