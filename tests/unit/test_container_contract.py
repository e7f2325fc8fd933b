"""The container field of a job: references a runtime accepts pass, anything else is refused
naming $.container.image, and a worst-case reference is checked in linear time."""

from __future__ import annotations

import msgspec
import pytest

from gpulayer_contracts.bounds import MAX_IMAGE_REF_BYTES
from gpulayer_contracts.codec import InvalidInput, decode_job_json
from gpulayer_contracts.jobs import Container, JobRequest
from gpulayer_contracts.validation import validate_job


def _errors(image: str) -> list[str]:
    job = JobRequest(job_id="j", command=["true"], container=Container(image=image))
    return list(validate_job(job).errors)


@pytest.mark.parametrize(
    "image",
    [
        "busybox",
        "localhost/train:1",
        "docker.io/library/ubuntu:22.04",
        "registry.example:5000/org/team/img:v1.2",
        "nvcr.io/nvidia/pytorch:24.05-py3",
        "img@sha256:" + "0123456789abcdef" * 4,
        "[::1]:5000/img:latest",
    ],
)
def test_a_reference_a_runtime_accepts_passes(image: str) -> None:
    assert _errors(image) == []


@pytest.mark.parametrize(
    "image",
    ["", "-v", "--privileged", "img:", "a//b", "img:tag:more", "a\x00b", "a b", "img@sha256:xyz"],
)
def test_anything_else_is_refused_naming_the_field(image: str) -> None:
    errors = _errors(image)
    assert len(errors) == 1
    assert errors[0].startswith("$.container.image: ")
    assert "not an image reference" in errors[0]


def test_an_oversized_reference_names_its_length() -> None:
    errors = _errors("a" * (MAX_IMAGE_REF_BYTES + 1))
    assert errors == [
        f"$.container.image: {MAX_IMAGE_REF_BYTES + 1} characters, over the limit of "
        f"{MAX_IMAGE_REF_BYTES}"
    ]


def test_a_submitted_container_is_decoded_with_its_pull_default() -> None:
    job = decode_job_json(b'{"job_id": "j", "command": ["true"], "container": {"image": "x"}}')
    assert job.container == Container(image="x", pull="missing")


def test_an_unknown_pull_policy_or_field_is_an_error_naming_it() -> None:
    with pytest.raises((InvalidInput, msgspec.ValidationError), match=r"container\.pull"):
        decode_job_json(
            b'{"job_id": "j", "command": ["true"], "container": {"image": "x", "pull": "sometimes"}}'
        )
    with pytest.raises((InvalidInput, msgspec.ValidationError), match=r"container\.tag"):
        decode_job_json(
            b'{"job_id": "j", "command": ["true"], "container": {"image": "x", "tag": "1"}}'
        )
