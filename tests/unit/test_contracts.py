"""Contracts: strict decoding with named paths, validation rules, event round trips."""

from __future__ import annotations

import json

import pytest

from gpulayer_contracts import (
    InvalidInput,
    Placed,
    decode_job_json,
    decode_job_toml,
    encode,
    job_schema,
    validate_job,
)
from gpulayer_contracts.codec import best_effort_job_id, event_decoder
from gpulayer_contracts.validation import parse_compute_capability, visibility_env


def job(**fields: object) -> bytes:
    base: dict[str, object] = {"job_id": "j1", "command": ["true"]}
    base.update(fields)
    return json.dumps(base).encode()


def test_unknown_field_is_named_with_its_path() -> None:
    with pytest.raises(InvalidInput, match=r"^\$\.requirements\.gpu_cont: unknown field$"):
        decode_job_json(job(requirements={"gpu_cont": 1}))


def test_missing_command_is_named() -> None:
    with pytest.raises(InvalidInput, match=r"^\$\.command: required field missing$"):
        decode_job_json(b'{"job_id": "j1"}')


def test_mistyped_field_names_path_and_type() -> None:
    with pytest.raises(InvalidInput, match=r"^\$\.requirements\.gpu_count: Expected `int`"):
        decode_job_json(job(requirements={"gpu_count": "two"}))


def test_negative_gpu_count_rejected() -> None:
    with pytest.raises(InvalidInput, match=r"gpu_count: Expected `int` >= 0"):
        decode_job_json(job(requirements={"gpu_count": -1}))


def test_timeout_must_be_positive() -> None:
    with pytest.raises(InvalidInput, match=r"^\$\.timeout_s: Expected `float` > 0"):
        decode_job_json(job(timeout_s=0))


def test_unknown_accelerator_rejected() -> None:
    with pytest.raises(InvalidInput, match=r"accelerator: Invalid enum value 'tpu'"):
        decode_job_json(job(requirements={"accelerator": "tpu"}))


def test_job_id_must_be_a_subject_token() -> None:
    with pytest.raises(InvalidInput, match=r"^\$\.job_id: Expected `str` matching"):
        decode_job_json(job(job_id="a.b"))


def test_garbage_is_not_json() -> None:
    with pytest.raises(InvalidInput, match=r"^not valid JSON"):
        decode_job_json(b"\x00garbage")


def test_toml_job_file_decodes_strictly() -> None:
    text = 'job_id = "t1"\ncommand = ["echo", "hi"]\n[requirements]\naccelerator = "cpu"\n'
    assert decode_job_toml(text).requirements.accelerator == "cpu"
    with pytest.raises(InvalidInput, match=r"\$\.requirements\.acclerator: unknown field"):
        decode_job_toml(text.replace("accelerator", "acclerator"))


def test_best_effort_job_id() -> None:
    assert best_effort_job_id(b'{"job_id": "ok-1", "command": 5}') == "ok-1"
    assert best_effort_job_id(b'{"job_id": "bad id"}') is None
    assert best_effort_job_id(b"nope") is None


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"env": {"LD_PRELOAD": "/x.so"}}, "$.env.LD_PRELOAD"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "$.env.CUDA_VISIBLE_DEVICES"),
        ({"requirements": {"python": ">=3.11,<<4"}}, "$.requirements.python"),
        ({"requirements": {"frameworks": {"torch": "two"}}}, "$.requirements.frameworks.torch"),
        ({"requires_core": ">=99"}, "$.requires_core: gpulayer"),
        ({"gpu": {"apis_any": ["vulkan"]}}, "$.gpu.apis_any: needs gpu.use"),
        (
            {"requirements": {"accelerator": "mps"}, "distributed": {"nodes": 2}},
            "$.distributed: mps",
        ),
        ({"requirements": {"accelerator": "rocm"}}, "rocm is detection-only"),
        ({"requirements": {"accelerator": "cpu", "gpu_count": 1}}, "$.requirements.gpu_count"),
        (
            {"requirements": {"accelerator": "cpu", "gpu_memory_gb": 8}},
            "$.requirements.gpu_memory_gb",
        ),
        (
            {
                "requirements": {"accelerator": "cpu"},
                "gpu": {"use": "shared", "apis_any": ["vulkan"]},
            },
            "$.gpu.apis_any: a cpu job",
        ),
        (
            {"requirements": {"gpu_count": 2}, "gpu": {"use": "none"}},
            '$.gpu.use: "none" contradicts',
        ),
    ],
)
def test_validation_rejects_with_the_field_named(fields: dict[str, object], error: str) -> None:
    result = validate_job(decode_job_json(job(**fields)))
    assert not result.ok
    assert any(e.startswith(error) or error in e for e in result.errors), result.errors


def test_per_device_requirement_without_devices_warns() -> None:
    result = validate_job(decode_job_json(job(requirements={"gpu_memory_gb": 40})))
    assert result.ok
    assert "gpu_memory_gb apply per device" in result.warnings[0]


def test_unknown_api_is_a_warning_not_an_error() -> None:
    result = validate_job(decode_job_json(job(gpu={"use": "shared", "apis_any": ["webgpu"]})))
    assert result.ok
    assert any("webgpu" in w for w in result.warnings), result.warnings


def test_valid_cuda_job_passes() -> None:
    j = decode_job_json(
        job(
            requirements={
                "accelerator": "cuda",
                "gpu_count": 2,
                "min_cuda_compute_capability": 8.0,
                "frameworks": {"torch": ">=2.1"},
                "python": ">=3.10",
            },
            requires_core=">=0.1",
        )
    )
    assert validate_job(j).ok


@pytest.mark.parametrize(
    ("value", "expected"),
    [(8.6, (8, 6)), ("8.0", (8, 0)), ("10.0", (10, 0)), (9, (9, 0)), ("12.1", (12, 1))],
)
def test_compute_capability_is_numeric(value: float | str, expected: tuple[int, int]) -> None:
    assert parse_compute_capability(value) == expected


def test_compute_capability_ordering() -> None:
    assert parse_compute_capability("10.0") > parse_compute_capability("9.0")  # type: ignore[operator]
    assert parse_compute_capability(8.6) >= parse_compute_capability(8.0)  # type: ignore[operator]


def test_visibility_env() -> None:
    assert visibility_env("cpu", [], gpu_granted=True)["CUDA_VISIBLE_DEVICES"] == ""
    cuda = visibility_env("cuda", [2, 5], gpu_granted=True)
    assert cuda["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert cuda["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert visibility_env("cuda", [2, 5], gpu_granted=False)["CUDA_VISIBLE_DEVICES"] == ""


def test_events_round_trip_with_type_tag() -> None:
    raw = encode(Placed(job_id="j", node_id="n", accelerator="cuda", devices=[1]))
    assert json.loads(raw)["type"] == "placed"
    ev = event_decoder.decode(raw)
    assert isinstance(ev, Placed)
    assert ev.devices == [1]


def test_schema_names_job_fields() -> None:
    schema = job_schema()
    props = schema["$defs"]["JobRequest"]["properties"]
    assert {"job_id", "command", "requirements", "gpu", "variants", "sandbox"} <= set(props)
