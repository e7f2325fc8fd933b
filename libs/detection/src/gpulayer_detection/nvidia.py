"""NVIDIA GPUs from ``nvidia-smi``: one device per row, each standing on its own.

Two commands run at once: ``--query-gpu`` for the devices, and plain ``nvidia-smi`` whose header
is the only place every driver states the CUDA version it supports. The driver version and the
driver's CUDA version are kept as separate facts.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import re
from collections.abc import Sequence

import msgspec

from gpulayer_contracts.capabilities import MIG_INDEX_STRIDE, AcceleratorDevice, mig_index
from gpulayer_detection.base import Finding, ProbeContext
from gpulayer_detection.observe import (
    MigInstance,
    mig_shares,
    parse_mig_listing,
    parse_mig_table,
)
from gpulayer_detection.runner import RunResult

QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "compute_cap",
    "driver_version",
    "compute_mode",
    "mig.mode.current",
)
# Without these a row means nothing; every other field may be dropped for an old driver.
REQUIRED_FIELDS = frozenset({"index", "name"})

_INVALID_FIELD = re.compile(r'Field "(?P<field>[^"]+)" is not a valid field to query')
_CUDA_VERSION = re.compile(r"CUDA Version\s*:\s*(?P<v>\d+\.\d+(?:\.\d+)?)")
_COMPUTE_CAP = re.compile(r"^\d+\.\d+$")
_MEMORY = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?:\s*MiB)?$")
_NO_HANDLE = re.compile(
    r"Unable to determine the device handle for (?:GPU|gpu)\s*(?P<rest>[^\r\n]*)"
)


class NvidiaSmiParseError(ValueError):
    """Output that is not the CSV we asked for."""


def query_argv(fields: Sequence[str] = QUERY_FIELDS) -> list[str]:
    return ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,nounits"]


def _is_unknown(value: str) -> bool:
    # nvidia-smi writes [N/A], [Not Supported], [Unknown Error], [Insufficient Permissions], ...
    return value == "" or value == "N/A" or (value.startswith("[") and value.endswith("]"))


def _header_name(column: str) -> str:
    # "memory.total [MiB]" -> "memory.total"
    return column.split(" [", 1)[0].strip()


def parse_cuda_version(stdout: str) -> str | None:
    """The driver's CUDA version from plain ``nvidia-smi`` (``CUDA Version: 12.4``)."""
    m = _CUDA_VERSION.search(stdout)
    return m["v"] if m else None


def parse_nvidia_smi(
    stdout: str,
    fields: Sequence[str] = QUERY_FIELDS,
    *,
    cuda_driver_version: str | None = None,
) -> list[AcceleratorDevice]:
    """Devices from ``nvidia-smi --query-gpu=<fields> --format=csv[,noheader],nounits``.

    With a header, columns are mapped by name; without one, in the order of ``fields``. Raises
    NvidiaSmiParseError for anything that is not such a table (a driver error message).
    """
    lines = [line for line in stdout.splitlines() if line.strip()]
    # A GPU whose handle the driver can't get (lost, requires reset) is named on a line of its
    # own between the rows: it is not offered (the others still are), and the probe's
    # observations report its state.
    lines = [line for line in lines if not _NO_HANDLE.search(line)]
    rows = list(csv.reader(lines, skipinitialspace=True))
    columns = list(fields)
    if rows and rows[0] and _header_name(rows[0][0]) == "index":
        columns = [_header_name(c) for c in rows[0]]
        rows = rows[1:]
    missing = REQUIRED_FIELDS - set(columns)
    if missing:
        raise NvidiaSmiParseError(f"no {', '.join(sorted(missing))} column in the output")
    devices = []
    for row in rows:
        if len(row) != len(columns):
            raise NvidiaSmiParseError(
                f"expected {len(columns)} values per line, got {len(row)}: {', '.join(row)!r}"
            )
        values = dict(zip(columns, (v.strip() for v in row), strict=True))
        devices.append(_device(values, cuda_driver_version))
    return devices


def _device(values: dict[str, str], cuda_driver_version: str | None) -> AcceleratorDevice:
    notes: list[str] = []

    def known(field: str, what: str) -> str | None:
        if field not in values:
            notes.append(f"{what} unknown: this driver's nvidia-smi has no {field} field")
            return None
        raw = values[field]
        if _is_unknown(raw):
            notes.append(f"{what} unknown: nvidia-smi reports {field} as {raw or 'empty'}")
            return None
        return raw

    raw_index = values["index"]
    if not raw_index.isdigit():
        raise NvidiaSmiParseError(f"index {raw_index!r} is not a number")
    name = known("name", "name")
    uuid = known("uuid", "uuid")
    memory_mib: int | None = None
    if (raw_mem := known("memory.total", "memory")) is not None:
        m = _MEMORY.match(raw_mem)
        if m:
            memory_mib = int(float(m["n"]))
        else:
            notes.append(f"memory unknown: unreadable memory.total {raw_mem!r}")
    compute_capability = known("compute_cap", "compute capability")
    if compute_capability is not None and not _COMPUTE_CAP.match(compute_capability):
        notes.append(f"compute capability unknown: unreadable compute_cap {compute_capability!r}")
        compute_capability = None
    driver = known("driver_version", "driver version")

    execution = True
    compute_mode = values.get("compute_mode")
    if compute_mode is not None and compute_mode.lower() == "prohibited":
        # The driver refuses every CUDA context on this GPU.
        execution = False
        notes.append("compute mode is Prohibited: no CUDA process may use this GPU")
    mig_raw = values.get("mig.mode.current")
    mig_mode = None if mig_raw is None or _is_unknown(mig_raw) else mig_raw
    if mig_mode is not None and mig_mode.lower() == "enabled":
        # With MIG on, CUDA sees MIG instances, not the GPU: granting the whole GPU by index
        # would not give a job what the memory figure promises.
        execution = False
        notes.append("MIG is enabled: the whole GPU can't be granted; its MIG instances can")
    return AcceleratorDevice(
        accelerator="cuda",
        index=int(raw_index),
        vendor="NVIDIA",  # the source is NVIDIA's own tool, not a guess from the name
        name=name,
        uuid=uuid,
        memory_mib=memory_mib,
        memory_kind="dedicated" if memory_mib is not None else None,
        compute_capability=compute_capability,
        driver_version=driver,
        cuda_driver_version=cuda_driver_version,
        mig_mode=mig_mode,
        execution_supported=execution,
        notes=notes,
    )


def mig_devices(
    parent: AcceleratorDevice,
    instances: list[MigInstance],
    memory: dict[tuple[int, int], int],
    shares: dict[tuple[int, int], tuple[int, ...]] | None = None,
) -> list[AcceleratorDevice]:
    """A MIG-enabled GPU's instances as devices of their own (``mig_index`` numbering), with
    the memory plain nvidia-smi's MIG table gives each (unknown, and noted, without a row).

    Compute instances of one GPU instance (``1c.3g.40gb`` x 3) share its memory: only the one
    the table gives the memory to is offered, so no two jobs are promised the same memory."""
    out = []
    for inst in instances:
        if inst.device >= MIG_INDEX_STRIDE:
            continue  # no GPU has 100 MIG devices; such a line is not one nvidia-smi writes
        key = (parent.index, inst.device)
        mib = memory.get(key)
        others = (shares or {}).get(key, ())
        usable = True
        if others and mib is not None:
            notes = [
                f"shares its GPU instance's {mib} MiB with MIG device(s) "
                f"{', '.join(map(str, others))}, which are not offered"
            ]
        elif others:
            usable = False
            holder = [d for d in others if (parent.index, d) in memory]
            notes = [
                "not offered: shares its GPU instance's memory with MIG device "
                f"{holder[0] if holder else others[0]} (a compute instance of the same GI)"
            ]
        elif mib is None:
            notes = ["memory unknown: no row for this MIG device in nvidia-smi's MIG devices table"]
        else:
            notes = []
        out.append(
            msgspec.structs.replace(
                parent,
                index=mig_index(parent.index, inst.device),
                name=f"{parent.name or 'GPU'} MIG {inst.profile}",
                uuid=inst.uuid,
                memory_mib=mib,
                memory_kind="dedicated" if mib is not None else None,
                mig_mode=None,
                mig_parent=parent.index,
                mig_profile=inst.profile,
                execution_supported=usable,
                notes=notes,
            )
        )
    return out


def describe_failure(result: RunResult) -> str:
    """Why nvidia-smi gave no devices, in the driver's own words where it has some."""
    text = result.output
    if result.error is not None:
        return result.error
    if "couldn't communicate with the NVIDIA driver" in text:
        return (
            "the NVIDIA driver is not running (nvidia-smi: NVIDIA-SMI has failed because it "
            "couldn't communicate with the NVIDIA driver)"
        )
    if "No devices were found" in text:
        return "the NVIDIA driver found no GPUs (nvidia-smi: No devices were found)"
    return f"nvidia-smi failed: {result.describe()}"


async def _cancel(task: asyncio.Future[RunResult]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class NvidiaProbe:
    name = "nvidia"

    async def probe(self, ctx: ProbeContext) -> Finding:
        found = Finding(self.name)
        header_task: asyncio.Future[RunResult] = asyncio.ensure_future(
            ctx.run(["nvidia-smi"], ctx.timeout)
        )
        try:
            fields = list(QUERY_FIELDS)
            while True:
                result = await ctx.run(query_argv(fields), ctx.timeout)
                m = None if result.ok else _INVALID_FIELD.search(result.output)
                if m and m["field"] in fields and m["field"] not in REQUIRED_FIELDS:
                    # Older drivers lack newer fields (compute_cap arrived in R510): ask again
                    # without it; the device says the value is unknown.
                    fields.remove(m["field"])
                    continue
                break
            lost = [m.group(0) for m in _NO_HANDLE.finditer(result.output)]
            if lost and result.error is None:
                # nvidia-smi exits non-zero for a lost GPU but still lists the others.
                for line in lost:
                    found.note(f"GPU not offered: nvidia-smi: {line.strip()[:300]}")
            elif not result.ok:
                found.note(f"no NVIDIA devices: {describe_failure(result)}")
                found.evidence["cuda"] = f"not available: {describe_failure(result)}"
                return found
            header = await header_task
        finally:
            await _cancel(header_task)

        cuda_version = parse_cuda_version(header.stdout) if header.ok else None
        if cuda_version is None:
            why = header.describe() if not header.ok else "no 'CUDA Version' in its header"
            found.note(f"driver CUDA version unknown: plain nvidia-smi gave {why}")
        try:
            devices = parse_nvidia_smi(result.stdout, fields, cuda_driver_version=cuda_version)
        except NvidiaSmiParseError as err:
            found.note(f"no NVIDIA devices: unreadable nvidia-smi output ({err})")
            return found
        if not devices:
            found.note("no NVIDIA devices: nvidia-smi listed none")
            found.evidence["cuda"] = "not available: nvidia-smi listed no GPUs"
            return found
        if any(d.mig_parent is None and _mig_on(d) for d in devices):
            devices = await _with_mig(ctx, found, devices, header.stdout if header.ok else "")
        found.accelerators = devices
        for d in devices:
            found.notes.extend(f"{self.name}: GPU {d.index}: {n}" for n in d.notes)
        drivers = sorted({d.driver_version for d in devices if d.driver_version})
        gpus = [d for d in devices if d.mig_parent is None]
        usable = sum(d.execution_supported for d in gpus)
        migs = len(devices) - len(gpus)
        found.host_apis["cuda"] = (
            f"nvidia-smi lists {len(gpus)} GPU(s), {usable} usable whole"
            + (f", {migs} MIG instance(s)" if migs else "")
            + f"; driver {', '.join(drivers) or 'unknown'}, CUDA {cuda_version or 'unknown'}"
        )
        return found


def _mig_on(d: AcceleratorDevice) -> bool:
    return d.mig_mode is not None and d.mig_mode.lower() == "enabled"


async def _with_mig(
    ctx: ProbeContext, found: Finding, devices: list[AcceleratorDevice], smi: str
) -> list[AcceleratorDevice]:
    """``devices`` and, after each MIG-enabled GPU, its instances from ``nvidia-smi -L``."""
    listing = await ctx.run(["nvidia-smi", "-L"], ctx.timeout)
    if not listing.ok:
        found.note(f"MIG instances unknown: nvidia-smi -L gave {listing.describe()}")
        return devices
    instances = parse_mig_listing(listing.stdout)
    rows = parse_mig_table(smi)
    memory = {(r.gpu, r.device): r.total_mib for r in rows if r.total_mib}
    shares = mig_shares(rows)
    out: list[AcceleratorDevice] = []
    for d in devices:
        out.append(d)
        if _mig_on(d):
            mine = instances.get(d.index, [])
            if not mine:
                found.note(f"GPU {d.index}: MIG is enabled but nvidia-smi -L lists no instance")
            out.extend(mig_devices(d, mine, memory, shares))
    return out
