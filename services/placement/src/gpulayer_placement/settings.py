"""Placement's settings: plain values, read from the environment in ``__main__`` only."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpulayer_contracts.profiles import Profiles


@dataclass(frozen=True, kw_only=True)
class Settings:
    node_timeout_s: float = 15.0
    resend_after_s: float = 30.0
    batch_size: int = 256
    page_size: int = 1000
    publish_timeout_s: float = 10.0
    thorough_pass_s: float = 30.0
    # How long a batch of ``running`` reports alone waits for the reports behind it before it
    # is applied on its own (``GPULAYER_STATUS_HOLD_S``, 0 to 1 s; 0: at once). status.Hold.
    status_hold_s: float = 0.05
    # Identities whose API requests may cancel any job and read any job's env
    # (``GPULAYER_ADMINS``). Their caller token is trustworthy: only the credential of that
    # name may publish on gpulayer.api.<verb>.<name>.
    admins: frozenset[str] = frozenset({"admin"})
    # Runtime profiles jobs may name (``GPULAYER_PROFILES``, read once at start): none by default.
    profiles: Profiles = field(default_factory=Profiles)
    # Ports a distributed job's rendezvous may get on its rank 0's node, first and last
    # (``GPULAYER_RENDEZVOUS_PORTS``, e.g. 29500-29999): one per active gang on a node.
    rendezvous_ports: tuple[int, int] = (29500, 29999)
    # Submits per second per owner and the burst above it (``GPULAYER_SUBMIT_RATE`` /
    # ``GPULAYER_SUBMIT_BURST``); API requests per caller likewise (``GPULAYER_API_RATE`` /
    # ``GPULAYER_API_BURST``). Admins are not limited. docs/security.md, "Rate limits".
    submit_rate: float = 20.0
    submit_burst: int = 100
    api_rate: float = 20.0
    api_burst: int = 100
