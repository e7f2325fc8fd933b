"""The example jobs ``gpulayer dev up`` submits, each with the outcome it should end in."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import msgspec

from gpulayer_cli.render import event_tag
from gpulayer_contracts import InvalidInput, JobEvent, JobRequest, is_terminal, load_job_file

# Files in the examples folder that are no job: the outcomes expected, and the runtime profiles
# placement is given (GPULAYER_PROFILES, unless the environment names another file).
EXPECTATIONS, PROFILES = "expectations.toml", "profiles.toml"
NOT_JOBS = (EXPECTATIONS, PROFILES)


@dataclass
class Example:
    path: Path
    job: JobRequest
    expect: str


def load_examples(folder: Path, run_tag: str) -> list[Example]:
    """Job files in ``folder`` with the outcome ``expectations.toml`` names for each.

    Each run gets fresh job ids (``<id>-<run_tag>``): a job id is the dedupe key, so re-running
    the examples against the same stack would otherwise be one job.
    """
    expectations = tomllib.loads((folder / EXPECTATIONS).read_text())["expect"]
    examples = []
    for path in sorted(folder.iterdir()):
        if path.suffix not in (".toml", ".json") or path.name in NOT_JOBS:
            continue
        job = load_job_file(path)
        expect = expectations.get(path.name)
        if expect is None:
            raise InvalidInput(
                f"{path.name}: no expected outcome in {folder / 'expectations.toml'}"
            )
        job = msgspec.structs.replace(job, job_id=f"{job.job_id}-{run_tag}")
        examples.append(Example(path=path, job=job, expect=expect))
    return examples


def settled(example: Example, event: JobEvent) -> bool:
    """The example reached its expected outcome, or an outcome it can't move on from."""
    tag = event_tag(event)
    return tag == example.expect or is_terminal(event)
