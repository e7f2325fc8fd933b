"""Live device observations from ``nvidia-smi --query-gpu``, and MIG instances.

Pure parsers over recorded output (tests/fixtures/nvidia-smi/), plus ``observe``, which runs the
query with an injected runner. Fields, and why each:

- ``memory.used`` / ``memory.free``: what jobs left behind, shown per device.
- ``utilization.gpu``, ``temperature.gpu``, ``power.draw``: the dashboard's load picture.
- ``clocks_throttle_reasons.active``: a hardware or thermal slowdown makes a device degraded.
- ``ecc.errors.uncorrected.volatile.total``: uncorrected errors since the driver loaded, which
  makes a device unhealthy; it clears at a GPU reset or reboot, so health recovers then.
  ``...aggregate.total`` (the GPU's life) is shown, never judged: judging it would make a
  repaired GPU unhealthy forever (the Kubernetes device plugin's complaint).
- ``retired_pages.pending`` (before Ampere) / ``remapped_rows.pending`` (Ampere on): memory
  repairs waiting for a reset; degraded until then.
- ``pci.bus_id``: nvidia-smi names a lost GPU by bus id only (``Unable to determine the device
  handle for GPU 0000:02:00.0: GPU is lost``), so the last mapping to indices is kept.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpulayer_contracts.health import DeviceObservation, DeviceState
from gpulayer_detection.runner import Runner, RunResult

OBSERVE_FIELDS: tuple[str, ...] = (
    "index",
    "pci.bus_id",
    "uuid",
    "memory.used",
    "memory.free",
    "utilization.gpu",
    "temperature.gpu",
    "power.draw",
    "clocks_throttle_reasons.active",
    "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.uncorrected.aggregate.total",
    "retired_pages.pending",
    "remapped_rows.pending",
)

_INVALID_FIELD = re.compile(r'Field "(?P<field>[^"]+)" is not a valid field to query')
# "Unable to determine the device handle for GPU 0000:02:00.0: GPU is lost.  Reboot ..." (and
# "... for gpu 0000:CA:00.0: GPU requires reset"). Bus ids come with 4 or 8 domain digits.
_NO_HANDLE = re.compile(
    r"Unable to determine the device handle for (?:GPU|gpu)\s*"
    r"(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]):\s*(?P<why>[^\r\n]*)"
)
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?")
# Leading blanks allowed: NVIDIA's MIG user guide prints R470-era listings with the GPU lines
# indented (tests/fixtures/nvidia-smi/mig-listings/a100-40gb-8x-r470.txt).
_GPU_LINE = re.compile(r"^\s*GPU (?P<index>\d+): (?P<name>.+?) \(UUID: (?P<uuid>[^)\s]+)\)")
_MIG_LINE = re.compile(
    r"^\s+MIG\s+(?P<profile>\S+)\s+Device\s+(?P<dev>\d+):\s+\(UUID:\s*(?P<uuid>MIG-[^)\s]+)\)"
)
# A row of plain nvidia-smi's "MIG devices" table: GPU, GI ID, CI ID, MIG Dev, memory used/total.
# A GPU instance split into several compute instances prints its memory on its first row only;
# the other rows of that GI leave the memory cell blank (the cell spans them).
_MIG_ROW = re.compile(
    r"^\|\s*(?P<gpu>\d+)\s+(?P<gi>\d+)\s+(?P<ci>\d+)\s+(?P<dev>\d+)\s*\|"
    r"(?:\s*(?P<used>\d+)MiB\s*/\s*(?P<total>\d+)MiB)?"
)
_NVIDIA_NODE = re.compile(r"^nvidia\d{1,6}$")


def observe_argv(fields: Sequence[str] = OBSERVE_FIELDS) -> list[str]:
    return ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,nounits"]


def _bus(text: str) -> str:
    """A bus id as nvidia-smi prints it in different places (00000000:02:00.0 and 0000:02:00.0
    name the same device): domain digits folded, upper case."""
    domain, _, rest = text.strip().partition(":")
    return f"{int(domain, 16):08X}:{rest.upper()}" if domain else text.upper()


def _unknown(value: str) -> bool:
    return value == "" or value == "N/A" or (value.startswith("[") and value.endswith("]"))


def _state_of(value: str) -> DeviceState | None:
    """A device state named by a value or message: ``[GPU is lost]``, ``GPU requires reset``."""
    low = value.lower()
    if "gpu is lost" in low:
        return "lost"
    if "requires reset" in low:
        return "reset_required"
    return None


def _int(value: str | None) -> int | None:
    if value is None or _unknown(value):
        return None
    if value.lower().startswith("0x"):
        try:
            return int(value, 16)
        except ValueError:
            return None
    m = _NUMBER.match(value)
    return int(float(m.group())) if m else None


def _float(value: str | None) -> float | None:
    if value is None or _unknown(value):
        return None
    m = _NUMBER.match(value)
    return float(m.group()) if m else None


def _yes(value: str | None) -> bool | None:
    if value is None or _unknown(value):
        return None
    low = value.strip().lower()
    return True if low == "yes" else False if low == "no" else None


@dataclass(slots=True)
class Observed:
    """One observation pass: the devices, notes, and the bus id of each index seen."""

    devices: list[DeviceObservation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    buses: dict[str, int] = field(default_factory=dict)


def parse_observations(
    stdout: str,
    fields: Sequence[str] = OBSERVE_FIELDS,
    buses: dict[str, int] | None = None,
) -> Observed:
    """Devices from ``nvidia-smi --query-gpu=<fields> --format=csv,nounits``.

    A line naming a GPU whose handle nvidia-smi could not get ("GPU is lost", "GPU requires
    reset") becomes that device's observation when ``buses`` (bus id -> index, from an earlier
    pass) knows it, else a note. A row that doesn't parse is a note; the other rows stand.
    """
    known = dict(buses or {})
    out = Observed()
    columns = list(fields)
    lost: list[tuple[str, str]] = []
    rows: list[list[str]] = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        m = _NO_HANDLE.search(line)
        if m:
            lost.append((_bus(m["bus"]), m["why"].strip()))
            continue
        rows.append(next(csv.reader([line], skipinitialspace=True)))
    if rows and rows[0] and rows[0][0].split(" [", 1)[0].strip() == "index":
        columns = [c.split(" [", 1)[0].strip() for c in rows[0]]
        rows = rows[1:]
    for row in rows:
        if len(row) != len(columns) or not row[0].strip().isdigit():
            out.notes.append(f"unreadable nvidia-smi line: {', '.join(row)[:200]!r}")
            continue
        values = dict(zip(columns, (v.strip() for v in row), strict=True))
        index = int(values["index"])
        if (bus := values.get("pci.bus_id")) and not _unknown(bus):
            out.buses[_bus(bus)] = index
        out.devices.append(_observation(index, values))
    for bus, why in lost:
        found = out.buses.get(bus, known.get(bus))
        state = _state_of(why) or "lost"
        if found is None:
            out.notes.append(f"GPU {bus}: {why} (not seen before, so its index is unknown)")
            continue
        out.buses[bus] = found
        out.devices.append(DeviceObservation(index=found, state=state, reason=f"nvidia-smi: {why}"))
    out.devices.sort(key=lambda d: d.index)
    return out


def _observation(index: int, values: dict[str, str]) -> DeviceObservation:
    state: DeviceState = "ok"
    why = None
    for v in values.values():
        s = _state_of(v)
        if s is not None:
            state, why = s, f"nvidia-smi: {v.strip('[]')}"
            break
    uuid = values.get("uuid")
    return DeviceObservation(
        index=index,
        uuid=None if uuid is None or _unknown(uuid) else uuid,
        state=state,
        memory_used_mib=_int(values.get("memory.used")),
        memory_free_mib=_int(values.get("memory.free")),
        utilization_pct=_int(values.get("utilization.gpu")),
        temperature_c=_int(values.get("temperature.gpu")),
        power_w=_float(values.get("power.draw")),
        throttle_reasons=_int(values.get("clocks_throttle_reasons.active")),
        ecc_uncorrected_volatile=_int(values.get("ecc.errors.uncorrected.volatile.total")),
        ecc_uncorrected_aggregate=_int(values.get("ecc.errors.uncorrected.aggregate.total")),
        retired_pages_pending=_yes(values.get("retired_pages.pending")),
        remapped_rows_pending=_yes(values.get("remapped_rows.pending")),
        reason=why,
    )


async def observe(
    run: Runner, timeout: float, buses: dict[str, int] | None = None
) -> tuple[Observed, RunResult]:
    """Run the observation query (dropping fields an older driver refuses) and parse it."""
    fields = list(OBSERVE_FIELDS)
    while True:
        result = await run(observe_argv(fields), timeout)
        m = None if result.ok else _INVALID_FIELD.search(result.output)
        if m and m["field"] in fields and m["field"] != "index":
            fields.remove(m["field"])
            continue
        break
    # A lost GPU makes nvidia-smi exit non-zero while it still prints the others: parse what
    # it printed whenever it printed rows or "Unable to determine" lines.
    text = result.stdout + ("\n" + result.stderr if result.stderr else "")
    if result.error is not None or not text.strip():
        return Observed(), result
    return parse_observations(text, fields, buses), result


# --- MIG ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One MIG device as ``nvidia-smi -L`` lists it under its GPU."""

    parent: int
    device: int  # "Device  N": its index among the GPU's MIG devices
    profile: str  # 1g.10gb
    uuid: str  # MIG-...


def parse_mig_listing(stdout: str) -> dict[int, list[MigInstance]]:
    """MIG instances per GPU index from ``nvidia-smi -L``; GPUs without MIG are absent."""
    out: dict[int, list[MigInstance]] = {}
    parent: int | None = None
    for line in stdout.splitlines():
        g = _GPU_LINE.match(line)
        if g:
            parent = int(g["index"])
            continue
        m = _MIG_LINE.match(line)
        if m and parent is not None:
            out.setdefault(parent, []).append(
                MigInstance(parent, int(m["dev"]), m["profile"], m["uuid"])
            )
    return out


@dataclass(frozen=True, slots=True)
class MigRow:
    """One row of plain nvidia-smi's "MIG devices" table."""

    gpu: int
    gi: int  # GPU instance: memory and its slices
    ci: int  # compute instance within it
    device: int  # "MIG Dev", the same number as "Device N" in ``nvidia-smi -L``
    total_mib: int | None  # None on the second and later compute instances of one GI


def parse_mig_table(stdout: str) -> list[MigRow]:
    """The rows of plain nvidia-smi's "MIG devices" table, in order."""
    out: list[MigRow] = []
    inside = False
    for line in stdout.splitlines():
        if "MIG devices:" in line:
            inside = True
            continue
        if inside and "Processes:" in line:
            break
        m = _MIG_ROW.match(line) if inside else None
        if m:
            total = int(m["total"]) if m["total"] is not None else None
            out.append(MigRow(int(m["gpu"]), int(m["gi"]), int(m["ci"]), int(m["dev"]), total))
    return out


def parse_mig_memory(stdout: str) -> dict[tuple[int, int], int]:
    """(GPU index, MIG device) -> total memory in MiB, from plain nvidia-smi's "MIG devices"
    table (the one place nvidia-smi prints an instance's memory without a MIG-aware query).
    Only the first compute instance of a GPU instance has a figure (see ``mig_shares``)."""
    return {(r.gpu, r.device): r.total_mib for r in parse_mig_table(stdout) if r.total_mib}


def mig_shares(rows: list[MigRow]) -> dict[tuple[int, int], tuple[int, ...]]:
    """(GPU index, MIG device) -> the other MIG devices of its GPU instance, for each device
    whose GPU instance is split into several compute instances (``1c.3g.40gb``): those share
    one memory, so only one of them may promise it to a job."""
    groups: dict[tuple[int, int], list[int]] = {}
    for r in rows:
        groups.setdefault((r.gpu, r.gi), []).append(r.device)
    out: dict[tuple[int, int], tuple[int, ...]] = {}
    for (gpu, _), devices in groups.items():
        if len(devices) > 1:
            for d in devices:
                out[(gpu, d)] = tuple(x for x in devices if x != d)
    return out


def gpu_device_files(dev_dir: str) -> list[str]:
    """``nvidia<N>`` entries of ``dev_dir``: evidence of an NVIDIA GPU even when no API answers."""
    try:
        return sorted(p.name for p in Path(dev_dir).iterdir() if _NVIDIA_NODE.match(p.name))
    except OSError:
        return []
