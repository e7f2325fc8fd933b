"""The limits themselves: one named constant per bound (docs/operations.md, "Bounds", lists
each with its value; tests/unit/test_bounds.py checks that it does)."""

from __future__ import annotations

from typing import Final

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
# A container image reference: a 255-character name (Docker's and podman's limit), a tag of
# 128 and a sha512 digest fit with room to spare.
MAX_IMAGE_REF_BYTES: Final = 512

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
# CDI device names a node reports (container_runtime.cdi_devices): NVIDIA's spec names each GPU
# by index and by UUID, and each MIG instance twice too, so MAX_DEVICES_PER_NODE devices need
# ~2048; each name a short text.
MAX_CDI_DEVICES: Final = 4096
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
