"""A runtime profile's ``container`` (issue 28): its jobs run in that image, a job that names
another is refused naming both, a bad image reference in the profiles file names where."""

from __future__ import annotations

import msgspec
import pytest
from tests.unit.matching.rule_cases import node

from gpulayer_contracts import InvalidInput, JobRequest
from gpulayer_contracts.jobs import Container
from gpulayer_contracts.profiles import Profiles, expand_profile, parse_profiles, same_submission
from gpulayer_matching import explain
from gpulayer_matching.profiles import profile_fit

TEXT = """
[profiles."torch-image@1"]
description = "PyTorch in its image"
python = ">=3.10"
container = {image = "localhost/torch:2.5", pull = "never"}

[profiles."bare@1"]
python = ">=3.10"
"""
IMAGE = Container(image="localhost/torch:2.5", pull="never")


@pytest.fixture(scope="module")
def profiles() -> Profiles:
    return parse_profiles(TEXT)


def job(**fields: object) -> JobRequest:
    return msgspec.convert({"job_id": "j", "command": ["true"], **fields}, JobRequest)


def test_a_profiles_image_becomes_the_jobs(profiles: Profiles) -> None:
    expanded, errors = expand_profile(job(profile="torch-image@1"), profiles)
    assert errors == []
    assert expanded.container == IMAGE
    assert set(expanded.profile_fields) == {"python", "container"}
    # Expanding again changes nothing; the stored job is recognised as the same submission.
    assert expand_profile(expanded, profiles) == (expanded, [])
    assert same_submission(expanded, job(profile="torch-image@1"))
    assert not same_submission(expanded, job(profile="torch-image@1", name="other"))


def test_the_same_image_twice_is_no_conflict_another_is(profiles: Profiles) -> None:
    same = job(profile="torch-image@1", container={"image": "localhost/torch:2.5", "pull": "never"})
    assert expand_profile(same, profiles)[1] == []
    other = job(profile="torch-image@1", container={"image": "localhost/torch:2.6"})
    _, errors = expand_profile(other, profiles)
    assert errors == [
        "$.container: the job's {'image': 'localhost/torch:2.6', 'pull': 'missing'} conflicts "
        "with profile torch-image@1's {'image': 'localhost/torch:2.5', 'pull': 'never'}"
    ]


def test_a_profile_without_an_image_leaves_the_jobs(profiles: Profiles) -> None:
    own = job(profile="bare@1", container={"image": "localhost/mine:1"})
    expanded, errors = expand_profile(own, profiles)
    assert errors == []
    assert expanded.container == Container(image="localhost/mine:1")
    assert "container" not in expanded.profile_fields


@pytest.mark.parametrize(
    ("image", "said"),
    [
        ("-rm", 'profiles."x@1".container.image: '),
        ("a" * 600, 'profiles."x@1".container.image: 600 characters'),
        ("ok\x00", 'profiles."x@1".container.image: '),
    ],
)
def test_a_bad_image_in_the_profiles_file_names_where(image: str, said: str) -> None:
    text = f'[profiles."x@1"]\ncontainer = {{image = {msgspec.json.encode(image).decode()}}}\n'
    with pytest.raises(InvalidInput) as err:
        parse_profiles(text)
    assert said in str(err.value)


def test_an_unknown_pull_policy_is_refused() -> None:
    with pytest.raises(InvalidInput, match=r'profiles."x@1".container.pull'):
        parse_profiles('[profiles."x@1"]\ncontainer = {image = "a", pull = "sometimes"}\n')


def test_a_profiles_container_is_named_in_reasons_and_its_fit(profiles: Profiles) -> None:
    expanded, _ = expand_profile(job(profile="torch-image@1"), profiles)
    why = explain(expanded, [node(workload_python_version="3.11.9")])
    assert why.reasons == ["1 has no container runtime (profile torch-image@1)"]
    (entry,) = [e for e in profile_fit(profiles, [node()]) if e["profile"] == "torch-image@1"]
    assert entry["requirements"]["container"] == {"image": "localhost/torch:2.5", "pull": "never"}
    assert entry["satisfy"] == 0
