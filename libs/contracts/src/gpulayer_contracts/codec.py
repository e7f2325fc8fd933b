"""Encoding and strict decoding. Decoders are built once and reused (msgspec perf tips)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from gpulayer_contracts.bounds import MAX_MESSAGE_CHARS, clip_text
from gpulayer_contracts.capabilities import Heartbeat, WorkerCapabilities
from gpulayer_contracts.events import AnyJobEvent, CancelJob, Grant, JobStatus, LogLine
from gpulayer_contracts.health import DoctorReport, NodeObservations
from gpulayer_contracts.jobs import JOB_ID_PATTERN, JobRequest
from gpulayer_contracts.schemas import wire_schema

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
observations_decoder = msgspec.json.Decoder(NodeObservations)
doctor_decoder = msgspec.json.Decoder(DoctorReport)


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


def _printable(text: str) -> str:
    """NUL and other control characters escaped (``\\x00``): messages are stored in PostgreSQL,
    which refuses NUL in text, and shown in terminals."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def describe_validation_error(err: msgspec.DecodeError | msgspec.ValidationError) -> str:
    """Turn msgspec's message into ``$.path.to.field: what is wrong``: printable, and at most
    MAX_MESSAGE_CHARS long (msgspec quotes unknown field names, which can be anything)."""
    return clip_text(_printable(_describe(err)), MAX_MESSAGE_CHARS)


def _describe(err: msgspec.DecodeError | msgspec.ValidationError) -> str:
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


_JOB_ID = re.compile(JOB_ID_PATTERN)


def _checked(job: JobRequest) -> JobRequest:
    # msgspec applies a pattern with re.search, where ``$`` also matches before a final
    # newline: "a\n" would pass, and no NATS subject can hold it.
    if not _JOB_ID.fullmatch(job.job_id):
        raise InvalidInput(f"$.job_id: Expected `str` matching regex {JOB_ID_PATTERN!r}")
    return job


def decode_job_json(data: bytes | str) -> JobRequest:
    try:
        return _checked(job_request_decoder.decode(data))
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise InvalidInput(describe_validation_error(err)) from err
    except RecursionError as err:  # msgspec raises it on deep nesting, not DecodeError
        raise InvalidInput("not valid JSON: nested too deeply") from err


def decode_message(decoder: msgspec.json.Decoder[T], data: bytes | str) -> T:
    """Decode a service message with one of the decoders above. Raises InvalidInput, never
    anything else, whatever ``data`` holds: a Wire struct skips unknown fields, and msgspec
    raises RecursionError (not DecodeError) on a skipped value nested 100,000 deep."""
    try:
        return decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise InvalidInput(describe_validation_error(err)) from err
    except RecursionError as err:
        raise InvalidInput("not valid JSON: nested too deeply") from err


def decode_job_toml(data: bytes | str) -> JobRequest:
    try:
        raw = tomllib.loads(data.decode() if isinstance(data, bytes) else data)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise InvalidInput(f"not valid TOML: {err}") from err
    try:
        return _checked(msgspec.convert(raw, JobRequest, strict=True))
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


class _JobIdOnly(msgspec.Struct):
    job_id: object = None


_job_id_decoder = msgspec.json.Decoder(_JobIdOnly)
# The id of broken JSON: a "job_id" key with a string value that is a valid id, the first one
# in the first BEST_EFFORT_SCAN_BYTES. The closing quote must follow the id, so a longer id or
# one with escapes is no id. Linear: no backtracking beyond the bounded whitespace.
_JOB_ID_IN_BYTES = re.compile(rb'"job_id"[ \t\r\n]{0,64}:[ \t\r\n]{0,64}"([A-Za-z0-9_-]{1,128})"')
# NATS' default max_payload: all of any message a default server delivers.
BEST_EFFORT_SCAN_BYTES = 1024 * 1024


def best_effort_job_id(data: bytes) -> str | None:
    """The job id of a message that failed to decode, if one can be read, so that a rejection
    can still be published on the job's own subject. Never raises.

    A JSON object: its ``job_id`` when that is a string and a valid job id, else None (an
    integer or a NUL-holding id is no id). Anything else (not JSON, invalid UTF-8, NaN, nested
    too deeply for the decoder): the first ``"job_id": "<valid id>"`` in its first
    BEST_EFFORT_SCAN_BYTES bytes.
    """
    try:
        raw = _job_id_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, MemoryError, TypeError):
        pass  # not a JSON object: scan for the key below
    else:
        job_id = raw.job_id
        if isinstance(job_id, str) and _JOB_ID.fullmatch(job_id):
            return job_id
        return None
    if not isinstance(data, bytes | bytearray | memoryview):
        return None
    m = _JOB_ID_IN_BYTES.search(bytes(data[:BEST_EFFORT_SCAN_BYTES]))
    return m.group(1).decode("ascii") if m else None


def job_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of JobRequest, generated from the struct (``wire_schema("job")``)."""
    return wire_schema("job")
