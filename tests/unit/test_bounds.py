"""Hard bounds (gpulayer_contracts.bounds): each one named in the error with its limit, a value
just inside accepted, no validated job able to break the matcher."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulayer_contracts import bounds as b
from gpulayer_contracts.jobs import (
    Distributed,
    GpuUsage,
    JobRequest,
    Requirements,
    Variant,
)
from gpulayer_contracts.validation import validate_job


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
        "min_cuda_compute_capability": "8.0",
        "frameworks": {"torch": ">=2"},
        "framework_capabilities": ["torch.cuda"],
        "python": ">=3.10",
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
