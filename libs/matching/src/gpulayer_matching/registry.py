"""The rules, in the order the matcher runs them: one line per rule. A node is counted under the
first rule it fails; reasons are listed in the outcomes' rank order.

1. Node rules before the device rules (``NodeRule``), then the device rules (``DeviceRule``:
   each filters the devices of one accelerator the previous ones left), then the other node
   rules. Their verdict depends on what the node offers, not on what it runs, and is cached
   per node and job shape (``capability``).
2. Host rules (``HostRule``), read from the node's view on each call: whether it is up, and
   per resource what it offers in all (a capability: ranked before liveness) and what is free
   now (occupancy). Each check returns its lowest-ranked failure, and a node is counted under
   the lowest-ranked of them, so their order here doesn't matter.
3. Rules the placement step applies while it chooses devices (``Rule``: words only here; the
   check is ``place``'s, and ``explain``'s for health).
"""

from __future__ import annotations

from typing import Final

from gpulayer_matching.rules import (
    accelerator,
    busy_devices,
    compute_capability,
    container_runtime,
    cores,
    device_count,
    device_memory,
    distributed,
    driver,
    framework_capabilities,
    frameworks,
    gpu_apis,
    health,
    liveness,
    memory_kind,
    mig,
    platform,
    python_version,
    ram,
    shared_gpu_memory,
    slots,
    support_matrix,
)
from gpulayer_matching.rules.base import (
    DeviceCheck,
    DeviceRule,
    HostRule,
    NodeCheck,
    NodeRule,
    Outcome,
    Rule,
)

__all__ = [
    "AFTER_DEVICES",
    "BEFORE_DEVICES",
    "DEVICE_CHECKS",
    "HOST_CHECKS",
    "LIVE_RANK",
    "OCCUPANCY_CHECKS",
    "OUTCOMES",
    "RULES",
    "outcome",
]

RULES: Final[tuple[Rule, ...]] = (
    platform.RULE,
    container_runtime.RULE,
    accelerator.RULE,
    mig.RULE,
    device_count.RULE,
    memory_kind.RULE,
    device_memory.RULE,
    compute_capability.RULE,
    driver.RULE,
    support_matrix.RULE,
    gpu_apis.RULE,
    python_version.RULE,
    frameworks.RULE,
    framework_capabilities.RULE,
    distributed.RULE,
    liveness.RULE,
    cores.RULE,
    ram.RULE,
    slots.RULE,
    health.RULE,
    busy_devices.RULE,
    shared_gpu_memory.RULE,
)

# A node that fails a rule ranked below this could still run the job.
LIVE_RANK: Final = liveness.OFFLINE.rank


def _stages() -> tuple[tuple[NodeCheck, ...], tuple[DeviceCheck, ...], tuple[NodeCheck, ...]]:
    before: list[NodeCheck] = []
    devices: list[DeviceCheck] = []
    after: list[NodeCheck] = []
    for rule in RULES:
        if isinstance(rule, DeviceRule):
            # The device rules run as one chain per accelerator: they must stand together.
            assert not after, f"device rule {rule.concern} after node rules that follow devices"
            devices.append(rule.check)
        elif isinstance(rule, NodeRule):
            (after if devices else before).append(rule.check)
    return tuple(before), tuple(devices), tuple(after)


BEFORE_DEVICES, DEVICE_CHECKS, AFTER_DEVICES = _stages()
HOST_CHECKS: Final = tuple(r.check for r in RULES if isinstance(r, HostRule))
# The host rules but liveness, for ``match``, which checks liveness before everything else.
OCCUPANCY_CHECKS: Final = tuple(
    r.check for r in RULES if isinstance(r, HostRule) and r is not liveness.RULE
)
OUTCOMES: Final[dict[str, Outcome]] = {o.name: o for r in RULES for o in r.outcomes}


def outcome(rule: str) -> Outcome:
    """The outcome ``rule`` (a ``ruled_out`` key: ``name`` or ``name:<member>``) is."""
    return OUTCOMES[rule.partition(":")[0]]
