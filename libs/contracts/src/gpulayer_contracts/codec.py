"""Encoding and strict decoding. Decoders are built once and reused (msgspec perf tips)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from gpulayer_contracts.capabilities import Heartbeat, WorkerCapabilities
from gpulayer_contracts.events import AnyJobEvent, CancelJob, Grant, JobStatus, LogLine
from gpulayer_contracts.jobs import JobRequest

T = TypeVar("T")

_encoder = msgspec.json.Encoder()

job_request_decoder = msgspec.json.Decoder(JobRequest)
capabilities_decoder = msgspec.json.Decoder(WorkerCapabilities)
heartbeat_decoder = msgspec.json.Decoder(Heartbeat)
grant_decoder = msgspec.json.Decoder(Grant)
status_decoder = msgspec.json.Decoder(JobStatus)
cancel_decoder = msgspec.json.Decoder(CancelJob)
log_line_decoder = msgspec.json.Decoder(LogLine)
event_decoder: msgspec.json.Decoder[AnyJobEvent] = msgspec.json.Decoder(AnyJobEvent)


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


class InvalidInput(ValueError):
    """Input that can never be a valid message. ``str()`` names the offending path."""


_UNKNOWN_FIELD = re.compile(
    r"^Object contains unknown field `(?P<field>[^`]+)` - at `(?P<at>[^`]+)`$"
)
_MISSING_FIELD = re.compile(
    r"^Object missing required field `(?P<field>[^`]+)`(?: - at `(?P<at>[^`]+)`)?$"
)
_AT = re.compile(r"^(?P<msg>.*) - at `(?P<at>[^`]+)`$")


def describe_validation_error(err: msgspec.DecodeError | msgspec.ValidationError) -> str:
    """Turn msgspec's message into ``$.path.to.field: what is wrong``."""
    text = str(err)
    if m := _UNKNOWN_FIELD.match(text):
        return f"{m['at']}.{m['field']}: unknown field"
    if m := _MISSING_FIELD.match(text):
        return f"{m['at'] or '$'}.{m['field']}: required field missing"
    if m := _AT.match(text):
        return f"{m['at']}: {m['msg']}"
    if isinstance(err, msgspec.ValidationError):
        return f"$: {text}"
    return f"not valid JSON: {text}"


def decode_job_json(data: bytes | str) -> JobRequest:
    try:
        return job_request_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise InvalidInput(describe_validation_error(err)) from err


def decode_job_toml(data: bytes | str) -> JobRequest:
    try:
        raw = tomllib.loads(data.decode() if isinstance(data, bytes) else data)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise InvalidInput(f"not valid TOML: {err}") from err
    try:
        return msgspec.convert(raw, JobRequest, strict=True)
    except msgspec.ValidationError as err:
        raise InvalidInput(describe_validation_error(err)) from err


def load_job_file(path: str | Path) -> JobRequest:
    """Read a job file (``.toml`` or ``.json``), strictly. Raises InvalidInput naming the field."""
    p = Path(path)
    data = p.read_bytes()
    if p.suffix.lower() == ".toml":
        return decode_job_toml(data)
    if p.suffix.lower() == ".json":
        return decode_job_json(data)
    raise InvalidInput(f"{p}: job files end in .toml or .json")


def best_effort_job_id(data: bytes) -> str | None:
    """The job id of a message that failed to decode, if one can be read, so that a rejection
    can still be published on the job's own subject."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, dict):
        job_id = raw.get("job_id")
        if isinstance(job_id, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,128}", job_id):
            return job_id
    return None


def job_schema() -> dict[str, Any]:
    """JSON Schema of JobRequest, generated from the struct."""
    return msgspec.json.schema(JobRequest)
