"""Hard bounds (gpulayer_contracts.bounds): each one named in the error with its limit, a value
just inside accepted, no validated job able to break the matcher."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpulayer_contracts import bounds as b
from gpulayer_contracts.bounds import jobs as bounds_jobs
from gpulayer_contracts.bounds import nodes as bounds_nodes
from gpulayer_contracts.capabilities import (
    AcceleratorDevice,
    GpuApis,
    Heartbeat,
    HostInfo,
    WorkerCapabilities,
)
from gpulayer_contracts.codec import (
    InvalidInput,
    best_effort_job_id,
    capabilities_decoder,
    decode_job_json,
    decode_job_toml,
    decode_message,
    status_decoder,
)
from gpulayer_contracts.events import Accepted, Failed, JobStatus, Pending, Rejected
from gpulayer_contracts.jobs import (
    Distributed,
    GpuUsage,
    JobRequest,
    Requirements,
    Variant,
)
from gpulayer_contracts.validation import validate_job
from gpulayer_matching import NodeView, Placement, explain, match


def make_job(**fields: Any) -> JobRequest:
    base: dict[str, Any] = {"job_id": "j1", "command": ["true"]}
    base.update(fields)
    return JobRequest(**base)


def req(**fields: Any) -> JobRequest:
    return make_job(requirements=Requirements(**fields))


def dist(**fields: Any) -> JobRequest:
    return make_job(distributed=Distributed(**fields))


def errors_of(job: JobRequest) -> list[str]:
    return validate_job(job).errors


# (what, job just outside the bound, expected error, job just inside)
OUTSIDE_INSIDE: list[tuple[str, JobRequest, str, JobRequest]] = [
    (
        "gpu_memory_gb huge",
        req(gpu_memory_gb=1e308),
        "$.requirements.gpu_memory_gb: 1e+308 is out of range (0 < x <= 65536)",
        req(gpu_memory_gb=65536.0),
    ),
    (
        "gpu_memory_gb inf",
        req(gpu_memory_gb=math.inf),
        "$.requirements.gpu_memory_gb: inf is out of range (0 < x <= 65536)",
        req(gpu_memory_gb=0.001),
    ),
    (
        "gpu_memory_gb nan",
        req(gpu_memory_gb=math.nan),
        "$.requirements.gpu_memory_gb: nan is out of range (0 < x <= 65536)",
        req(gpu_memory_gb=80.0),
    ),
    (
        "cpu_cores nan",
        req(cpu_cores=math.nan),
        "$.requirements.cpu_cores: nan is out of range (0 < x <= 65536)",
        req(cpu_cores=0.001),
    ),
    (
        "cpu_cores huge",
        req(cpu_cores=1e308),
        "$.requirements.cpu_cores: 1e+308 is out of range (0 < x <= 65536)",
        req(cpu_cores=65536.0),
    ),
    (
        "memory_gb inf",
        req(memory_gb=math.inf),
        "$.requirements.memory_gb: inf is out of range (0 < x <= 1000000000)",
        req(memory_gb=1e9),
    ),
    (
        "memory_gb zero",
        req(memory_gb=0.0),
        "$.requirements.memory_gb: 0.0 is out of range (0 < x <= 1000000000)",
        req(memory_gb=1e-9),
    ),
    (
        "gpu_count",
        req(gpu_count=b.MAX_GPU_COUNT + 1),
        "$.requirements.gpu_count: 1025 is out of range (0 <= x <= 1024)",
        req(gpu_count=b.MAX_GPU_COUNT),
    ),
    (
        "gpu_count 2^40",
        req(gpu_count=2**40),
        "$.requirements.gpu_count: 1099511627776 is out of range (0 <= x <= 1024)",
        req(gpu_count=0),
    ),
    (
        "compute capability major",
        req(accelerator="cuda", min_cuda_compute_capability="100.0"),
        "$.requirements.min_cuda_compute_capability: '100.0' is out of range "
        "(major and minor each 0 .. 99)",
        req(accelerator="cuda", min_cuda_compute_capability="99.99"),
    ),
    (
        "compute capability float minor",
        req(accelerator="cuda", min_cuda_compute_capability=8.123),
        "$.requirements.min_cuda_compute_capability: 8.123 is out of range "
        "(major and minor each 0 .. 99)",
        req(accelerator="cuda", min_cuda_compute_capability=8.6),
    ),
    (
        "timeout",
        make_job(timeout_s=b.MAX_TIMEOUT_S + 1.0),
        "$.timeout_s: 31622401.0 is out of range (0 < x <= 31622400)",
        make_job(timeout_s=float(b.MAX_TIMEOUT_S)),
    ),
    (
        "timeout inf",
        make_job(timeout_s=math.inf),
        "$.timeout_s: inf is out of range (0 < x <= 31622400)",
        make_job(timeout_s=0.5),
    ),
    (
        "distributed nodes",
        dist(nodes=b.MAX_DISTRIBUTED_NODES + 1),
        "$.distributed.nodes: 4097 is out of range (1 <= x <= 4096)",
        dist(nodes=b.MAX_DISTRIBUTED_NODES),
    ),
    (
        "processes per node",
        dist(processes_per_node=b.MAX_PROCESSES_PER_NODE + 1),
        "$.distributed.processes_per_node: 1025 is out of range (1 <= x <= 1024)",
        dist(processes_per_node=b.MAX_PROCESSES_PER_NODE),
    ),
    (
        "argv count",
        make_job(command=["true"] * (b.MAX_ARGV_ITEMS + 1)),
        "$.command: 4097 entries, over the limit of 4096",
        make_job(command=["true"] * b.MAX_ARGV_ITEMS),
    ),
    (
        "one argument",
        make_job(command=["echo", "x" * (b.MAX_ARG_BYTES + 1)]),
        "$.command[1]: 131072 bytes, over the limit of 131071 bytes",
        make_job(command=["echo", "x" * b.MAX_ARG_BYTES]),
    ),
    (
        "one argument, UTF-8 bytes not characters",
        make_job(command=["echo", "é" * (b.MAX_ARG_BYTES // 2 + 1)]),
        "$.command[1]: 131072 bytes, over the limit of 131071 bytes",
        make_job(command=["echo", "é" * (b.MAX_ARG_BYTES // 2)]),
    ),
    (
        "argv total",
        make_job(command=["x" * 131_000] * 4 + ["y" * (b.MAX_ARGV_BYTES - 4 * 131_000 + 1)]),
        "$.command: 524289 bytes in all, over the limit of 524288 bytes",
        make_job(command=["x" * 131_000] * 4 + ["y" * (b.MAX_ARGV_BYTES - 4 * 131_000)]),
    ),
    (
        "env count",
        make_job(env={f"V{i}": "" for i in range(b.MAX_ENV_VARS + 1)}),
        "$.env: 1025 entries, over the limit of 1024",
        make_job(env={f"V{i}": "" for i in range(b.MAX_ENV_VARS)}),
    ),
    (
        "env name with =",
        make_job(env={"A=B": "1"}),
        "$.env['A=B']: 'A=B' is not a variable name ([A-Za-z_][A-Za-z0-9_]*)",
        make_job(env={"A_B": "1"}),
    ),
    (
        "empty env name",
        make_job(env={"": "1"}),
        "$.env['']: '' is not a variable name ([A-Za-z_][A-Za-z0-9_]*)",
        make_job(env={"_": "1"}),
    ),
    (
        "env name starting with a digit",
        make_job(env={"1A": "1"}),
        "$.env.1A: '1A' is not a variable name ([A-Za-z_][A-Za-z0-9_]*)",
        make_job(env={"A1": "1"}),
    ),
    (
        "env name size",
        make_job(env={"N" * (b.MAX_ENV_NAME_BYTES + 1): "1"}),
        "is 257 bytes, over the limit of 256 bytes",
        make_job(env={"N" * b.MAX_ENV_NAME_BYTES: "1"}),
    ),
    (
        "env value size",
        make_job(env={"BIG": "v" * (b.MAX_ENV_VALUE_BYTES + 1)}),
        "$.env.BIG: 65537 bytes, over the limit of 65536 bytes",
        make_job(env={"BIG": "v" * b.MAX_ENV_VALUE_BYTES}),
    ),
    (
        "env total",
        # 4 variables of NAME=value: 2 + 1 + 65533 bytes each is the total exactly.
        make_job(env={f"V{i}": "v" * (65533 + (i == 3)) for i in range(4)}),
        "$.env: 262145 bytes in all (NAME=value), over the limit of 262144 bytes",
        make_job(env={f"V{i}": "v" * 65533 for i in range(4)}),
    ),
    (
        "name",
        make_job(name="n" * (b.MAX_NAME_BYTES + 1)),
        "$.name: 1025 bytes, over the limit of 1024 bytes",
        make_job(name="n" * b.MAX_NAME_BYTES),
    ),
    (
        "framework specifier",
        req(frameworks={"torch": ">=" + "1" * (b.MAX_SHORT_TEXT_BYTES - 1)}),
        "$.requirements.frameworks.torch: 257 bytes, over the limit of 256 bytes",
        req(frameworks={"torch": ">=" + "1" * (b.MAX_SHORT_TEXT_BYTES - 2)}),
    ),
    (
        "framework count",
        req(frameworks={f"f{i}": ">=1" for i in range(b.MAX_LIST_ITEMS + 1)}),
        "$.requirements.frameworks: 65 entries, over the limit of 64",
        req(frameworks={f"f{i}": ">=1" for i in range(b.MAX_LIST_ITEMS)}),
    ),
    (
        "framework name",
        req(frameworks={"f" * (b.MAX_SHORT_TEXT_BYTES + 1): ">=1"}),
        "$.requirements.frameworks key 'ffffffffffffffffffffffffffffffffffff...: "
        "257 bytes, over the limit of 256 bytes",
        req(frameworks={"f" * b.MAX_SHORT_TEXT_BYTES: ">=1"}),
    ),
    (
        "framework capabilities count",
        req(framework_capabilities=["torch.cuda"] * (b.MAX_LIST_ITEMS + 1)),
        "$.requirements.framework_capabilities: 65 entries, over the limit of 64",
        req(framework_capabilities=["torch.cuda"] * b.MAX_LIST_ITEMS),
    ),
    (
        "python specifier",
        req(python=">=3." + "1" * (b.MAX_SHORT_TEXT_BYTES - 3)),
        "$.requirements.python: 257 bytes, over the limit of 256 bytes",
        req(python=">=3." + "1" * (b.MAX_SHORT_TEXT_BYTES - 4)),
    ),
    (
        "driver specifier",
        req(driver=">=5." + "1" * (b.MAX_SHORT_TEXT_BYTES - 3)),
        "$.requirements.driver: 257 bytes, over the limit of 256 bytes",
        req(driver=">=5." + "1" * (b.MAX_SHORT_TEXT_BYTES - 4)),
    ),
    (
        "profile_fields count",
        make_job(profile_fields=["python"] * (b.MAX_LIST_ITEMS + 1)),
        "$.profile_fields: 65 entries, over the limit of 64",
        make_job(profile_fields=["python"] * b.MAX_LIST_ITEMS),
    ),
    (
        "profile built in Python",
        make_job(profile="p" * 65 + "@1"),
        "... is not name@version",
        make_job(profile="p" * 64 + "@1"),
    ),
    (
        "apis_any count in a variant",
        make_job(
            variants={
                "linux": Variant(
                    gpu=GpuUsage(use="shared", apis_any=["vulkan"] * (b.MAX_LIST_ITEMS + 1))
                )
            }
        ),
        "$.variants.linux.gpu.apis_any: 65 entries, over the limit of 64",
        make_job(
            variants={
                "linux": Variant(gpu=GpuUsage(use="shared", apis_any=["vulkan"] * b.MAX_LIST_ITEMS))
            }
        ),
    ),
    (
        "backend",
        dist(backend="g" * (b.MAX_SHORT_TEXT_BYTES + 1)),
        "$.distributed.backend: 257 bytes, over the limit of 256 bytes",
        dist(backend="g" * b.MAX_SHORT_TEXT_BYTES),
    ),
    (
        "requires_core",
        make_job(requires_core=">=0." + "0" * (b.MAX_SHORT_TEXT_BYTES - 3)),
        "$.requires_core: 257 bytes, over the limit of 256 bytes",
        make_job(requires_core=">=0." + "0" * (b.MAX_SHORT_TEXT_BYTES - 4)),
    ),
    (
        "job id built in Python",
        make_job(job_id="a" * 129),
        "$.job_id: 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa... is not a job id",
        make_job(job_id="a" * 128),
    ),
    # Queue policy (issue 15 part A).
    (
        "priority high",
        make_job(priority=b.MAX_PRIORITY + 1),
        "$.priority: 1000001 is out of range (-1000000 <= x <= 1000000)",
        make_job(priority=b.MAX_PRIORITY),
    ),
    (
        "priority low",
        make_job(priority=-(2**70)),
        "$.priority: -1180591620717411303424 is out of range (-1000000 <= x <= 1000000)",
        make_job(priority=-b.MAX_PRIORITY),
    ),
]


@pytest.mark.parametrize(
    ("outside", "expected", "inside"),
    [pytest.param(o, e, i, id=name) for name, o, e, i in OUTSIDE_INSIDE],
)
def test_bound_is_named_with_its_limit_and_just_inside_passes(
    outside: JobRequest, expected: str, inside: JobRequest
) -> None:
    errors = errors_of(outside)
    assert any(expected in e for e in errors), errors
    assert errors_of(inside) == []


# A job with every free-text field set, so that a NUL can be put in each one.
FULL: dict[str, Any] = {
    "job_id": "j1",
    "command": ["python", "train.py"],
    "name": "train",
    "env": {"SEED": "1"},
    "requirements": {
        "accelerator": "cuda",  # nccl needs it
        "min_cuda_compute_capability": "8.0",
        "frameworks": {"torch": ">=2"},
        "framework_capabilities": ["torch.cuda"],
        "python": ">=3.10",
        "driver": ">=550",
    },
    "gpu": {"use": "shared", "apis_any": ["cuda"]},
    "variants": {"linux": {"gpu": {"use": "shared", "apis_any": ["vulkan"]}}},
    "distributed": {"backend": "nccl", "launcher": "torchrun"},
    "requires_core": ">=0",
}
# Every string and map key in FULL that the decoder does not itself restrict (the enums and
# platform names are Literals; job_id has the decoder's pattern), as (container path, key):
# the string is container[key], or the map key itself when key is None-prefixed with "key:".
NUL_SITES = [
    ("command", 0),
    ("command", 1),
    ("", "name"),
    ("env", "key:SEED"),
    ("env", "SEED"),
    ("requirements", "min_cuda_compute_capability"),
    ("requirements.frameworks", "key:torch"),
    ("requirements.frameworks", "torch"),
    ("requirements.framework_capabilities", 0),
    ("requirements", "python"),
    ("requirements", "driver"),
    ("gpu.apis_any", 0),
    ("variants.linux.gpu.apis_any", 0),
    ("distributed", "backend"),
    ("distributed", "launcher"),
    ("", "requires_core"),
]


@pytest.mark.parametrize(("where", "key"), NUL_SITES)
def test_nul_in_any_string_is_refused_naming_where(where: str, key: str | int) -> None:
    import copy

    assert validate_job(msgspec.convert(FULL, JobRequest)).errors == []
    doc = copy.deepcopy(FULL)
    node: Any = doc
    for part in filter(None, where.split(".")):
        node = node[part]
    if isinstance(key, str) and key.startswith("key:"):
        name = key[4:]
        node[name + "\x00"] = node.pop(name)
    else:
        node[key] += "\x00"
    errors = validate_job(msgspec.convert(doc, JobRequest)).errors
    field = (where.split(".")[-1] or str(key)) if isinstance(key, int) or where else str(key)
    # An env name with a NUL is refused as no variable name; everything else names the NUL.
    refused = ("NUL", "not a variable name")
    assert any(field in e and any(r in e for r in refused) for e in errors), (where, key, errors)
    assert not any("\x00" in e for e in errors), "an error message must not carry the NUL"


def test_nul_in_job_id_is_refused_by_the_decoder_and_by_validation() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(FULL | {"job_id": "j\x00"}, JobRequest)
    assert any(e.startswith("$.job_id:") for e in errors_of(make_job(job_id="j\x00")))


@given(st.text(min_size=0, max_size=30), st.integers(0, 30))
def test_no_string_with_nul_passes(text: str, at: int) -> None:
    poisoned = text[:at] + "\x00" + text[at:]
    for job in (
        make_job(name=poisoned),
        make_job(command=["run", poisoned]),
        make_job(env={"X": poisoned}),
        req(python=poisoned),
        dist(launcher=poisoned),
    ):
        errors = validate_job(job).errors
        assert any("NUL" in e for e in errors)
        assert all("\x00" not in e for e in errors)


def test_errors_are_capped_and_each_is_short() -> None:
    job = make_job(command=["x\x00" + "y" * 10_000] * 100)
    errors = validate_job(job).errors
    assert len(errors) == b.MAX_ERRORS + 1
    assert errors[-1] == "... and 81 more"  # 100 NUL errors and the argv total
    assert all(len(e) <= b.MAX_MESSAGE_CHARS for e in errors)


def test_protected_env_name_stays_readable_and_short() -> None:
    errors = validate_job(make_job(env={"GPULAYER_" + "X" * 5000: "1"})).errors
    assert any(e.startswith("$.env['GPULAYER_XXX") and "set by gpulayer" in e for e in errors)
    assert all(len(e) <= b.MAX_MESSAGE_CHARS for e in errors)


# --- The job's size against the server's max_payload ---


def largest_job(target: int) -> JobRequest:
    """A job that passes validation and encodes to exactly ``target`` bytes: arguments of
    control characters (1 byte for execve, 6 once JSON-escaped) fill it, a plain one pads it."""
    filler = "\x01" * 20_000  # 20_000 bytes raw, 120_002 encoded
    args = ["prog"]

    def build(pad: int) -> JobRequest:
        return make_job(
            job_id="j" * 128,
            command=[*args, "x" * pad],
            name="n" * b.MAX_NAME_BYTES,
            env={"LONG_" + "E" * 200: "\x02" * 10_000},
        )

    while len(msgspec.json.encode(build(0))) + 120_003 + 10 < target:
        args.append(filler)
    job = build(target - len(msgspec.json.encode(build(0))))
    assert len(msgspec.json.encode(job)) == target
    assert validate_job(job).errors == []
    return job


def largest_grant(job: JobRequest, accelerator: Any) -> Any:
    """``job`` in the largest envelope placement can produce: the longest grant id (job id and
    an int4 attempt), the longest node id, the most devices at the highest indices, the
    visibility variables listing them, a timestamp with microseconds and a UTC offset."""
    from datetime import datetime, timedelta, timezone

    from gpulayer_contracts.events import Grant
    from gpulayer_contracts.validation import visibility_env

    top = b.MAX_DEVICE_INDEX
    devices = list(range(top - b.MAX_DEVICES_PER_NODE + 1, top + 1))
    return Grant(
        grant_id=f"{job.job_id}-{b.INT32_MAX}",
        job=job,
        node_id="é" * (b.MAX_NODE_ID_BYTES // 2),
        accelerator=accelerator,
        devices=devices,
        visible_env=visibility_env(accelerator, devices, True),
        granted_at=datetime(
            9999, 12, 31, 23, 59, 59, 999_999, tzinfo=timezone(-timedelta(hours=23, minutes=59))
        ),
    )


@pytest.mark.parametrize("max_payload", [b.MIN_MAX_PAYLOAD, 1024 * 1024])
@pytest.mark.parametrize("accelerator", ["cuda", "rocm"])
def test_largest_allowed_job_in_the_largest_grant_fits_max_payload(
    max_payload: int, accelerator: str
) -> None:
    limit = b.max_job_bytes(max_payload)
    job = largest_job(limit)
    assert b.job_size_error(len(msgspec.json.encode(job)), max_payload) is None
    grant = msgspec.json.encode(largest_grant(job, accelerator))
    assert len(grant) - limit <= b.GRANT_ENVELOPE_BYTES
    assert len(grant) + b.HEADER_RESERVE_BYTES <= max_payload


@pytest.mark.parametrize("max_payload", [b.MIN_MAX_PAYLOAD, 1024 * 1024])
def test_one_byte_more_is_rejected_naming_the_size(max_payload: int) -> None:
    limit = b.max_job_bytes(max_payload)
    job = largest_job(limit + 1)
    error = b.job_size_error(len(msgspec.json.encode(job)), max_payload)
    assert error == (
        f"$: the job is {limit + 1} bytes encoded, over the limit of {limit} bytes "
        f"(the server's max_payload of {max_payload} bytes, less 40960 kept for the grant "
        "around the job)"
    )


def test_max_payload_below_the_minimum_is_a_deployment_error() -> None:
    with pytest.raises(ValueError, match="max_payload is 65536 bytes; gpulayer needs at least"):
        b.max_job_bytes(64 * 1024)
    assert b.max_job_bytes(1024 * 1024) == 1024 * 1024 - 40 * 1024


# --- Capabilities, heartbeats, executor status ---

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def caps(**fields: Any) -> WorkerCapabilities:
    base: dict[str, Any] = {"node_id": "n1", "agent_version": "0.1.0", "detected_at": NOW}
    base.update(fields)
    return WorkerCapabilities(**base)


def device(**fields: Any) -> AcceleratorDevice:
    base: dict[str, Any] = {"accelerator": "cuda", "index": 0, "execution_supported": True}
    base.update(fields)
    return AcceleratorDevice(**base)


CAPS_OUTSIDE_INSIDE: list[tuple[str, WorkerCapabilities, str, WorkerCapabilities]] = [
    (
        "device index 2^40",
        caps(accelerators=[device(index=2**40)]),
        "$.accelerators[0].index: 1099511627776 is out of range (0 <= x <= 65535)",
        caps(accelerators=[device(index=b.MAX_DEVICE_INDEX)]),
    ),
    (
        "negative device index",
        caps(accelerators=[device(index=-1)]),
        "$.accelerators[0].index: -1 is out of range (0 <= x <= 65535)",
        caps(accelerators=[device(index=0)]),
    ),
    (
        "device memory",
        caps(accelerators=[device(memory_mib=b.MAX_DEVICE_MEMORY_MIB + 1)]),
        "$.accelerators[0].memory_mib: 67108865 is out of range (0 <= x <= 67108864)",
        caps(accelerators=[device(memory_mib=b.MAX_DEVICE_MEMORY_MIB)]),
    ),
    (
        "device count",
        caps(accelerators=[device(index=i) for i in range(b.MAX_DEVICES_PER_NODE + 1)]),
        "$.accelerators: 1025 entries, over the limit of 1024",
        caps(accelerators=[device(index=i) for i in range(b.MAX_DEVICES_PER_NODE)]),
    ),
    (
        "compute capability",
        caps(accelerators=[device(compute_capability="100.0")]),
        "$.accelerators[0].compute_capability: '100.0' is out of range",
        caps(accelerators=[device(compute_capability="99.0")]),
    ),
    (
        "device name NUL",
        caps(accelerators=[device(name="H100\x00")]),
        "$.accelerators[0].name: contains a NUL character (\\x00)",
        caps(accelerators=[device(name="H100")]),
    ),
    (
        "device notes",
        caps(accelerators=[device(notes=["n"] * (b.MAX_NOTES + 1))]),
        "$.accelerators[0].notes: 257 entries, over the limit of 256",
        caps(accelerators=[device(notes=["n"] * b.MAX_NOTES)]),
    ),
    (
        "cores",
        caps(host=HostInfo(cpu_cores=b.MAX_CPU_CORES + 1)),
        "$.host.cpu_cores: 65537 is out of range (0 <= x <= 65536)",
        caps(host=HostInfo(cpu_cores=b.MAX_CPU_CORES)),
    ),
    (
        "RAM",
        caps(host=HostInfo(memory_bytes=b.MAX_HOST_BYTES + 1)),
        "$.host.memory_bytes: 1152921504606846977 is out of range (0 <= x <= 1152921504606846976)",
        caps(host=HostInfo(memory_bytes=b.MAX_HOST_BYTES)),
    ),
    (
        "disk",
        caps(host=HostInfo(disk_free_bytes=-1)),
        "$.host.disk_free_bytes: -1 is out of range",
        caps(host=HostInfo(disk_free_bytes=0)),
    ),
    (
        "host string",
        caps(host=HostInfo(hostname="h" * (b.MAX_SHORT_TEXT_BYTES + 1))),
        "$.host.hostname: 257 bytes, over the limit of 256 bytes",
        caps(host=HostInfo(hostname="h" * b.MAX_SHORT_TEXT_BYTES)),
    ),
    (
        "notes count",
        caps(notes=["n"] * (b.MAX_NOTES + 1)),
        "$.notes: 257 entries, over the limit of 256",
        caps(notes=["n"] * b.MAX_NOTES),
    ),
    (
        "note size",
        caps(notes=["n" * (b.MAX_NOTE_BYTES + 1)]),
        "$.notes[0]: 1025 bytes, over the limit of 1024 bytes",
        caps(notes=["n" * b.MAX_NOTE_BYTES]),
    ),
    (
        "frameworks count",
        caps(frameworks={f"f{i}": "1" for i in range(b.MAX_CAP_FRAMEWORKS + 1)}),
        "$.frameworks: 1025 entries, over the limit of 1024",
        caps(frameworks={f"f{i}": "1" for i in range(b.MAX_CAP_FRAMEWORKS)}),
    ),
    (
        "framework version NUL",
        caps(frameworks={"torch": "2.5\x00"}),
        "$.frameworks.torch: contains a NUL character (\\x00)",
        caps(frameworks={"torch": "2.5"}),
    ),
    (
        "api evidence",
        caps(gpu_apis=GpuApis(host=["vulkan"], evidence={"vulkan": "e" * 1025})),
        "$.gpu_apis.evidence.vulkan: 1025 bytes, over the limit of 1024 bytes",
        caps(gpu_apis=GpuApis(host=["vulkan"], evidence={"vulkan": "e" * 1024})),
    ),
    (
        "workload python path",
        caps(workload_python="/" * (b.MAX_PATH_BYTES + 1)),
        "$.workload_python: 4097 bytes, over the limit of 4096 bytes",
        caps(workload_python="/" * b.MAX_PATH_BYTES),
    ),
    (
        "launchers",
        caps(launchers=["torchrun"] * (b.MAX_LIST_ITEMS + 1)),
        "$.launchers: 65 entries, over the limit of 64",
        caps(launchers=["torchrun"] * b.MAX_LIST_ITEMS),
    ),
    (
        "node id length",
        caps(node_id="n" * (b.MAX_NODE_ID_BYTES + 1)),
        "$.node_id: 129 bytes, over the limit of 128 bytes",
        caps(node_id="n" * b.MAX_NODE_ID_BYTES),
    ),
    (
        "node id with a dot",
        caps(node_id="a.b"),
        "$.node_id: 'a.b' is not a subject token",
        caps(node_id="a-b"),
    ),
    (
        "node id with a control character",
        caps(node_id="a\x01"),
        "$.node_id: 'a\\x01' is not a subject token",
        caps(node_id="a_1"),
    ),
]


@pytest.mark.parametrize(
    ("outside", "expected", "inside"),
    [pytest.param(o, e, i, id=name) for name, o, e, i in CAPS_OUTSIDE_INSIDE],
)
def test_capability_bound_is_named_and_just_inside_passes(
    outside: WorkerCapabilities, expected: str, inside: WorkerCapabilities
) -> None:
    errors = b.validate_capabilities(outside)
    assert any(expected in e for e in errors), errors
    assert b.validate_capabilities(inside) == []


def status(**fields: Any) -> JobStatus:
    base: dict[str, Any] = {"job_id": "j1", "grant_id": "j1-1", "node_id": "n1", "state": "failed"}
    base.update(fields)
    return JobStatus(**base)


@pytest.mark.parametrize(
    ("outside", "expected", "inside"),
    [
        (
            status(exit_code=2**31),
            "$.exit_code: 2147483648 is out of range (-2147483648 <= x <= 2147483647)",
            status(exit_code=2**31 - 1),
        ),
        (
            status(exit_code=-(2**31) - 1),
            "$.exit_code: -2147483649 is out of range",
            status(exit_code=-(2**31)),
        ),
        (status(pid=2**31), "$.pid: 2147483648 is out of range", status(pid=4_194_304)),
        (status(signal=2**40), "$.signal: 1099511627776 is out of range", status(signal=9)),
        (
            status(reason="r" * (b.MAX_REASON_BYTES + 1)),
            "$.reason: 4097 bytes, over the limit of 4096 bytes",
            status(reason="r" * b.MAX_REASON_BYTES),
        ),
        (
            status(reason="boom\x00"),
            "$.reason: contains a NUL character (\\x00)",
            status(reason="boom"),
        ),
        (status(job_id="j\n"), "$.job_id: 'j\\n' is not a job id", status(job_id="j")),
        (
            status(grant_id="g\x00"),
            "$.grant_id: contains a NUL character (\\x00)",
            status(grant_id="g"),
        ),
        (status(node_id="n*"), "$.node_id: 'n*' is not a subject token", status(node_id="n")),
    ],
)
def test_job_status_bounds(outside: JobStatus, expected: str, inside: JobStatus) -> None:
    errors = b.validate_job_status(outside)
    assert any(expected in e for e in errors), errors
    assert b.validate_job_status(inside) == []


def test_heartbeat_bounds() -> None:
    good = Heartbeat(node_id="n1", sent_at=NOW, agent_version="0.1.0")
    assert b.validate_heartbeat(good) == []
    bad = Heartbeat(node_id="", sent_at=NOW, source="s\x00", agent_version="v" * 300)
    assert b.validate_heartbeat(bad) == [
        "$.node_id: empty",
        "$.source: contains a NUL character (\\x00)",
        "$.agent_version: 300 bytes, over the limit of 256 bytes",
    ]
    executor = Heartbeat(
        node_id="n1",
        sent_at=NOW,
        source="executor",
        slots=b.MAX_EXECUTOR_SLOTS,
        reserved_cores=0.0,
        reserved_memory_gb=1.5,
        enforcement="cgroup v1: memory cpu pids devices",
    )
    assert b.validate_heartbeat(executor) == []
    worst = msgspec.structs.replace(
        executor,
        slots=-1,
        reserved_cores=math.nan,
        reserved_memory_gb=math.inf,
        enforcement="x\x00",
    )
    assert b.validate_heartbeat(worst) == [
        "$.slots: -1 is out of range (0 <= x <= 65536)",
        "$.reserved_cores: nan is out of range (0 <= x <= 65536)",
        "$.reserved_memory_gb: inf is out of range (0 <= x <= 1000000000)",
        "$.enforcement: contains a NUL character (\\x00)",
    ]


# --- No job that passes validation breaks the matcher, against a fleet at the bounds ---


def _fleet() -> list[NodeView]:
    extreme = [
        device(
            index=b.MAX_DEVICE_INDEX - i,
            memory_mib=b.MAX_DEVICE_MEMORY_MIB - i,
            compute_capability="99.99",
            memory_kind="dedicated",
        )
        for i in range(4)
    ]
    small = [device(index=i, memory_mib=0, compute_capability="0.0") for i in range(2)]
    unknown = [device(index=0)]
    nodes = [
        caps(node_id="big", accelerators=extreme, host=HostInfo(platform="linux-x86_64")),
        caps(node_id="small", accelerators=small),
        caps(node_id="unknown", accelerators=unknown),
        caps(node_id="cpu"),
    ]
    for c in nodes:
        assert b.validate_capabilities(c) == []
    return [NodeView(node_id=c.node_id, capabilities=c) for c in nodes]


FLEET = _fleet()
_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-300, 65536.0, 65536.0001, 1e308, 2.0**64]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # Mostly values near and inside the bounds, so that many jobs pass validation.
    gb=st.one_of(st.none(), st.floats(1e-300, 65536.0), _numbers),
    count=st.one_of(st.integers(0, 8), st.integers(1000, 1030), st.integers(0, 2**70)),
    cc=st.one_of(
        st.none(),
        st.from_regex(r"\A[0-9]{1,2}(\.[0-9]{1,2})?\Z"),
        st.from_regex(r"\A[0-9]{1,30}(\.[0-9]{1,30})?\Z"),
        _numbers,
    ),
    acc=st.sampled_from([None, "cuda", "cuda", "mps"]),
    timeout=st.one_of(st.none(), st.floats(0.001, b.MAX_TIMEOUT_S), _numbers),
)
def test_no_validated_job_breaks_the_matcher(
    gb: float | None, count: int, cc: float | str | None, acc: Any, timeout: float | None
) -> None:
    job = make_job(
        timeout_s=timeout,
        requirements=Requirements(
            accelerator=acc, gpu_count=count, gpu_memory_gb=gb, min_cuda_compute_capability=cc
        ),
    )
    if validate_job(job).errors:
        event("refused")
        return
    event("validated")
    assert gb is None or (0 < gb <= b.MAX_GPU_MEMORY_GB)
    assert count <= b.MAX_GPU_COUNT
    decision = match(job, FLEET)  # must not raise (OverflowError, ValueError, ...)
    explain(job, FLEET)
    if isinstance(decision, Placement):
        assert len(decision.devices) <= b.MAX_DEVICES_PER_NODE


@pytest.mark.parametrize(
    "requirements",
    [
        Requirements(accelerator="cuda", gpu_count=b.MAX_GPU_COUNT, gpu_memory_gb=65536.0),
        Requirements(gpu_count=4, gpu_memory_gb=65536.0, min_cuda_compute_capability="99.99"),
        Requirements(gpu_count=1, gpu_memory_gb=1e-300, min_cuda_compute_capability=0.0),
    ],
)
def test_jobs_at_the_bounds_match_without_error(requirements: Requirements) -> None:
    job = make_job(requirements=requirements)
    assert validate_job(job).errors == []
    match(job, FLEET)
    explain(job, FLEET)


def test_the_largest_request_fits_the_largest_device() -> None:
    job = make_job(requirements=Requirements(accelerator="cuda", gpu_memory_gb=65536.0))
    decision = match(job, FLEET)
    assert isinstance(decision, Placement)
    assert decision.node_id == "big"


# --- Reading a job id from anything ---

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(b'{"job_id": "ok-1", "command": 5}', "ok-1", id="object, rest invalid"),
        pytest.param(b'{"job_id": "ok-1", "x": ' + DEEP + b"}", "ok-1", id="deep nesting after"),
        pytest.param(b'{"x": ' + DEEP + b', "job_id": "ok-1"}', "ok-1", id="deep nesting before"),
        pytest.param(DEEP, None, id="deep array"),
        pytest.param(b"{" * 100_000, None, id="deep unclosed"),
        pytest.param(b'{"a":' * 100_000 + b'"job_id": "x"', "x", id="deep objects, broken"),
        pytest.param(b'{"job_id": "ok-1", "timeout_s": NaN}', "ok-1", id="NaN"),
        pytest.param(b'{"job_id": "ok-1", "name": "\xff\xfe"}', "ok-1", id="invalid UTF-8"),
        pytest.param(b'{"job_id": "ok-1", "command": ["x"', "ok-1", id="truncated"),
        pytest.param(b'{\n  "job_id"  :\t"ok-1" ,,}', "ok-1", id="broken, whitespace"),
        pytest.param(b'[{"job_id": "ok-1"}]', "ok-1", id="array holding the id"),
        pytest.param(b"not json", None, id="not JSON"),
        pytest.param(b"", None, id="empty"),
        pytest.param(b"[]", None, id="array"),
        pytest.param(b'{"job_id": 42}', None, id="integer id"),
        pytest.param(b'{"job_id": 42, "x": NaN}', None, id="integer id, broken"),
        pytest.param(b'{"job_id": "a\\u0000b"}', None, id="NUL in id"),
        pytest.param(b'{"job_id": "a\\u0000b", "x": NaN}', None, id="NUL in id, broken"),
        pytest.param(b'{"job_id": "a\\n"}', None, id="newline in id"),
        pytest.param(b'{"job_id": "a.b"}', None, id="dot in id"),
        pytest.param(b'{"job_id": "' + b"a" * 129 + b'"}', None, id="id too long"),
        pytest.param(b'{"job_id": "' + b"a" * 129 + b'", x}', None, id="id too long, broken"),
        pytest.param(b'{"job_id": "' + b"a" * 128 + b'", x}', "a" * 128, id="longest id, broken"),
        pytest.param(b'{"env": {"X": "\\"job_id\\": \\"v\\""}, x}', None, id="id inside a string"),
        pytest.param(b'{"job_id": "\\u0061"}', "a", id="escaped id, valid JSON"),
        pytest.param(b" " * (1 << 20) + b'{"job_id": "late", x', None, id="id past the scan"),
        pytest.param(b'{"job_id": "big", "x": "' + b"y" * 20_000_000 + b'"', "big", id="20 MB"),
    ],
)
def test_best_effort_job_id_never_fails(data: bytes, expected: str | None) -> None:
    assert best_effort_job_id(data) == expected


@given(st.binary(max_size=512))
def test_best_effort_job_id_never_raises_on_any_bytes(data: bytes) -> None:
    result = best_effort_job_id(data)
    assert result is None or re.fullmatch(r"[A-Za-z0-9_-]{1,128}", result)


def test_msgspec_itself_raises_recursion_error_on_deep_nesting() -> None:
    # Why decode_message exists: a Wire decoder skipping an unknown field recurses, and the
    # error is not a DecodeError.
    data = b'{"node_id": "n", "agent_version": "1", "detected_at": "2025-01-01T00:00:00Z", "x": '
    with pytest.raises(RecursionError):
        capabilities_decoder.decode(data + DEEP + b"}")
    with pytest.raises(InvalidInput, match="nested too deeply"):
        decode_message(capabilities_decoder, data + DEEP + b"}")
    with pytest.raises(InvalidInput, match="not valid JSON"):
        decode_message(status_decoder, b"\xff")


def test_a_job_id_with_a_trailing_newline_is_refused_at_decoding() -> None:
    # msgspec checks a pattern with re.search, where $ matches before a final newline.
    with pytest.raises(InvalidInput, match=r"^\$\.job_id: Expected `str` matching regex"):
        decode_job_json(b'{"job_id": "a\\n", "command": ["x"]}')
    with pytest.raises(InvalidInput, match=r"^\$\.job_id: Expected `str` matching regex"):
        decode_job_toml('job_id = "a\\n"\ncommand = ["x"]\n')


def test_decode_errors_are_printable_and_short() -> None:
    with pytest.raises(InvalidInput) as err:
        decode_job_json(b'{"job_id": "a", "command": ["x"], "a\\u0000' + b"b" * 100_000 + b'": 1}')
    text = str(err.value)
    assert text.startswith("$: Object contains unknown field `a\\x00bbb")
    assert "\x00" not in text
    assert len(text) <= b.MAX_MESSAGE_CHARS


# --- Every event fits ---

_texts_st = st.lists(
    st.one_of(st.text(max_size=50), st.just("\x01" * 10_000), st.just("é" * 30_000)),
    max_size=60,
)


@settings(max_examples=30, deadline=None)
@given(reasons=_texts_st, summary=st.one_of(st.text(), st.just("\x02" * 100_000)))
def test_bound_event_keeps_every_event_under_the_limit(reasons: list[str], summary: str) -> None:
    for ev in (
        Pending(job_id="j" * 128, summary=summary, reasons=reasons),
        Rejected(job_id="j" * 128, reasons=reasons),
        Accepted(job_id="j" * 128, warnings=reasons),
        Failed(job_id="j" * 128, node_id="n" * 128, reason=summary, exit_code=-(2**31)),
    ):
        bounded = b.bound_event(ev)
        assert type(bounded) is type(ev)
        assert len(msgspec.json.encode(bounded)) <= b.MAX_EVENT_BYTES
        if len(msgspec.json.encode(ev)) <= b.MAX_EVENT_BYTES:
            assert bounded == ev


def test_bound_event_says_how_many_lines_it_dropped() -> None:
    event = Rejected(job_id="j", reasons=["\x01" * 1000] * 100)
    bounded = b.bound_event(event)
    assert len(msgspec.json.encode(bounded)) <= b.MAX_EVENT_BYTES
    last = bounded.reasons[-1]
    assert last == f"... and {100 - (len(bounded.reasons) - 1)} more"
    assert all(r == "\x01" * 497 + "..." for r in bounded.reasons[:-1])


def test_events_fit_below_the_smallest_max_payload() -> None:
    assert b.MAX_EVENT_BYTES + b.HEADER_RESERVE_BYTES <= b.MIN_MAX_PAYLOAD


def test_operations_lists_every_bound_with_its_value() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs/operations.md").read_text()
    section = text.split("## Bounds", 1)[1].split("\n## ", 1)[0]
    for name, value in vars(b).items():
        if not name.isupper() or not isinstance(value, int | str):
            continue
        if name in {"KIB", "INT32_MIN", "INT32_MAX"}:
            continue
        assert f"`{name}`" in section, f"docs/operations.md (Bounds) does not name {name}"
        if isinstance(value, int):
            assert str(value) in section, f"docs/operations.md (Bounds): {name} = {value} missing"
        elif isinstance(value, str):
            assert value in section, f"docs/operations.md (Bounds): {name} = {value} missing"


def test_integers_of_any_size_are_refused_without_overflow() -> None:
    errors = errors_of(req(gpu_count=10**5000))
    assert (
        "$.requirements.gpu_count: an integer of 16610 bits is out of range (0 <= x <= 1024)"
        in (errors)
    )
    assert b.validate_capabilities(caps(accelerators=[device(index=-(10**400))])) != []


def test_lone_surrogate_is_refused() -> None:
    # Not from JSON (msgspec refuses it), but possible from Python; it can't be encoded.
    assert errors_of(make_job(name="a\ud800")) == [
        "$.name: contains a lone surrogate (not valid Unicode)"
    ]


# Strings near each limit: short, at it, over it, with NUL, non-ASCII, a lone surrogate.
def _near(limit: int) -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(max_size=8),
        st.sampled_from(["", "a" * limit, "a" * (limit + 1), "é" * (limit // 2 + 1)]),
        st.sampled_from(["x\x00y", "\ud800", "A=B", "ÿ" * 3]),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=_near(b.MAX_NAME_BYTES),
    command=st.lists(_near(64), min_size=1, max_size=4),
    env=st.dictionaries(
        st.one_of(st.from_regex(r"\A[A-Z_]{1,8}\Z"), _near(b.MAX_ENV_NAME_BYTES)),
        _near(b.MAX_ENV_VALUE_BYTES),
        max_size=3,
    ),
    frameworks=st.dictionaries(
        _near(b.MAX_SHORT_TEXT_BYTES), _near(b.MAX_SHORT_TEXT_BYTES), max_size=2
    ),
    apis=st.lists(_near(b.MAX_SHORT_TEXT_BYTES), max_size=3),
    count=st.sampled_from([0, 1, b.MAX_GPU_COUNT, b.MAX_GPU_COUNT + 1, -1]),
    gb=st.one_of(st.none(), _numbers),
    timeout=st.one_of(st.none(), _numbers),
    python=st.one_of(st.none(), _near(b.MAX_SHORT_TEXT_BYTES)),
    driver=st.one_of(st.none(), _near(b.MAX_SHORT_TEXT_BYTES)),
    profile=st.one_of(
        st.none(), st.sampled_from(["p@1", "p" * 64 + "@1", "p" * 65 + "@1", "p@1\n", "p\x00@1"])
    ),
    profile_fields=st.lists(_near(b.MAX_SHORT_TEXT_BYTES), max_size=3),
    cores=_numbers,
    memory=_numbers,
    priority=st.sampled_from([0, -5, b.MAX_PRIORITY, b.MAX_PRIORITY + 1, -b.MAX_PRIORITY - 1]),
)
def test_the_fast_check_agrees_with_the_detailed_one(
    name: str,
    command: list[str],
    env: dict[str, str],
    frameworks: dict[str, str],
    apis: list[str],
    count: int,
    gb: float | None,
    timeout: float | None,
    python: str | None,
    driver: str | None,
    profile: str | None,
    profile_fields: list[str],
    cores: float,
    memory: float,
    priority: int,
) -> None:
    job = make_job(
        priority=priority,
        name=name,
        command=command,
        env=env,
        timeout_s=timeout,
        gpu=GpuUsage(use="shared", apis_any=apis),
        profile=profile,
        profile_fields=profile_fields,
        requirements=Requirements(
            driver=driver,
            gpu_count=count,
            gpu_memory_gb=gb,
            frameworks=frameworks,
            python=python,
            cpu_cores=cores,
            memory_gb=memory,
        ),
    )
    detailed = list(bounds_jobs._job_bounds(job))
    event("within bounds" if not detailed else "out of bounds")
    assert bounds_jobs._within_bounds(job) == (not detailed), detailed


_cap_text = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["", "x\x00", "\ud800", "é" * 200, "a" * 256, "a" * 257, "a" * 1025]),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    agent=_cap_text,
    hostname=st.one_of(st.none(), _cap_text),
    cores=st.one_of(st.none(), st.sampled_from([0, 1, b.MAX_CPU_CORES, b.MAX_CPU_CORES + 1, -1])),
    index=st.sampled_from([0, b.MAX_DEVICE_INDEX, b.MAX_DEVICE_INDEX + 1, -1, 2**40]),
    memory=st.one_of(st.none(), st.sampled_from([0, b.MAX_DEVICE_MEMORY_MIB + 1])),
    name=st.one_of(st.none(), _cap_text),
    cc=st.one_of(st.none(), st.sampled_from(["8.6", "99.99", "100.0", "x", 9.0, float("inf")])),
    dev_notes=st.lists(_cap_text, max_size=3),
    notes=st.lists(_cap_text, max_size=3),
    frameworks=st.dictionaries(_cap_text, _cap_text, max_size=2),
    evidence=st.dictionaries(_cap_text, _cap_text, max_size=2),
    launchers=st.lists(_cap_text, max_size=3),
    python=st.one_of(st.none(), _cap_text),
)
def test_the_fast_capabilities_check_agrees_with_the_detailed_one(
    agent: str,
    hostname: str | None,
    cores: int | None,
    index: int,
    memory: int | None,
    name: str | None,
    cc: float | str | None,
    dev_notes: list[str],
    notes: list[str],
    frameworks: dict[str, str],
    evidence: dict[str, str],
    launchers: list[str],
    python: str | None,
) -> None:
    report = caps(
        agent_version=agent,
        host=HostInfo(hostname=hostname, cpu_cores=cores),
        accelerators=[
            device(
                index=index, memory_mib=memory, name=name, compute_capability=cc, notes=dev_notes
            )
        ],
        notes=notes,
        frameworks=frameworks,
        gpu_apis=GpuApis(evidence=evidence),
        launchers=launchers,
        workload_python=python,
    )
    detailed = list(bounds_nodes._capabilities(report))
    event("within bounds" if not detailed else "out of bounds")
    assert bounds_nodes._capabilities_within_bounds(report) == (not detailed), detailed


# --- Device observations (issue 17) ---

_edge_int = st.sampled_from([None, 0, 1, -1, 101, 1001, -274, 2**53, 2**53 + 1, 2**64, 2**70])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    index=st.sampled_from([0, b.MAX_DEVICE_INDEX, b.MAX_DEVICE_INDEX + 1, -1]),
    uuid=st.one_of(st.none(), _cap_text),
    used=_edge_int,
    util=_edge_int,
    temp=_edge_int,
    power=st.one_of(st.none(), st.sampled_from([0.0, 91.5, float("nan"), float("inf"), -1.0, 1e6])),
    throttle=_edge_int,
    ecc=_edge_int,
    reason=st.one_of(st.none(), _cap_text),
    notes=st.lists(_cap_text, max_size=3),
    mig_parent=st.one_of(st.none(), st.sampled_from([0, b.MAX_DEVICE_INDEX + 1])),
    mig_profile=st.one_of(st.none(), _cap_text),
)
def test_the_fast_observations_check_agrees_with_the_detailed_one(
    index: int,
    uuid: str | None,
    used: int | None,
    util: int | None,
    temp: int | None,
    power: float | None,
    throttle: int | None,
    ecc: int | None,
    reason: str | None,
    notes: list[str],
    mig_parent: int | None,
    mig_profile: str | None,
) -> None:
    from datetime import UTC, datetime

    from gpulayer_contracts.health import DeviceObservation, NodeObservations

    obs = NodeObservations(
        node_id="n",
        observed_at=datetime.now(UTC),
        devices=[
            DeviceObservation(
                index=index,
                uuid=uuid,
                memory_used_mib=used,
                utilization_pct=util,
                temperature_c=temp,
                power_w=power,
                throttle_reasons=throttle,
                ecc_uncorrected_aggregate=ecc,
                reason=reason,
            )
        ],
        notes=notes,
    )
    detailed = list(bounds_nodes._observations(obs))
    event("within bounds" if not detailed else "out of bounds")
    assert bounds_nodes._observations_within_bounds(obs) == (not detailed), detailed
    # The MIG fields of capabilities, through the capabilities check.
    report = caps(accelerators=[device(index=0, mig_parent=mig_parent, mig_profile=mig_profile)])
    assert bounds_nodes._capabilities_within_bounds(report) == (
        not list(bounds_nodes._capabilities(report))
    )
