"""Device health from observations: the rule (``classify``) and its hysteresis (``Tracker``).

The rule (docs/health.md):

- **unhealthy** (no new grants; the job on it gets a warning): nvidia-smi says the GPU is lost
  or requires a reset, or it reports uncorrected ECC errors since the driver loaded (volatile).
- **degraded** (no new grants; what runs keeps running, no warning): retired pages or remapped
  rows pending (memory repairs waiting for a reset), or clocks slowed by a hardware or thermal
  reason. The power cap (SW power cap, 0x4) and idle clocks are normal and ignored.
- **healthy** otherwise; a value nvidia-smi doesn't report counts as fine.

Hysteresis: a device gets worse at once (one bad observation is enough to stop grants) and
better only after ``recover_after`` observations in a row at the better level, so a device
whose temperature hovers at the slowdown threshold doesn't flap.
"""

from __future__ import annotations

import msgspec

from gpulayer_contracts.health import HEALTH_LEVELS, DeviceObservation, Health

# NVML clocks throttle reasons that mean the hardware is slowing itself down.
HW_SLOWDOWN = 0x8
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80
SLOWDOWN_MASK = HW_SLOWDOWN | SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN
_SLOWDOWN_NAMES = (
    (HW_SLOWDOWN, "hardware slowdown"),
    (SW_THERMAL_SLOWDOWN, "software thermal slowdown"),
    (HW_THERMAL_SLOWDOWN, "hardware thermal slowdown"),
    (HW_POWER_BRAKE_SLOWDOWN, "power brake slowdown"),
)
RECOVER_AFTER = 3


def classify(obs: DeviceObservation) -> tuple[Health, str | None]:
    """This observation's health on its own, and the reason when not healthy."""
    if obs.state == "lost":
        return "unhealthy", obs.reason or "GPU is lost"
    if obs.state == "reset_required":
        return "unhealthy", obs.reason or "GPU requires reset"
    if obs.ecc_uncorrected_volatile:
        n = obs.ecc_uncorrected_volatile
        return (
            "unhealthy",
            f"{n} uncorrected ECC error{'s' if n != 1 else ''} since the driver loaded",
        )
    if obs.retired_pages_pending:
        return "degraded", "retired pages pending (applied at the next GPU reset)"
    if obs.remapped_rows_pending:
        return "degraded", "row remapping pending (applied at the next GPU reset)"
    if obs.throttle_reasons and obs.throttle_reasons & SLOWDOWN_MASK:
        names = [n for bit, n in _SLOWDOWN_NAMES if obs.throttle_reasons & bit]
        return "degraded", f"clocks slowed: {', '.join(names)}"
    return "healthy", None


class Tracker:
    """Per-device health with hysteresis, fed one observation pass at a time."""

    def __init__(self, recover_after: int = RECOVER_AFTER) -> None:
        self.recover_after = max(1, recover_after)
        # index -> (health in effect, its reason, observations in a row that were better)
        self._state: dict[int, tuple[Health, str | None, int]] = {}

    def update(self, devices: list[DeviceObservation]) -> list[DeviceObservation]:
        """The observations with ``health`` and ``reason`` in effect. Devices not in this pass
        are forgotten (a vanished device is drift, handled by detection)."""
        out = []
        seen = set()
        for d in devices:
            seen.add(d.index)
            level, why = classify(d)
            held = self._state.get(d.index)
            if held is not None and HEALTH_LEVELS[level] < HEALTH_LEVELS[held[0]]:
                better = held[2] + 1
                if better < self.recover_after:
                    self._state[d.index] = (held[0], held[1], better)
                    left = self.recover_after - better
                    reason = f"{held[1]} (recovering: {left} more clean observation(s))"
                    out.append(msgspec.structs.replace(d, health=held[0], reason=reason))
                    continue
            self._state[d.index] = (level, why, 0)
            out.append(msgspec.structs.replace(d, health=level, reason=why))
        for gone in set(self._state) - seen:
            del self._state[gone]
        return out
