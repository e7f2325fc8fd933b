"""gpulayer contracts: every message that crosses a process boundary, as msgspec structs.

No I/O here. Users publish these, so they are the product's API: fields are only ever added,
each with a default.
"""

from gpulayer_contracts.bounds import (
    bound_event,
    job_size_error,
    max_job_bytes,
    validate_capabilities,
    validate_heartbeat,
    validate_job_status,
)
from gpulayer_contracts.capabilities import (
    AcceleratorDevice,
    GpuApis,
    Heartbeat,
    HostInfo,
    WorkerCapabilities,
)
from gpulayer_contracts.codec import (
    InvalidInput,
    decode_job_json,
    decode_job_toml,
    encode,
    job_schema,
    load_job_file,
)
from gpulayer_contracts.events import (
    Accepted,
    AnyJobEvent,
    CancelJob,
    Cancelled,
    Failed,
    Grant,
    JobEvent,
    JobStatus,
    LogLine,
    Lost,
    Pending,
    Placed,
    Rejected,
    Running,
    Succeeded,
    Warned,
    is_terminal,
)
from gpulayer_contracts.health import DeviceObservation, DoctorReport, NodeObservations
from gpulayer_contracts.jobs import (
    Distributed,
    GpuUsage,
    JobRequest,
    Requirements,
    Sandbox,
    SandboxDevices,
    Variant,
)
from gpulayer_contracts.schemas import WIRE_SCHEMAS, schema_for_subject, wire_schema
from gpulayer_contracts.validation import Validation, validate_job
from gpulayer_contracts.version import __version__

__all__ = [
    "WIRE_SCHEMAS",
    "AcceleratorDevice",
    "Accepted",
    "AnyJobEvent",
    "CancelJob",
    "Cancelled",
    "DeviceObservation",
    "Distributed",
    "DoctorReport",
    "Failed",
    "GpuApis",
    "GpuUsage",
    "Grant",
    "Heartbeat",
    "HostInfo",
    "InvalidInput",
    "JobEvent",
    "JobRequest",
    "JobStatus",
    "LogLine",
    "Lost",
    "NodeObservations",
    "Pending",
    "Placed",
    "Rejected",
    "Requirements",
    "Running",
    "Sandbox",
    "SandboxDevices",
    "Succeeded",
    "Validation",
    "Variant",
    "Warned",
    "WorkerCapabilities",
    "__version__",
    "bound_event",
    "decode_job_json",
    "decode_job_toml",
    "encode",
    "is_terminal",
    "job_schema",
    "job_size_error",
    "load_job_file",
    "max_job_bytes",
    "schema_for_subject",
    "validate_capabilities",
    "validate_heartbeat",
    "validate_job",
    "validate_job_status",
    "wire_schema",
]
