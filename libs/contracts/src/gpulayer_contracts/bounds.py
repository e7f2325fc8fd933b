"""Hard bounds on everything that arrives from outside: jobs, capabilities, executor status.

Every limit is a named constant here, chosen far above what a real user or machine reaches
and below what breaks a consumer: the matcher's float arithmetic, PostgreSQL's ``int4`` and
``jsonb`` (which refuses ``\\u0000``), ``execve``'s per-string limit, and the NATS server's
``max_payload``, which caps a grant (the job plus its envelope) and every event. docs/operations.md
("Bounds") lists them; tests/unit/test_bounds.py checks that it does.

Pure functions that return error strings of the form ``$.path: what (the limit)``; the caller
decides what to do (reject the job, drop the capabilities report and keep the last good one).
"""

from __future__ import annotations

import functools
import ipaddress
import math
import re
from collections.abc import Iterator, Sized
from typing import Final, TypeVar

import msgspec

from gpulayer_contracts.capabilities import Heartbeat, WorkerCapabilities
from gpulayer_contracts.events import JobEvent, JobStatus
from gpulayer_contracts.health import NodeObservations
from gpulayer_contracts.jobs import (
    JOB_ID_PATTERN,
    PROFILE_REF_PATTERN,
    RANK_SUFFIX,
    GpuUsage,
    JobRequest,
    rank_job_id,
)

KIB: Final = 1024

# PostgreSQL int4 (device indices, exit codes, pids are stored so).
INT32_MIN: Final = -(2**31)
INT32_MAX: Final = 2**31 - 1

# --- Job requests ---
MAX_GPU_COUNT: Final = 1024  # devices on one node (= MAX_DEVICES_PER_NODE): more never fits
MAX_GPU_MEMORY_GB: Final = 65536  # per device, GB of 10^9 bytes: 64 TB
MAX_COMPUTE_CAPABILITY_PART: Final = 99  # major and minor each: 0.0 .. 99.99
MAX_JOB_CPU_CORES: Final = 1 << 16  # = MAX_CPU_CORES: no node offers more
MAX_JOB_MEMORY_GB: Final = 10**9  # 1 EB (= MAX_HOST_BYTES, about)
MAX_EXECUTOR_SLOTS: Final = 1 << 16  # jobs one executor runs at once
MAX_TIMEOUT_S: Final = 366 * 86400  # a year; leave timeout_s unset for no timeout
MAX_DISTRIBUTED_NODES: Final = 4096
MAX_PROCESSES_PER_NODE: Final = 1024
MAX_ARGV_ITEMS: Final = 4096
# Linux's MAX_ARG_STRLEN (32 pages) less the terminating NUL: execve refuses a longer string.
MAX_ARG_BYTES: Final = 32 * 4096 - 1
MAX_ARGV_BYTES: Final = 512 * KIB  # all arguments together, UTF-8
MAX_ENV_VARS: Final = 1024
MAX_ENV_NAME_BYTES: Final = 256
MAX_ENV_VALUE_BYTES: Final = 64 * KIB
MAX_ENV_BYTES: Final = 256 * KIB  # every NAME=value together, UTF-8
MAX_NAME_BYTES: Final = 1024  # the job's human-readable name
# Specifiers, framework and API names, backend, launcher and other one-word fields.
MAX_SHORT_TEXT_BYTES: Final = 256
MAX_LIST_ITEMS: Final = 64  # frameworks, framework_capabilities, apis_any (each)
ENV_NAME_PATTERN: Final = r"[A-Za-z_][A-Za-z0-9_]*"
# Lifecycle (issue 15, part B).
MAX_RETRIES: Final = 100  # retries of a lost (or failed) job
MAX_BACKOFF_S: Final = 86400.0  # a service's restart backoff and its cap: a day
MAX_ARRAY_COUNT: Final = 10000  # jobs one array submit creates
# The jobs of one array together, as stored (count x the job's encoded size): one submit
# message may not make placement insert and hold more than this at once.
MAX_ARRAY_BYTES: Final = 64 * KIB * KIB
MAX_AFTER: Final = 1024  # dependencies of one job
# Queue policy (issue 15 part A): priority is -MAX_PRIORITY .. MAX_PRIORITY (PostgreSQL int4).
MAX_PRIORITY: Final = 1_000_000

# --- Capabilities, heartbeats and executor status (per message) ---
MAX_NODE_ID_BYTES: Final = 128
MAX_JOB_ID_CHARS: Final = 128  # JOB_ID_PATTERN's bound, for messages
MAX_DEVICES_PER_NODE: Final = 1024
MAX_DEVICE_INDEX: Final = 65535
MAX_DEVICE_MEMORY_MIB: Final = 1 << 26  # 64 TiB: holds MAX_GPU_MEMORY_GB
MAX_CPU_CORES: Final = 1 << 16
MAX_HOST_BYTES: Final = 1 << 60  # RAM and free disk: 1 EiB
MAX_NOTES: Final = 256  # notes on the node, and on each device
MAX_NOTE_BYTES: Final = 1024  # a note, a piece of GPU API evidence
MAX_PATH_BYTES: Final = 4096  # workload_python
MAX_CAP_FRAMEWORKS: Final = 1024  # framework name -> version entries a node reports
MAX_GRANT_ID_BYTES: Final = 256
MAX_REASON_BYTES: Final = 4096  # an executor's reason for a job's end
MAX_HOSTNAME_BYTES: Final = 253  # an advertise address given as a DNS name (RFC 1035)

# --- Device observations (per message, gpulayer.node.<node>.observations) ---
MIN_TEMPERATURE_C: Final = -273
MAX_TEMPERATURE_C: Final = 1000
MAX_POWER_W: Final = 100_000  # one device; finite, >= 0
MAX_UTILIZATION_PCT: Final = 100
# ECC error counts: exact as a float (metrics) and in PostgreSQL's bigint.
MAX_ERROR_COUNT: Final = 2**53
MAX_THROTTLE_REASONS: Final = 2**64 - 1  # NVML's bitmask is 64 bits

# --- Messages placement publishes ---
# NATS counts headers and payload together against max_payload. Room kept for the headers of a
# grant or event (Nats-Msg-Id, traceparent, a signature): far more than they use.
HEADER_RESERVE_BYTES: Final = 8 * KIB
# Room kept in a grant for everything around the job: grant id, node id, up to
# MAX_DEVICES_PER_NODE device indices, the visibility variables (the index list up to three
# times), the timestamp. The largest is ~25 KiB (tests/unit/test_bounds.py builds it).
GRANT_ENVELOPE_BYTES: Final = 32 * KIB
# An event (accepted, rejected, pending, failed, ...) never carries the job: bound_event clips
# its texts so it stays under this, whatever the job or node said.
MAX_EVENT_BYTES: Final = 64 * KIB
# The smallest server max_payload gpulayer runs with (NATS' default is 1 MiB).
MIN_MAX_PAYLOAD: Final = 128 * KIB
MAX_MESSAGE_CHARS: Final = 500  # one error or reason line; longer ones end in "..."
MAX_ERRORS: Final = 20  # errors listed for one rejected job; the rest are counted

_ENV_NAME = re.compile(ENV_NAME_PATTERN)
_JOB_ID = re.compile(JOB_ID_PATTERN)
_IDENT = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PROFILE_REF = re.compile(PROFILE_REF_PATTERN.removeprefix("^").removesuffix("$"))
# A DNS name: dot-separated labels of letters, digits, ``-`` (``_`` too, as container names
# have), none starting or ending with ``-``. Never a leading ``-``: it ends in torchrun's argv.
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")


def clip_text(text: str, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``max_chars`` characters, ending in ``...`` when cut."""
    if len(text) <= max_chars:
        return text
    return text[: max(0, max_chars - 3)] + "..."


def _show(value: object, max_chars: int = 40) -> str:
    """A value quoted for an error message: repr escapes NUL and control characters (a message
    is stored in PostgreSQL, which refuses NUL in text), and a long value is cut."""
    text = repr(value)
    return clip_text(text, max_chars) if len(text) > max_chars else text


def _key(path: str, key: str) -> str:
    """``$.env.HOME``; a key that isn't a plain word is quoted: ``$.env['A=B']``."""
    return f"{path}.{key}" if _IDENT.fullmatch(key) else f"{path}[{_show(key)}]"


def env_path(name: str) -> str:
    """The path of one env variable in an error message."""
    return _key("$.env", name)


def _utf8(text: str) -> int:
    # A lone surrogate (possible from Python, not from JSON) counts as 3 bytes, as it would
    # be escaped; _text refuses it.
    return len(text.encode("utf-8", "surrogatepass"))


def _range(
    path: str, value: float, low: float, high: float, *, low_open: bool = False
) -> str | None:
    """An error when ``value`` is not finite or outside [low, high] (low excluded if open)."""
    op = "<" if low_open else "<="
    if isinstance(value, int):
        # Any size: msgspec decodes integers beyond 64 bits, too big for a float.
        inside = value > low if low_open else value >= low
        if inside and value <= high:
            return None
        shown = (
            repr(value) if value.bit_length() <= 128 else f"an integer of {value.bit_length()} bits"
        )
    else:
        inside = math.isfinite(value) and (value > low if low_open else value >= low)
        if inside and value <= high:
            return None
        shown = repr(value)
    return f"{path}: {shown} is out of range ({_num(low)} {op} x <= {_num(high)})"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _text(path: str, text: str, max_bytes: int) -> Iterator[str]:
    if "\x00" in text:
        yield f"{path}: contains a NUL character (\\x00)"
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        yield f"{path}: contains a lone surrogate (not valid Unicode)"
        size = _utf8(text)
    if size > max_bytes:
        yield f"{path}: {size} bytes, over the limit of {max_bytes} bytes"


def _count(path: str, items: Sized, most: int) -> Iterator[str]:
    n = len(items)
    if n > most:
        yield f"{path}: {n} entries, over the limit of {most}"


def _texts(path: str, values: list[str], max_items: int, max_bytes: int) -> Iterator[str]:
    yield from _count(path, values, max_items)
    for i, value in enumerate(values[: max_items + 1]):
        yield from _text(f"{path}[{i}]", value, max_bytes)


def _text_map(
    path: str, values: dict[str, str], max_items: int, max_key: int, max_value: int
) -> Iterator[str]:
    yield from _count(path, values, max_items)
    for key, value in list(values.items())[: max_items + 1]:
        yield from _text(f"{path} key {_show(key)}", key, max_key)
        yield from _text(_key(path, key), value, max_value)


def _compute_capability(path: str, value: float | str) -> Iterator[str]:
    """Range of a compute capability that parses (one that doesn't is reported elsewhere)."""
    if isinstance(value, float) and not math.isfinite(value):
        yield f"{path}: {value!r} is out of range (a finite number such as 8.6)"
        return
    text = repr(value) if isinstance(value, float) else value.strip()
    if isinstance(value, str):
        yield from _text(path, value, MAX_SHORT_TEXT_BYTES)
        if _utf8(value) > MAX_SHORT_TEXT_BYTES:
            return
    major, _, minor = text.partition(".")
    parts = [major, minor] if minor else [major]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        return  # not a compute capability at all: validate_job says so
    top = MAX_COMPUTE_CAPABILITY_PART
    if any(n > top for n in numbers):
        yield f"{path}: {_show(value)} is out of range (major and minor each 0 .. {top})"


def job_bound_errors(job: JobRequest) -> list[str]:
    """Every hard bound ``job`` breaks, each naming the field path and the limit."""
    if _within_bounds(job):
        return []  # the common case, without building a path per field
    return list(_job_bounds(job))


def _fits(text: str, max_bytes: int) -> bool:
    """No NUL, valid Unicode, at most ``max_bytes`` in UTF-8 (a character is <= 4 bytes, so
    most strings need no encoding to tell)."""
    if "\x00" in text:
        return False
    if len(text) * 4 <= max_bytes and text.isascii():
        return True
    try:
        return len(text.encode("utf-8")) <= max_bytes
    except UnicodeEncodeError:
        return False


def _within_bounds(job: JobRequest) -> bool:
    """True when ``_job_bounds`` would find nothing; False means: look closer. Checked on every
    submit, so it is the fast mirror of ``_job_bounds`` (tests/unit/test_bounds.py compares the
    two on generated jobs)."""
    if not isinstance(job.job_id, str) or not _JOB_ID.fullmatch(job.job_id):
        return False
    if job.name is not None and not _fits(job.name, MAX_NAME_BYTES):
        return False
    command, env = job.command, job.env
    if len(command) > MAX_ARGV_ITEMS or len(env) > MAX_ENV_VARS:
        return False
    argv_bytes = 0
    for arg in command:
        if not _fits(arg, MAX_ARG_BYTES):
            return False
        argv_bytes += len(arg) if arg.isascii() else _utf8(arg)
    if argv_bytes > MAX_ARGV_BYTES:
        return False
    env_bytes = 0
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name) or len(name) > MAX_ENV_NAME_BYTES:
            return False
        if not _fits(value, MAX_ENV_VALUE_BYTES):
            return False
        env_bytes += len(name) + 1 + (len(value) if value.isascii() else _utf8(value))
    if env_bytes > MAX_ENV_BYTES:
        return False
    return _numbers_and_short_texts_fit(job)


def _numbers_and_short_texts_fit(job: JobRequest) -> bool:
    if job.timeout_s is not None and _range("", job.timeout_s, 0, MAX_TIMEOUT_S, low_open=True):
        return False
    req = job.requirements
    if _range("", req.gpu_count, 0, MAX_GPU_COUNT):
        return False
    if req.gpu_memory_gb is not None and _range(
        "", req.gpu_memory_gb, 0, MAX_GPU_MEMORY_GB, low_open=True
    ):
        return False
    if req.min_cuda_compute_capability is not None and any(
        _compute_capability("", req.min_cuda_compute_capability)
    ):
        return False
    if _range("", req.cpu_cores, 0, MAX_JOB_CPU_CORES, low_open=True) or _range(
        "", req.memory_gb, 0, MAX_JOB_MEMORY_GB, low_open=True
    ):
        return False
    short = MAX_SHORT_TEXT_BYTES
    texts: list[str] = [*req.frameworks, *req.frameworks.values(), *req.framework_capabilities]
    lists: list[Sized] = [req.frameworks, req.framework_capabilities]
    texts += [v for v in (req.python, req.driver, req.os) if v is not None]
    texts += job.profile_fields
    lists.append(job.profile_fields)
    if job.profile is not None and not (
        isinstance(job.profile, str) and _PROFILE_REF.fullmatch(job.profile)
    ):
        return False
    gpus = [job.gpu or GpuUsage(), *(v.gpu for v in job.variants.values())]
    for gpu in gpus:
        texts += gpu.apis_any
        lists.append(gpu.apis_any)
    dist = job.distributed
    if dist is not None:
        if _range("", dist.nodes, 1, MAX_DISTRIBUTED_NODES) or _range(
            "", dist.processes_per_node, 1, MAX_PROCESSES_PER_NODE
        ):
            return False
        texts += [v for v in (dist.backend, dist.launcher) if v is not None]
    if job.requires_core is not None:
        texts.append(job.requires_core)
    if not _lifecycle_fits(job) or _range("", job.priority, -MAX_PRIORITY, MAX_PRIORITY):
        return False
    return all(len(x) <= MAX_LIST_ITEMS for x in lists) and all(_fits(x, short) for x in texts)


def _lifecycle_fits(job: JobRequest) -> bool:
    """The fast mirror of ``_lifecycle_bounds``."""
    if _range("", job.retries, 0, MAX_RETRIES):
        return False
    r = job.restart
    if r is not None and (
        _range("", r.backoff_s, 0, MAX_BACKOFF_S) or _range("", r.max_backoff_s, 0, MAX_BACKOFF_S)
    ):
        return False
    a = job.array
    if a is not None:
        if _range("", a.count, 1, MAX_ARRAY_COUNT) or _array_id_error(job.job_id, a.count):
            return False
        if a.index is not None and _range("", a.index, 0, MAX_ARRAY_COUNT - 1):
            return False
    if _rank_id_error(job):
        return False
    after = job.after
    return len(after) <= MAX_AFTER and all(
        isinstance(x, str) and _JOB_ID.fullmatch(x) for x in after
    )


def _array_id_error(job_id: object, count: int) -> str | None:
    """An array's last job id, ``<job_id>-<count - 1>``, must still be a job id."""
    if not isinstance(job_id, str) or not isinstance(count, int) or count < 1:
        return None  # reported by the checks of the id and of the count
    last = f"{job_id}-{count - 1}"
    if _JOB_ID.fullmatch(last):
        return None
    return (
        f"$.array.count: the array's last job id {_show(last)} is {len(last)} characters, "
        f"over the job id's 128 ({JOB_ID_PATTERN}): use a shorter job_id"
    )


def _rank_id_error(job: JobRequest) -> str | None:
    """A distributed job's last rank id, ``<job_id>-rank<nodes - 1>`` (of the array's last job
    for an array), must still be a job id: a distributed job's id is that much shorter."""
    dist, a = job.distributed, job.array
    if (
        dist is None
        or not isinstance(dist.nodes, int)
        or not 1 <= dist.nodes <= MAX_DISTRIBUTED_NODES
    ):
        return None  # reported by the check of nodes
    if not isinstance(job.job_id, str) or not _JOB_ID.fullmatch(job.job_id):
        return None  # reported by the check of the id
    base, shape, of = job.job_id, "<job_id>", ""
    if a is not None and a.index is None and isinstance(a.count, int) and a.count >= 1:
        base, shape, of = (
            f"{job.job_id}-{a.count - 1}",
            "<job_id>-<i>",
            f" in an array of {a.count}",
        )
        if not _JOB_ID.fullmatch(base):
            return None  # reported by the check of the array
    last = rank_job_id(base, dist.nodes - 1)
    if _JOB_ID.fullmatch(last):
        return None
    most = MAX_JOB_ID_CHARS - (len(last) - len(job.job_id))
    return (
        f"$.job_id: a distributed job's id may have at most {most} characters for {dist.nodes} "
        f"nodes{of} (its ranks are {shape}{RANK_SUFFIX}<R>)"
    )


def _lifecycle_bounds(job: JobRequest) -> Iterator[str]:
    error = _range("$.retries", job.retries, 0, MAX_RETRIES)
    if error:
        yield error
    r = job.restart
    if r is not None:
        for path, value in (
            ("$.restart.backoff_s", r.backoff_s),
            ("$.restart.max_backoff_s", r.max_backoff_s),
        ):
            error = _range(path, value, 0, MAX_BACKOFF_S)
            if error:
                yield error
    a = job.array
    if a is not None:
        error = _range("$.array.count", a.count, 1, MAX_ARRAY_COUNT) or _array_id_error(
            job.job_id, a.count
        )
        if error:
            yield error
        if a.index is not None:
            error = _range("$.array.index", a.index, 0, MAX_ARRAY_COUNT - 1)
            if error:
                yield error
    error = _rank_id_error(job)
    if error:
        yield error
    yield from _count("$.after", job.after, MAX_AFTER)
    for i, dep in enumerate(job.after[: MAX_AFTER + 1]):
        if not isinstance(dep, str) or not _JOB_ID.fullmatch(dep):
            yield f"$.after[{i}]: {_show(dep)} is not a job id ({JOB_ID_PATTERN})"


def array_size_error(count: int, encoded_len: int) -> str | None:
    """The rejection for an array of ``count`` jobs of ``encoded_len`` bytes each (as stored);
    None when they fit MAX_ARRAY_BYTES together."""
    total = count * encoded_len
    if total <= MAX_ARRAY_BYTES:
        return None
    return (
        f"$.array.count: {count} jobs of {encoded_len} bytes are {total} bytes together, over "
        f"the limit of {MAX_ARRAY_BYTES} bytes for one array"
    )


def _job_bounds(job: JobRequest) -> Iterator[str]:
    # Constructed in Python, a JobRequest skips msgspec's constraints: check the id here too.
    if not isinstance(job.job_id, str) or not _JOB_ID.fullmatch(job.job_id):
        yield f"$.job_id: {_show(job.job_id)} is not a job id ({JOB_ID_PATTERN})"
    yield from _text("$.name", job.name, MAX_NAME_BYTES)

    yield from _count("$.command", job.command, MAX_ARGV_ITEMS)
    total = 0
    for i, arg in enumerate(job.command):
        size = _utf8(arg)
        total += size
        if i <= MAX_ARGV_ITEMS:
            yield from _text(f"$.command[{i}]", arg, MAX_ARG_BYTES)
    if total > MAX_ARGV_BYTES:
        yield f"$.command: {total} bytes in all, over the limit of {MAX_ARGV_BYTES} bytes"

    yield from _count("$.env", job.env, MAX_ENV_VARS)
    total = 0
    for i, (name, value) in enumerate(job.env.items()):
        total += _utf8(name) + 1 + _utf8(value)
        if i > MAX_ENV_VARS:
            continue
        path = env_path(name)
        if _utf8(name) > MAX_ENV_NAME_BYTES:
            yield (
                f"$.env: the name {_show(name)} is {_utf8(name)} bytes, "
                f"over the limit of {MAX_ENV_NAME_BYTES} bytes"
            )
        elif not _ENV_NAME.fullmatch(name):
            yield f"{path}: {_show(name)} is not a variable name ({ENV_NAME_PATTERN})"
        yield from _text(path, value, MAX_ENV_VALUE_BYTES)
    if total > MAX_ENV_BYTES:
        yield f"$.env: {total} bytes in all (NAME=value), over the limit of {MAX_ENV_BYTES} bytes"

    if job.timeout_s is not None:
        error = _range("$.timeout_s", job.timeout_s, 0, MAX_TIMEOUT_S, low_open=True)
        if error:
            yield error

    req = job.requirements
    p = "$.requirements"
    error = _range(f"{p}.gpu_count", req.gpu_count, 0, MAX_GPU_COUNT)
    if error:
        yield error
    if req.gpu_memory_gb is not None:
        error = _range(f"{p}.gpu_memory_gb", req.gpu_memory_gb, 0, MAX_GPU_MEMORY_GB, low_open=True)
        if error:
            yield error
    if req.min_cuda_compute_capability is not None:
        yield from _compute_capability(
            f"{p}.min_cuda_compute_capability", req.min_cuda_compute_capability
        )
    for error in (
        _range(f"{p}.cpu_cores", req.cpu_cores, 0, MAX_JOB_CPU_CORES, low_open=True),
        _range(f"{p}.memory_gb", req.memory_gb, 0, MAX_JOB_MEMORY_GB, low_open=True),
    ):
        if error:
            yield error
    yield from _text_map(
        f"{p}.frameworks",
        req.frameworks,
        MAX_LIST_ITEMS,
        MAX_SHORT_TEXT_BYTES,
        MAX_SHORT_TEXT_BYTES,
    )
    yield from _texts(
        f"{p}.framework_capabilities",
        req.framework_capabilities,
        MAX_LIST_ITEMS,
        MAX_SHORT_TEXT_BYTES,
    )
    for field in ("python", "driver", "os"):
        yield from _opt_text(f"{p}.{field}", getattr(req, field), MAX_SHORT_TEXT_BYTES)

    sections: list[tuple[str, GpuUsage]] = [("$.gpu", job.gpu or GpuUsage())]
    sections += [(f"$.variants.{k}.gpu", v.gpu) for k, v in job.variants.items()]
    for path, gpu in sections:
        yield from _texts(f"{path}.apis_any", gpu.apis_any, MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES)

    dist = job.distributed
    if dist is not None:
        p = "$.distributed"
        for error_or_none in (
            _range(f"{p}.nodes", dist.nodes, 1, MAX_DISTRIBUTED_NODES),
            _range(f"{p}.processes_per_node", dist.processes_per_node, 1, MAX_PROCESSES_PER_NODE),
        ):
            if error_or_none:
                yield error_or_none
        for field in ("backend", "launcher"):
            value = getattr(dist, field)
            if value is not None:
                yield from _text(f"{p}.{field}", value, MAX_SHORT_TEXT_BYTES)
    if job.requires_core is not None:
        yield from _text("$.requires_core", job.requires_core, MAX_SHORT_TEXT_BYTES)
    if job.profile is not None and not (
        isinstance(job.profile, str) and _PROFILE_REF.fullmatch(job.profile)
    ):
        # msgspec checks the pattern with re.search, where "$" also matches before a final
        # newline; a Python-built job skips it altogether.
        yield f"$.profile: {_show(job.profile)} is not name@version ({PROFILE_REF_PATTERN})"
    yield from _texts("$.profile_fields", job.profile_fields, MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES)
    yield from _lifecycle_bounds(job)
    # Queue policy (issue 15 part A).
    error = _range("$.priority", job.priority, -MAX_PRIORITY, MAX_PRIORITY)
    if error:
        yield error


def bound_messages(messages: list[str], most: int = MAX_ERRORS) -> list[str]:
    """At most ``most`` lines of at most MAX_MESSAGE_CHARS each; the rest are counted."""
    clipped = [clip_text(m) for m in messages[:most]]
    if len(messages) > most:
        clipped.append(f"... and {len(messages) - most} more")
    return clipped


def max_job_bytes(max_payload: int) -> int:
    """The largest job, as placement encodes it (``len(encode(job))``), whose grant fits a
    server with this ``max_payload``: the grant is the job plus at most GRANT_ENVELOPE_BYTES,
    sent with at most HEADER_RESERVE_BYTES of headers. Raises ValueError below MIN_MAX_PAYLOAD
    (a server configured that small is a deployment error, not a job's)."""
    if max_payload < MIN_MAX_PAYLOAD:
        raise ValueError(
            f"the NATS server's max_payload is {max_payload} bytes; gpulayer needs at least "
            f"{MIN_MAX_PAYLOAD}"
        )
    return max_payload - GRANT_ENVELOPE_BYTES - HEADER_RESERVE_BYTES


def job_size_error(encoded_len: int, max_payload: int) -> str | None:
    """The rejection for a job of ``encoded_len`` bytes (``len(encode(job))``, the job as it
    will sit in its grant) on a server with this ``max_payload``; None when it fits."""
    limit = max_job_bytes(max_payload)
    if encoded_len <= limit:
        return None
    return (
        f"$: the job is {encoded_len} bytes encoded, over the limit of {limit} bytes "
        f"(the server's max_payload of {max_payload} bytes, less "
        f"{max_payload - limit} kept for the grant around the job)"
    )


# --- Capabilities, heartbeats, executor status ---


def _opt_text(path: str, value: str | None, max_bytes: int) -> Iterator[str]:
    if value is not None:
        yield from _text(path, value, max_bytes)


def _opt_range(path: str, value: int | None, low: int, high: int) -> Iterator[str]:
    if value is not None:
        error = _range(path, value, low, high)
        if error:
            yield error


def node_id_errors(node_id: str, path: str = "$.node_id") -> list[str]:
    """A node id is one NATS subject token: 1 to MAX_NODE_ID_BYTES bytes, no ``.``, ``*``,
    ``>``, whitespace or control characters (it also sits in every grant's envelope)."""
    errors = list(_text(path, node_id, MAX_NODE_ID_BYTES))
    if not node_id:
        errors.append(f"{path}: empty")
    elif any(c in ".*>" or c.isspace() or not c.isprintable() for c in node_id):
        errors.append(
            f"{path}: {_show(node_id)} is not a subject token (no . * > whitespace or "
            "control characters)"
        )
    return errors


def address_error(value: str, path: str = "$.host.advertise_address") -> str | None:
    """Why ``value`` is not an address other nodes can be told to connect to (an IPv4 or IPv6
    address, or a host name), or None. Rank 0's becomes every rank's MASTER_ADDR."""
    if isinstance(value, str) and len(value) <= MAX_HOSTNAME_BYTES and _is_address(value):
        return None
    return f"{path}: {_show(value)} is neither an IP address nor a host name"


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


def _in(value: int | None, low: int, high: int) -> bool:
    return value is None or (isinstance(value, int) and low <= value <= high)


def _capabilities_within_bounds(caps: WorkerCapabilities) -> bool:
    """True when ``_capabilities`` would find nothing; False means: look closer. The fast
    mirror of ``_capabilities`` (tests/unit/test_bounds.py compares the two)."""
    if node_id_errors(caps.node_id):
        return False
    host = caps.host
    if not (
        _in(host.cpu_cores, 0, MAX_CPU_CORES)
        and _in(host.memory_bytes, 0, MAX_HOST_BYTES)
        and _in(host.disk_free_bytes, 0, MAX_HOST_BYTES)
    ):
        return False
    if host.advertise_address is not None and address_error(host.advertise_address):
        return False
    apis = caps.gpu_apis
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
    lists: list[tuple[list[str], int]] = [
        (caps.framework_capabilities, MAX_LIST_ITEMS),
        (caps.distributed_backends, MAX_LIST_ITEMS),
        (caps.launchers, MAX_LIST_ITEMS),
        (apis.host, MAX_LIST_ITEMS),
        (apis.containers, MAX_LIST_ITEMS),
        (caps.notes, MAX_NOTES),
    ]
    for items, _ in lists[:5]:
        short += items
    if len(caps.accelerators) > MAX_DEVICES_PER_NODE:
        return False
    for d in caps.accelerators:
        if not (
            _in(d.index, 0, MAX_DEVICE_INDEX)
            and _in(d.memory_mib, 0, MAX_DEVICE_MEMORY_MIB)
            and _in(d.mig_parent, 0, MAX_DEVICE_INDEX)
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
    if len(caps.frameworks) > MAX_CAP_FRAMEWORKS or len(apis.evidence) > MAX_LIST_ITEMS:
        return False
    if any(len(items) > most for items, most in lists):
        return False
    path = [caps.workload_python] if caps.workload_python is not None else []
    return (
        _all_fit(short, MAX_SHORT_TEXT_BYTES)
        and _all_fit(notes, MAX_NOTE_BYTES)
        and _all_fit(path, MAX_PATH_BYTES)
    )


def _all_fit(texts: list[str], max_bytes: int) -> bool:
    """``_fits`` for each of ``texts``, in a few C-speed passes when all are ASCII."""
    if not texts:
        return True
    joined = "".join(texts)
    if joined.isascii() and "\x00" not in joined:
        return max(map(len, texts)) <= max_bytes
    return all(_fits(x, max_bytes) for x in texts)


@functools.lru_cache(maxsize=1024)
def _compute_capability_ok(value: float | str) -> bool:
    # A fleet reports a handful of distinct values: each is judged once.
    return not any(_compute_capability("", value))


def _capabilities(caps: WorkerCapabilities) -> Iterator[str]:
    yield from node_id_errors(caps.node_id)
    yield from _text("$.agent_version", caps.agent_version, MAX_SHORT_TEXT_BYTES)
    host = caps.host
    for field in ("hostname", "os", "os_release", "platform", "arch", "python_version"):
        yield from _opt_text(f"$.host.{field}", getattr(host, field), MAX_SHORT_TEXT_BYTES)
    yield from _opt_range("$.host.cpu_cores", host.cpu_cores, 0, MAX_CPU_CORES)
    yield from _opt_range("$.host.memory_bytes", host.memory_bytes, 0, MAX_HOST_BYTES)
    yield from _opt_range("$.host.disk_free_bytes", host.disk_free_bytes, 0, MAX_HOST_BYTES)
    if host.advertise_address is not None:
        error = address_error(host.advertise_address)
        if error:
            yield error

    yield from _count("$.accelerators", caps.accelerators, MAX_DEVICES_PER_NODE)
    for i, d in enumerate(caps.accelerators[: MAX_DEVICES_PER_NODE + 1]):
        p = f"$.accelerators[{i}]"
        yield from _opt_range(f"{p}.index", d.index, 0, MAX_DEVICE_INDEX)
        yield from _opt_range(f"{p}.memory_mib", d.memory_mib, 0, MAX_DEVICE_MEMORY_MIB)
        yield from _opt_range(f"{p}.mig_parent", d.mig_parent, 0, MAX_DEVICE_INDEX)
        for field in (
            "vendor",
            "name",
            "uuid",
            "driver_version",
            "cuda_driver_version",
            "mig_mode",
            "mig_profile",
        ):
            yield from _opt_text(f"{p}.{field}", getattr(d, field), MAX_SHORT_TEXT_BYTES)
        if d.compute_capability is not None:
            yield from _compute_capability(f"{p}.compute_capability", d.compute_capability)
        yield from _texts(f"{p}.notes", d.notes, MAX_NOTES, MAX_NOTE_BYTES)

    yield from _opt_text("$.workload_python", caps.workload_python, MAX_PATH_BYTES)
    yield from _opt_text(
        "$.workload_python_version", caps.workload_python_version, MAX_SHORT_TEXT_BYTES
    )
    yield from _text_map(
        "$.frameworks",
        caps.frameworks,
        MAX_CAP_FRAMEWORKS,
        MAX_SHORT_TEXT_BYTES,
        MAX_SHORT_TEXT_BYTES,
    )
    for field in ("framework_capabilities", "distributed_backends", "launchers"):
        yield from _texts(f"$.{field}", getattr(caps, field), MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES)
    apis = caps.gpu_apis
    yield from _texts("$.gpu_apis.host", apis.host, MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES)
    yield from _texts(
        "$.gpu_apis.containers", apis.containers, MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES
    )
    yield from _text_map(
        "$.gpu_apis.evidence", apis.evidence, MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES, MAX_NOTE_BYTES
    )
    yield from _opt_text("$.advertise_address", caps.advertise_address, MAX_SHORT_TEXT_BYTES)
    yield from _text("$.origin", caps.origin, MAX_SHORT_TEXT_BYTES)
    yield from _texts("$.notes", caps.notes, MAX_NOTES, MAX_NOTE_BYTES)


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
            _in(d.index, 0, MAX_DEVICE_INDEX)
            and _in(d.memory_used_mib, 0, MAX_DEVICE_MEMORY_MIB)
            and _in(d.memory_free_mib, 0, MAX_DEVICE_MEMORY_MIB)
            and _in(d.utilization_pct, 0, MAX_UTILIZATION_PCT)
            and _in(d.temperature_c, MIN_TEMPERATURE_C, MAX_TEMPERATURE_C)
            and _in(d.throttle_reasons, 0, MAX_THROTTLE_REASONS)
            and _in(d.ecc_uncorrected_volatile, 0, MAX_ERROR_COUNT)
            and _in(d.ecc_uncorrected_aggregate, 0, MAX_ERROR_COUNT)
        ):
            return False
        p = d.power_w
        if p is not None and not (isinstance(p, int | float) and 0 <= p <= MAX_POWER_W):
            return False  # NaN fails both comparisons
        if d.uuid is not None:
            short.append(d.uuid)
        if d.reason is not None:
            notes.append(d.reason)
    return _all_fit(short, MAX_SHORT_TEXT_BYTES) and _all_fit(notes, MAX_NOTE_BYTES)


def _observations(obs: NodeObservations) -> Iterator[str]:
    yield from node_id_errors(obs.node_id)
    yield from _count("$.devices", obs.devices, MAX_DEVICES_PER_NODE)
    for i, d in enumerate(obs.devices[: MAX_DEVICES_PER_NODE + 1]):
        p = f"$.devices[{i}]"
        yield from _opt_range(f"{p}.index", d.index, 0, MAX_DEVICE_INDEX)
        yield from _opt_text(f"{p}.uuid", d.uuid, MAX_SHORT_TEXT_BYTES)
        for field in ("memory_used_mib", "memory_free_mib"):
            yield from _opt_range(f"{p}.{field}", getattr(d, field), 0, MAX_DEVICE_MEMORY_MIB)
        yield from _opt_range(f"{p}.utilization_pct", d.utilization_pct, 0, MAX_UTILIZATION_PCT)
        yield from _opt_range(
            f"{p}.temperature_c", d.temperature_c, MIN_TEMPERATURE_C, MAX_TEMPERATURE_C
        )
        if d.power_w is not None:
            error = _range(f"{p}.power_w", d.power_w, 0, MAX_POWER_W)
            if error:
                yield error
        yield from _opt_range(f"{p}.throttle_reasons", d.throttle_reasons, 0, MAX_THROTTLE_REASONS)
        for field in ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate"):
            yield from _opt_range(f"{p}.{field}", getattr(d, field), 0, MAX_ERROR_COUNT)
        yield from _opt_text(f"{p}.reason", d.reason, MAX_NOTE_BYTES)
    yield from _texts("$.notes", obs.notes, MAX_NOTES, MAX_NOTE_BYTES)


def validate_heartbeat(beat: Heartbeat) -> list[str]:
    """Every hard bound a heartbeat breaks (its strings end up in logs and the node's row)."""
    errors = node_id_errors(beat.node_id)
    errors += _text("$.source", beat.source, MAX_SHORT_TEXT_BYTES)
    errors += _opt_text("$.agent_version", beat.agent_version, MAX_SHORT_TEXT_BYTES)
    errors += _opt_range("$.slots", beat.slots, 0, MAX_EXECUTOR_SLOTS)
    for path, value, high in (
        ("$.reserved_cores", beat.reserved_cores, MAX_JOB_CPU_CORES),
        ("$.reserved_memory_gb", beat.reserved_memory_gb, MAX_JOB_MEMORY_GB),
    ):
        error = None if value is None else _range(path, value, 0, high)
        if error:
            errors.append(error)
    errors += _opt_text("$.enforcement", beat.enforcement, MAX_SHORT_TEXT_BYTES)
    return bound_messages(errors)


def validate_job_status(status: JobStatus) -> list[str]:
    """Every hard bound an executor's status message breaks: ids, exit code and pid within
    PostgreSQL's int4, the reason's size, NUL anywhere."""
    errors: list[str] = []
    if not _JOB_ID.fullmatch(status.job_id):
        errors.append(f"$.job_id: {_show(status.job_id)} is not a job id ({JOB_ID_PATTERN})")
    errors += _text("$.grant_id", status.grant_id, MAX_GRANT_ID_BYTES)
    errors += node_id_errors(status.node_id)
    errors += _opt_range("$.pid", status.pid, 0, INT32_MAX)
    errors += _opt_range("$.exit_code", status.exit_code, INT32_MIN, INT32_MAX)
    errors += _opt_range("$.signal", status.signal, 0, INT32_MAX)
    errors += _opt_text("$.reason", status.reason, MAX_REASON_BYTES)
    return bound_messages(errors)


# --- Events placement publishes ---

E = TypeVar("E", bound=JobEvent)
_TEXT_FIELDS = ("summary", "reason")
_LIST_FIELDS = ("reasons", "warnings")
_encoder = msgspec.json.Encoder()


def bound_event(event: E) -> E:
    """``event`` with its texts (``summary``, ``reason``, ``reasons``, ``warnings``) clipped so
    that it encodes to at most MAX_EVENT_BYTES, whatever the job, the matcher or an executor
    put in them. Placement calls it on every event before publishing; unchanged when it fits."""
    if len(_encoder.encode(event)) <= MAX_EVENT_BYTES:
        return event
    changes: dict[str, object] = {}
    for name in _TEXT_FIELDS:
        value = getattr(event, name, None)
        if isinstance(value, str):
            changes[name] = clip_text(value, 4 * MAX_MESSAGE_CHARS)
    lists: dict[str, list[str]] = {}
    for name in _LIST_FIELDS:
        value = getattr(event, name, None)
        if isinstance(value, list):
            lists[name] = bound_messages(value)
    clipped = msgspec.structs.replace(event, **changes, **lists)
    # Each line is short now, but up to MAX_ERRORS of them, escaped, can still be too much:
    # drop lines from the end, saying how many.
    while len(_encoder.encode(clipped)) > MAX_EVENT_BYTES:
        candidates = [n for n in lists if lists[n]]
        if not candidates:
            break  # pragma: no cover - ids and clipped texts alone are far under the limit
        name = max(candidates, key=lambda n: len(lists[n]))
        kept = [line for line in lists[name] if not line.startswith("... and ")][:-1]
        dropped = len(getattr(event, name)) - len(kept)
        lists[name] = [*kept, f"... and {dropped} more"]
        clipped = msgspec.structs.replace(event, **changes, **lists)
    return clipped
