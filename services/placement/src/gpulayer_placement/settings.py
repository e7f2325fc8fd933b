"""Placement's settings: plain values, read from the environment in ``__main__`` only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Settings:
    node_timeout_s: float = 15.0
    resend_after_s: float = 30.0
    batch_size: int = 256
    page_size: int = 1000
    publish_timeout_s: float = 10.0
    thorough_pass_s: float = 30.0
