"""Runtime profiles: the profiles file, a job's profile expanded into its requirements,
conflicts, unknown profiles and versions, and the worst values."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from gpulayer_contracts import InvalidInput, JobRequest, Requirements, decode_job_json, validate_job
from gpulayer_contracts.profiles import (
    MAX_PROFILES,
    MAX_PROFILES_FILE_BYTES,
    Profiles,
    expand_profile,
    load_profiles,
    parse_profiles,
    same_submission,
)

SHIPPED = Path(__file__).resolve().parents[2] / "examples" / "profiles.toml"
TORCH = "torch-2.5-cu124@1"


@pytest.fixture(scope="module")
def profiles() -> Profiles:
    return load_profiles(SHIPPED)


def job(**fields: object) -> JobRequest:
    return msgspec.convert({"job_id": "j", "command": ["true"], **fields}, JobRequest)


def test_the_shipped_file_parses_with_every_version(profiles: Profiles) -> None:
    assert profiles.versions("torch-2.5-cu124") == [TORCH, "torch-2.5-cu124@2"]
    assert "python-linux@1" in profiles.by_ref
    assert profiles.source == str(SHIPPED)


def test_expansion_adds_the_profiles_requirements_and_says_which(profiles: Profiles) -> None:
    expanded, errors = expand_profile(job(profile=TORCH, requirements={"gpu_count": 2}), profiles)
    assert errors == []
    req = expanded.requirements
    assert (req.python, req.accelerator, req.driver, req.os) == (
        ">=3.10,<3.13",
        "cuda",
        ">=550",
        "linux",
    )
    assert req.frameworks == {"torch": "==2.5.*"}
    assert req.framework_capabilities == ["torch.cuda"]
    assert req.min_cuda_compute_capability == 7.0
    assert req.gpu_count == 2  # the job's own fields stay
    assert expanded.profile == TORCH
    assert set(expanded.profile_fields) == {
        "python",
        "frameworks.torch",
        "framework_capabilities.torch.cuda",
        "accelerator",
        "min_cuda_compute_capability",
        "driver",
        "os",
    }
    assert validate_job(expanded).errors == []
    # Expanding again changes nothing (placement may see an expanded job again).
    assert expand_profile(expanded, profiles) == (expanded, [])


def test_the_same_value_twice_is_no_conflict(profiles: Profiles) -> None:
    same = job(
        profile=TORCH,
        requirements={
            "python": ">=3.10,<3.13",
            "min_cuda_compute_capability": "7",  # 7, 7.0 and "7.0" are one capability
            "frameworks": {"torch": "==2.5.*", "numpy": ">=1.26"},
            "framework_capabilities": ["torch.cuda", "torch.distributed"],
        },
    )
    expanded, errors = expand_profile(same, profiles)
    assert errors == []
    assert expanded.requirements.frameworks == {"torch": "==2.5.*", "numpy": ">=1.26"}
    assert expanded.requirements.framework_capabilities == ["torch.cuda", "torch.distributed"]


def test_a_conflict_names_both_sides(profiles: Profiles) -> None:
    clash = job(
        profile=TORCH,
        requirements={"python": ">=3.12", "frameworks": {"torch": ">=2.6"}, "os": "darwin"},
    )
    _, errors = expand_profile(clash, profiles)
    assert errors == [
        f"$.requirements.python: the job's '>=3.12' conflicts with profile {TORCH}'s "
        "'>=3.10,<3.13'",
        f"$.requirements.frameworks.torch: the job's '>=2.6' conflicts with profile {TORCH}'s "
        "'==2.5.*'",
        f"$.requirements.os: the job's 'darwin' conflicts with profile {TORCH}'s 'linux'",
    ]
    _, errors = expand_profile(job(profile=TORCH, requirements={"accelerator": "mps"}), profiles)
    assert errors == [
        f"$.requirements.accelerator: the job's 'mps' conflicts with profile {TORCH}'s 'cuda'"
    ]


def test_an_unknown_version_or_profile_names_the_known_ones(profiles: Profiles) -> None:
    _, errors = expand_profile(job(profile="torch-2.5-cu124@9"), profiles)
    assert errors == [
        "$.profile: unknown version 'torch-2.5-cu124@9'; known versions: "
        "torch-2.5-cu124@1, torch-2.5-cu124@2"
    ]
    _, errors = expand_profile(job(profile="jax@1"), profiles)
    assert errors[0].startswith("$.profile: unknown profile 'jax@1'; known profiles: ")
    assert "python-linux@1" in errors[0]
    assert TORCH in errors[0]
    _, errors = expand_profile(job(profile="jax@1"), Profiles())
    assert errors == ["$.profile: 'jax@1': no profiles are configured on this placement"]


def test_a_job_without_profile_is_unchanged_and_cannot_forge_profile_fields(
    profiles: Profiles,
) -> None:
    plain = job(requirements={"python": ">=3.11"})
    assert expand_profile(plain, profiles) == (plain, [])
    forged = job(profile_fields=["python"])
    expanded, errors = expand_profile(forged, profiles)
    assert errors == []
    assert expanded.profile_fields == []


def test_same_submission_compares_a_stored_job_as_it_was_submitted(profiles: Profiles) -> None:
    submitted = job(profile=TORCH, requirements={"gpu_count": 1, "python": ">=3.10,<3.13"})
    stored, _ = expand_profile(submitted, profiles)
    assert same_submission(stored, submitted)
    assert not same_submission(stored, job(profile=TORCH, requirements={"gpu_count": 2}))
    assert not same_submission(stored, job(profile="torch-2.5-cu124@2"))
    assert not same_submission(stored, job(requirements=msgspec.to_builtins(stored.requirements)))
    plain = job()
    assert same_submission(plain, plain)


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("x\x00@1", "Expected `str` matching regex"),
        ("x" * 65 + "@1", "Expected `str` matching regex"),
        ("x@0", "Expected `str` matching regex"),
        ("x", "Expected `str` matching regex"),
        ("x@1\n", "is not name@version"),  # msgspec's "$" matches before a final newline
    ],
)
def test_a_bad_profile_reference_is_refused_at_decoding_or_validation(ref: str, why: str) -> None:
    body = msgspec.json.encode({"job_id": "j", "command": ["true"], "profile": ref})
    errors: list[str]
    try:
        errors = validate_job(decode_job_json(body)).errors
    except InvalidInput as err:
        errors = [str(err)]
    assert any(e.startswith("$.profile: ") and why in e for e in errors), errors


def test_driver_and_os_are_checked_like_other_requirements() -> None:
    bad = job(requirements={"driver": "550+", "accelerator": "mps"})
    errors = validate_job(bad).errors
    assert "$.requirements.driver: '550+' is not a PEP 440 version specifier" in errors
    assert any(e.startswith("$.requirements.driver: the NVIDIA driver is only") for e in errors)
    with pytest.raises(InvalidInput, match=r"\$\.requirements\.os"):
        decode_job_json(b'{"job_id": "j", "command": ["x"], "requirements": {"os": "plan9"}}')
    # A field added later decodes from a message that lacks it.
    assert Requirements().driver is None
    assert JobRequest(job_id="j", command=["x"]).profile is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[profiles", "not valid TOML"),
        ('[profiles."a@1"]\ngpu_count = 1', 'profiles."a@1".gpu_count: unknown field'),
        ('[profiles."a@1"]\npython = "3.10+"', "profiles.\"a@1\".python: '3.10+' is not a PEP 440"),
        ('[profiles."a@1"]\naccelerator = "tpu"', 'profiles."a@1".accelerator: Invalid enum'),
        ('[profiles."a@1"]\naccelerator = "rocm"', "detection-only in the support matrix"),
        ('[profiles."a@1"]\nmin_cuda_compute_capability = 1e308', "not a compute capability"),
        ('[profiles."a"]\nos = "linux"', 'profiles."a": not name@version'),
        ('[profiles."a\\u0000@1"]\nos = "linux"', 'profiles."a\\x00@1": not name@version'),
        (f'[profiles."{"a" * 5000}@1"]', "..."),
        (
            '[profiles."a@1"]\ndescription = "a\\u0000"',
            "description: over 1024 bytes, or holds NUL",
        ),
        ("profiles = 3", "profiles: must be a table"),
        ('[profile."a@1"]', "'profile': unknown key (only [profiles])"),
        ('[profiles."a@1"]\nframeworks = {torch = 2}', 'profiles."a@1".frameworks[...]: Expected'),
    ],
)
def test_a_bad_profiles_file_is_refused_naming_where(text: str, expected: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_profiles(text, "p.toml")
    message = str(err.value)
    assert message.startswith("p.toml: ")
    assert expected in message, message
    assert "\x00" not in message
    assert len(message) < 2000


def test_profiles_file_limits(tmp_path: Path) -> None:
    many = "".join(f'[profiles."p@{i}"]\n' for i in range(1, MAX_PROFILES + 2))
    with pytest.raises(InvalidInput, match="over the limit of 1024"):
        parse_profiles(many)
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MAX_PROFILES_FILE_BYTES + 1))
    with pytest.raises(InvalidInput, match="over the limit of 1048576 bytes"):
        load_profiles(big)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(InvalidInput, match="not UTF-8"):
        load_profiles(binary)
    with pytest.raises(InvalidInput, match="cannot read the profiles file"):
        load_profiles(tmp_path / "missing.toml")
