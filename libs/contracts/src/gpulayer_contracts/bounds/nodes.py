"""The bounds of what nodes send: capabilities, observations, heartbeats and executor status,
each with a fast mirror where a large fleet sends many."""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterator

from gpulayer_contracts.bounds.checks import (
    JOB_ID,
    all_fit,
    bound_messages,
    compute_capability_errors,
    count_errors,
    opt_range_errors,
    opt_text_errors,
    range_error,
    show,
    text_errors,
    text_map_errors,
    texts_errors,
    within,
)
from gpulayer_contracts.bounds.limits import (
    INT32_MAX,
    INT32_MIN,
    MAX_CAP_FRAMEWORKS,
    MAX_CDI_DEVICES,
    MAX_CPU_CORES,
    MAX_DEVICE_INDEX,
    MAX_DEVICE_MEMORY_MIB,
    MAX_DEVICES_PER_NODE,
    MAX_ERROR_COUNT,
    MAX_EXECUTOR_SLOTS,
    MAX_GRANT_ID_BYTES,
    MAX_HOST_BYTES,
    MAX_HOSTNAME_BYTES,
    MAX_JOB_CPU_CORES,
    MAX_JOB_MEMORY_GB,
    MAX_LIST_ITEMS,
    MAX_NODE_ID_BYTES,
    MAX_NOTE_BYTES,
    MAX_NOTES,
    MAX_PATH_BYTES,
    MAX_POWER_W,
    MAX_REASON_BYTES,
    MAX_SHORT_TEXT_BYTES,
    MAX_TEMPERATURE_C,
    MAX_THROTTLE_REASONS,
    MAX_UTILIZATION_PCT,
    MIN_TEMPERATURE_C,
)
from gpulayer_contracts.capabilities import (
    AcceleratorDevice,
    ContainerRuntime,
    Heartbeat,
    HostInfo,
    WorkerCapabilities,
)
from gpulayer_contracts.events import JobStatus
from gpulayer_contracts.health import NodeObservations
from gpulayer_contracts.jobs import JOB_ID_PATTERN

# A DNS name: dot-separated labels of letters, digits, ``-`` (``_`` too, as container names
# have), none starting or ending with ``-``. Never a leading ``-``: it ends in torchrun's argv.
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")


def node_id_errors(node_id: str, path: str = "$.node_id") -> list[str]:
    """A node id is one NATS subject token: 1 to MAX_NODE_ID_BYTES bytes, no ``.``, ``*``,
    ``>``, whitespace or control characters (it also sits in every grant's envelope)."""
    errors = list(text_errors(path, node_id, MAX_NODE_ID_BYTES))
    if not node_id:
        errors.append(f"{path}: empty")
    elif any(c in ".*>" or c.isspace() or not c.isprintable() for c in node_id):
        errors.append(
            f"{path}: {show(node_id)} is not a subject token (no . * > whitespace or "
            "control characters)"
        )
    return errors


def address_error(value: str, path: str = "$.host.advertise_address") -> str | None:
    """Why ``value`` is not an address other nodes can be told to connect to (an IPv4 or IPv6
    address, or a host name), or None. Rank 0's becomes every rank's MASTER_ADDR."""
    if isinstance(value, str) and len(value) <= MAX_HOSTNAME_BYTES and _is_address(value):
        return None
    return f"{path}: {show(value)} is neither an IP address nor a host name"


@functools.lru_cache(maxsize=4096)  # short strings only: a fleet reports one each
def _is_address(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return bool(_HOSTNAME.fullmatch(value))


def validate_capabilities(caps: WorkerCapabilities) -> list[str]:
    """Every hard bound a capabilities report breaks. Placement drops a report with errors and
    keeps the node's last good capabilities (a report is all or nothing)."""
    if _capabilities_within_bounds(caps):
        return []  # the common case: ~10k reports a second at start, no path built per field
    return bound_messages(list(_capabilities(caps)))


def _capabilities_within_bounds(caps: WorkerCapabilities) -> bool:
    """True when ``_capabilities`` would find nothing; False means: look closer. The fast
    mirror of ``_capabilities`` (tests/unit/test_bounds.py compares the two)."""
    if node_id_errors(caps.node_id) or not _host_within_bounds(caps.host):
        return False
    if len(caps.frameworks) > MAX_CAP_FRAMEWORKS or len(caps.gpu_apis.evidence) > MAX_LIST_ITEMS:
        return False
    short, notes, lists = _capability_texts(caps)
    if not _devices_within_bounds(caps.accelerators, short, notes, lists):
        return False
    runtime = caps.container_runtime
    if runtime is not None:
        short += [
            runtime.name,
            *(
                v
                for v in (runtime.version, runtime.oci_runtime, runtime.machine_provider)
                if v is not None
            ),
            *runtime.cdi_devices,
        ]
        notes += runtime.notes
        lists += [(runtime.notes, MAX_NOTES), (runtime.cdi_devices, MAX_CDI_DEVICES)]
    if any(len(items) > most for items, most in lists):
        return False
    path = [caps.workload_python] if caps.workload_python is not None else []
    return (
        all_fit(short, MAX_SHORT_TEXT_BYTES)
        and all_fit(notes, MAX_NOTE_BYTES)
        and all_fit(path, MAX_PATH_BYTES)
    )


def _host_within_bounds(host: HostInfo) -> bool:
    if not (
        within(host.cpu_cores, 0, MAX_CPU_CORES)
        and within(host.memory_bytes, 0, MAX_HOST_BYTES)
        and within(host.disk_free_bytes, 0, MAX_HOST_BYTES)
    ):
        return False
    return host.advertise_address is None or address_error(host.advertise_address) is None


_TextLists = list[tuple[list[str], int]]


def _capability_texts(caps: WorkerCapabilities) -> tuple[list[str], list[str], _TextLists]:
    """The report's own short texts, notes and lists (with their most items), without its
    devices' and container runtime's."""
    host, apis = caps.host, caps.gpu_apis
    short = [
        caps.agent_version,
        caps.origin,
        *(
            v
            for v in (
                host.hostname,
                host.os,
                host.os_release,
                host.platform,
                host.arch,
                host.python_version,
                caps.workload_python_version,
                caps.advertise_address,
            )
            if v is not None
        ),
        *caps.frameworks,
        *caps.frameworks.values(),
        *apis.evidence,
    ]
    notes = [*caps.notes, *apis.evidence.values()]
    lists: _TextLists = [
        (caps.framework_capabilities, MAX_LIST_ITEMS),
        (caps.distributed_backends, MAX_LIST_ITEMS),
        (caps.launchers, MAX_LIST_ITEMS),
        (apis.host, MAX_LIST_ITEMS),
        (apis.containers, MAX_LIST_ITEMS),
        (caps.notes, MAX_NOTES),
    ]
    for items, _ in lists[:5]:
        short += items
    return short, notes, lists


def _devices_within_bounds(
    devices: list[AcceleratorDevice], short: list[str], notes: list[str], lists: _TextLists
) -> bool:
    """False when a device's number is out of range; adds the devices' texts to ``short``,
    ``notes`` and ``lists`` for the caller to measure."""
    if len(devices) > MAX_DEVICES_PER_NODE:
        return False
    for d in devices:
        if not (
            within(d.index, 0, MAX_DEVICE_INDEX)
            and within(d.memory_mib, 0, MAX_DEVICE_MEMORY_MIB)
            and within(d.mig_parent, 0, MAX_DEVICE_INDEX)
        ):
            return False
        short += [
            v
            for v in (
                d.vendor,
                d.name,
                d.uuid,
                d.driver_version,
                d.cuda_driver_version,
                d.mig_mode,
                d.mig_profile,
            )
            if v is not None
        ]
        notes += d.notes
        lists.append((d.notes, MAX_NOTES))
        if d.compute_capability is not None and not _compute_capability_ok(d.compute_capability):
            return False
    return True


@functools.lru_cache(maxsize=1024)
def _compute_capability_ok(value: float | str) -> bool:
    # A fleet reports a handful of distinct values: each is judged once.
    return not any(compute_capability_errors("", value))


def _capabilities(caps: WorkerCapabilities) -> Iterator[str]:
    yield from node_id_errors(caps.node_id)
    yield from text_errors("$.agent_version", caps.agent_version, MAX_SHORT_TEXT_BYTES)
    yield from _host_errors(caps.host)
    yield from count_errors("$.accelerators", caps.accelerators, MAX_DEVICES_PER_NODE)
    for i, d in enumerate(caps.accelerators[: MAX_DEVICES_PER_NODE + 1]):
        yield from _device_errors(f"$.accelerators[{i}]", d)
    yield from opt_text_errors("$.workload_python", caps.workload_python, MAX_PATH_BYTES)
    yield from opt_text_errors(
        "$.workload_python_version", caps.workload_python_version, MAX_SHORT_TEXT_BYTES
    )
    yield from text_map_errors(
        "$.frameworks",
        caps.frameworks,
        MAX_CAP_FRAMEWORKS,
        MAX_SHORT_TEXT_BYTES,
        MAX_SHORT_TEXT_BYTES,
    )
    for field in ("framework_capabilities", "distributed_backends", "launchers"):
        yield from texts_errors(
            f"$.{field}", getattr(caps, field), MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES
        )
    apis = caps.gpu_apis
    yield from texts_errors("$.gpu_apis.host", apis.host, MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES)
    yield from texts_errors(
        "$.gpu_apis.containers", apis.containers, MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES
    )
    yield from text_map_errors(
        "$.gpu_apis.evidence", apis.evidence, MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES, MAX_NOTE_BYTES
    )
    if caps.container_runtime is not None:
        yield from _runtime_errors(caps.container_runtime)
    yield from opt_text_errors("$.advertise_address", caps.advertise_address, MAX_SHORT_TEXT_BYTES)
    yield from text_errors("$.origin", caps.origin, MAX_SHORT_TEXT_BYTES)
    yield from texts_errors("$.notes", caps.notes, MAX_NOTES, MAX_NOTE_BYTES)


def _host_errors(host: HostInfo) -> Iterator[str]:
    for field in ("hostname", "os", "os_release", "platform", "arch", "python_version"):
        yield from opt_text_errors(f"$.host.{field}", getattr(host, field), MAX_SHORT_TEXT_BYTES)
    yield from opt_range_errors("$.host.cpu_cores", host.cpu_cores, 0, MAX_CPU_CORES)
    yield from opt_range_errors("$.host.memory_bytes", host.memory_bytes, 0, MAX_HOST_BYTES)
    yield from opt_range_errors("$.host.disk_free_bytes", host.disk_free_bytes, 0, MAX_HOST_BYTES)
    if host.advertise_address is not None:
        error = address_error(host.advertise_address)
        if error:
            yield error


def _device_errors(p: str, d: AcceleratorDevice) -> Iterator[str]:
    yield from opt_range_errors(f"{p}.index", d.index, 0, MAX_DEVICE_INDEX)
    yield from opt_range_errors(f"{p}.memory_mib", d.memory_mib, 0, MAX_DEVICE_MEMORY_MIB)
    yield from opt_range_errors(f"{p}.mig_parent", d.mig_parent, 0, MAX_DEVICE_INDEX)
    for field in (
        "vendor",
        "name",
        "uuid",
        "driver_version",
        "cuda_driver_version",
        "mig_mode",
        "mig_profile",
    ):
        yield from opt_text_errors(f"{p}.{field}", getattr(d, field), MAX_SHORT_TEXT_BYTES)
    if d.compute_capability is not None:
        yield from compute_capability_errors(f"{p}.compute_capability", d.compute_capability)
    yield from texts_errors(f"{p}.notes", d.notes, MAX_NOTES, MAX_NOTE_BYTES)


def _runtime_errors(runtime: ContainerRuntime) -> Iterator[str]:
    p = "$.container_runtime"
    yield from text_errors(f"{p}.name", runtime.name, MAX_SHORT_TEXT_BYTES)
    yield from opt_text_errors(f"{p}.version", runtime.version, MAX_SHORT_TEXT_BYTES)
    yield from opt_text_errors(f"{p}.oci_runtime", runtime.oci_runtime, MAX_SHORT_TEXT_BYTES)
    yield from opt_text_errors(
        f"{p}.machine_provider", runtime.machine_provider, MAX_SHORT_TEXT_BYTES
    )
    yield from texts_errors(f"{p}.notes", runtime.notes, MAX_NOTES, MAX_NOTE_BYTES)
    yield from texts_errors(
        f"{p}.cdi_devices", runtime.cdi_devices, MAX_CDI_DEVICES, MAX_SHORT_TEXT_BYTES
    )


def validate_observations(obs: NodeObservations) -> list[str]:
    """Every hard bound an observations message breaks. Placement drops a message with errors
    whole (the node keeps the health it had)."""
    if _observations_within_bounds(obs):
        return []  # the common case: thousands a second from a large fleet
    return bound_messages(list(_observations(obs)))


def _observations_within_bounds(obs: NodeObservations) -> bool:
    """The fast mirror of ``_observations`` (tests/unit/test_bounds.py compares the two)."""
    if node_id_errors(obs.node_id) or len(obs.devices) > MAX_DEVICES_PER_NODE:
        return False
    if len(obs.notes) > MAX_NOTES:
        return False
    short: list[str] = []
    notes = list(obs.notes)
    for d in obs.devices:
        if not (
            within(d.index, 0, MAX_DEVICE_INDEX)
            and within(d.memory_used_mib, 0, MAX_DEVICE_MEMORY_MIB)
            and within(d.memory_free_mib, 0, MAX_DEVICE_MEMORY_MIB)
            and within(d.utilization_pct, 0, MAX_UTILIZATION_PCT)
            and within(d.temperature_c, MIN_TEMPERATURE_C, MAX_TEMPERATURE_C)
            and within(d.throttle_reasons, 0, MAX_THROTTLE_REASONS)
            and within(d.ecc_uncorrected_volatile, 0, MAX_ERROR_COUNT)
            and within(d.ecc_uncorrected_aggregate, 0, MAX_ERROR_COUNT)
        ):
            return False
        p = d.power_w
        if p is not None and not (isinstance(p, int | float) and 0 <= p <= MAX_POWER_W):
            return False  # NaN fails both comparisons
        if d.uuid is not None:
            short.append(d.uuid)
        if d.reason is not None:
            notes.append(d.reason)
    return all_fit(short, MAX_SHORT_TEXT_BYTES) and all_fit(notes, MAX_NOTE_BYTES)


def _observations(obs: NodeObservations) -> Iterator[str]:
    yield from node_id_errors(obs.node_id)
    yield from count_errors("$.devices", obs.devices, MAX_DEVICES_PER_NODE)
    for i, d in enumerate(obs.devices[: MAX_DEVICES_PER_NODE + 1]):
        p = f"$.devices[{i}]"
        yield from opt_range_errors(f"{p}.index", d.index, 0, MAX_DEVICE_INDEX)
        yield from opt_text_errors(f"{p}.uuid", d.uuid, MAX_SHORT_TEXT_BYTES)
        for field in ("memory_used_mib", "memory_free_mib"):
            yield from opt_range_errors(f"{p}.{field}", getattr(d, field), 0, MAX_DEVICE_MEMORY_MIB)
        yield from opt_range_errors(
            f"{p}.utilization_pct", d.utilization_pct, 0, MAX_UTILIZATION_PCT
        )
        yield from opt_range_errors(
            f"{p}.temperature_c", d.temperature_c, MIN_TEMPERATURE_C, MAX_TEMPERATURE_C
        )
        if d.power_w is not None:
            error = range_error(f"{p}.power_w", d.power_w, 0, MAX_POWER_W)
            if error:
                yield error
        yield from opt_range_errors(
            f"{p}.throttle_reasons", d.throttle_reasons, 0, MAX_THROTTLE_REASONS
        )
        for field in ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate"):
            yield from opt_range_errors(f"{p}.{field}", getattr(d, field), 0, MAX_ERROR_COUNT)
        yield from opt_text_errors(f"{p}.reason", d.reason, MAX_NOTE_BYTES)
    yield from texts_errors("$.notes", obs.notes, MAX_NOTES, MAX_NOTE_BYTES)


def validate_heartbeat(beat: Heartbeat) -> list[str]:
    """Every hard bound a heartbeat breaks (its strings end up in logs and the node's row)."""
    errors = node_id_errors(beat.node_id)
    errors += text_errors("$.source", beat.source, MAX_SHORT_TEXT_BYTES)
    errors += opt_text_errors("$.agent_version", beat.agent_version, MAX_SHORT_TEXT_BYTES)
    errors += opt_range_errors("$.slots", beat.slots, 0, MAX_EXECUTOR_SLOTS)
    for path, value, high in (
        ("$.reserved_cores", beat.reserved_cores, MAX_JOB_CPU_CORES),
        ("$.reserved_memory_gb", beat.reserved_memory_gb, MAX_JOB_MEMORY_GB),
    ):
        error = None if value is None else range_error(path, value, 0, high)
        if error:
            errors.append(error)
    errors += opt_text_errors("$.enforcement", beat.enforcement, MAX_SHORT_TEXT_BYTES)
    return bound_messages(errors)


def validate_job_status(status: JobStatus) -> list[str]:
    """Every hard bound an executor's status message breaks: ids, exit code and pid within
    PostgreSQL's int4, the reason's size, NUL anywhere."""
    errors: list[str] = []
    if not JOB_ID.fullmatch(status.job_id):
        errors.append(f"$.job_id: {show(status.job_id)} is not a job id ({JOB_ID_PATTERN})")
    errors += text_errors("$.grant_id", status.grant_id, MAX_GRANT_ID_BYTES)
    errors += node_id_errors(status.node_id)
    errors += opt_range_errors("$.pid", status.pid, 0, INT32_MAX)
    errors += opt_range_errors("$.exit_code", status.exit_code, INT32_MIN, INT32_MAX)
    errors += opt_range_errors("$.signal", status.signal, 0, INT32_MAX)
    errors += opt_text_errors("$.reason", status.reason, MAX_REASON_BYTES)
    return bound_messages(errors)
