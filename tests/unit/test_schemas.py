"""The wire schemas: valid JSON Schema 2020-12, printed by `gpulayer schema`, mapped from subjects,
and not vacuous (a wrong message fails). Real messages from a running stack are checked against
them in tests/e2e/test_wire_schemas.py."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpulayer_cli.main import main
from gpulayer_contracts import (
    WIRE_SCHEMAS,
    Heartbeat,
    JobStatus,
    Placed,
    encode,
    job_schema,
    schema_for_subject,
    wire_schema,
)
from gpulayer_contracts import subjects as s

DOCS_SCHEMAS = Path(__file__).resolve().parents[2] / "docs" / "schemas"


def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(wire_schema(name))


@pytest.mark.parametrize("name", list(WIRE_SCHEMAS))
def test_each_schema_is_2020_12_with_a_stable_id(name: str) -> None:
    schema = wire_schema(name)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"https://gpulayer.dev/schemas/{name}.json"
    jsonschema.Draft202012Validator.check_schema(schema)
    assert jsonschema.validators.validator_for(schema) is jsonschema.Draft202012Validator


@pytest.mark.parametrize("name", list(WIRE_SCHEMAS))
def test_cli_prints_the_documented_schema(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", name]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed) == wire_schema(name)
    assert printed == (DOCS_SCHEMAS / f"{name}.json").read_text()


def test_cli_schema_defaults_to_the_job_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == job_schema() == wire_schema("job")


def test_unknown_schema_name_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["schema", "nope"])
    assert exit_.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no schema 'nope': choose one of job, event"):
        wire_schema("nope")


@pytest.mark.parametrize(
    ("subject", "name"),
    [
        (s.jobs_submit(), "job"),
        (s.jobs_submit("alice"), "job"),
        (s.job_events("j1", "alice"), "event"),
        (s.job_logs("j1"), "log"),
        (s.node_capabilities("n1"), "capabilities"),
        (s.node_heartbeat("n1"), "heartbeat"),
        (s.node_grants("n1"), "grant"),
        (s.node_status("n1"), "status"),
        (s.node_control("n1"), "cancel"),
        (s.node_doctor("n1"), None),
        (s.api_subject(s.API_NODES, "alice"), None),
        (s.dlq_subject("JOBS"), None),
        ("gpulayer.node.n1.capabilities.extra", None),
        ("gpulayer.job.j1.events", None),
    ],
)
def test_subject_to_schema(subject: str, name: str | None) -> None:
    assert schema_for_subject(subject) == name


def _json(obj: Any) -> Any:
    return json.loads(encode(obj))


def test_schemas_accept_messages_and_refuse_wrong_ones() -> None:
    now = datetime.now(UTC)
    event = _json(Placed(job_id="j", node_id="n", accelerator="cuda", devices=[0]))
    events = _validator("event")
    events.validate(event)
    # A reader from an older version ignores fields it doesn't know: so does the schema.
    events.validate({**event, "added_later": 1})
    assert not events.is_valid({**event, "type": "teleported"})
    assert not events.is_valid({**event, "devices": ["zero"]})
    assert not events.is_valid({k: v for k, v in event.items() if k != "node_id"})

    status = _json(JobStatus(job_id="j", grant_id="g", node_id="n", state="running", at=now))
    _validator("status").validate(status)
    assert not _validator("status").is_valid({**status, "state": "exploded"})
    _validator("heartbeat").validate(_json(Heartbeat(node_id="n", sent_at=now)))

    jobs = _validator("job")
    jobs.validate({"job_id": "j", "command": ["true"]})
    # Job requests are strict, as their decoder is: a typo is an error.
    assert not jobs.is_valid({"job_id": "j", "command": ["true"], "comand": ["x"]})
    assert not jobs.is_valid({"job_id": "j/../x", "command": ["true"]})
    assert not jobs.is_valid({"job_id": "j", "command": []})
