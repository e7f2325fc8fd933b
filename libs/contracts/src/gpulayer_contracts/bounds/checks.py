"""The checks every kind of message shares: a text's size and characters, a number's range,
a list's length, and how a value and a path are shown in an error."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sized

from gpulayer_contracts.bounds.limits import (
    MAX_COMPUTE_CAPABILITY_PART,
    MAX_ERRORS,
    MAX_MESSAGE_CHARS,
    MAX_SHORT_TEXT_BYTES,
)
from gpulayer_contracts.jobs import JOB_ID_PATTERN

JOB_ID = re.compile(JOB_ID_PATTERN)
_IDENT = re.compile(r"[A-Za-z0-9_-]{1,64}")


def clip_text(text: str, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``max_chars`` characters, ending in ``...`` when cut."""
    if len(text) <= max_chars:
        return text
    return text[: max(0, max_chars - 3)] + "..."


def show(value: object, max_chars: int = 40) -> str:
    """A value quoted for an error message: repr escapes NUL and control characters (a message
    is stored in PostgreSQL, which refuses NUL in text), and a long value is cut."""
    text = repr(value)
    return clip_text(text, max_chars) if len(text) > max_chars else text


def key_path(path: str, key: str) -> str:
    """``$.env.HOME``; a key that isn't a plain word is quoted: ``$.env['A=B']``."""
    return f"{path}.{key}" if _IDENT.fullmatch(key) else f"{path}[{show(key)}]"


def env_path(name: str) -> str:
    """The path of one env variable in an error message."""
    return key_path("$.env", name)


def utf8_len(text: str) -> int:
    # A lone surrogate (possible from Python, not from JSON) counts as 3 bytes, as it would
    # be escaped; text_errors refuses it.
    return len(text.encode("utf-8", "surrogatepass"))


def range_error(
    path: str, value: float, low: float, high: float, *, low_open: bool = False
) -> str | None:
    """An error when ``value`` is not finite or outside [low, high] (low excluded if open)."""
    op = "<" if low_open else "<="
    if isinstance(value, int):
        # Any size: msgspec decodes integers beyond 64 bits, too big for a float.
        inside = value > low if low_open else value >= low
        if inside and value <= high:
            return None
        shown = (
            repr(value) if value.bit_length() <= 128 else f"an integer of {value.bit_length()} bits"
        )
    else:
        inside = math.isfinite(value) and (value > low if low_open else value >= low)
        if inside and value <= high:
            return None
        shown = repr(value)
    return f"{path}: {shown} is out of range ({_num(low)} {op} x <= {_num(high)})"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def text_errors(path: str, text: str, max_bytes: int) -> Iterator[str]:
    if "\x00" in text:
        yield f"{path}: contains a NUL character (\\x00)"
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        yield f"{path}: contains a lone surrogate (not valid Unicode)"
        size = utf8_len(text)
    if size > max_bytes:
        yield f"{path}: {size} bytes, over the limit of {max_bytes} bytes"


def count_errors(path: str, items: Sized, most: int) -> Iterator[str]:
    n = len(items)
    if n > most:
        yield f"{path}: {n} entries, over the limit of {most}"


def texts_errors(path: str, values: list[str], max_items: int, max_bytes: int) -> Iterator[str]:
    yield from count_errors(path, values, max_items)
    for i, value in enumerate(values[: max_items + 1]):
        yield from text_errors(f"{path}[{i}]", value, max_bytes)


def text_map_errors(
    path: str, values: dict[str, str], max_items: int, max_key: int, max_value: int
) -> Iterator[str]:
    yield from count_errors(path, values, max_items)
    for key, value in list(values.items())[: max_items + 1]:
        yield from text_errors(f"{path} key {show(key)}", key, max_key)
        yield from text_errors(key_path(path, key), value, max_value)


def compute_capability_errors(path: str, value: float | str) -> Iterator[str]:
    """Range of a compute capability that parses (one that doesn't is reported elsewhere)."""
    if isinstance(value, float) and not math.isfinite(value):
        yield f"{path}: {value!r} is out of range (a finite number such as 8.6)"
        return
    text = repr(value) if isinstance(value, float) else value.strip()
    if isinstance(value, str):
        yield from text_errors(path, value, MAX_SHORT_TEXT_BYTES)
        if utf8_len(value) > MAX_SHORT_TEXT_BYTES:
            return
    major, _, minor = text.partition(".")
    parts = [major, minor] if minor else [major]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        return  # not a compute capability at all: validate_job says so
    top = MAX_COMPUTE_CAPABILITY_PART
    if any(n > top for n in numbers):
        yield f"{path}: {show(value)} is out of range (major and minor each 0 .. {top})"


def fits(text: str, max_bytes: int) -> bool:
    """No NUL, valid Unicode, at most ``max_bytes`` in UTF-8 (a character is <= 4 bytes, so
    most strings need no encoding to tell)."""
    if "\x00" in text:
        return False
    if len(text) * 4 <= max_bytes and text.isascii():
        return True
    try:
        return len(text.encode("utf-8")) <= max_bytes
    except UnicodeEncodeError:
        return False


def bound_messages(messages: list[str], most: int = MAX_ERRORS) -> list[str]:
    """At most ``most`` lines of at most MAX_MESSAGE_CHARS each; the rest are counted."""
    clipped = [clip_text(m) for m in messages[:most]]
    if len(messages) > most:
        clipped.append(f"... and {len(messages) - most} more")
    return clipped


def opt_text_errors(path: str, value: str | None, max_bytes: int) -> Iterator[str]:
    if value is not None:
        yield from text_errors(path, value, max_bytes)


def opt_range_errors(path: str, value: int | None, low: int, high: int) -> Iterator[str]:
    if value is not None:
        error = range_error(path, value, low, high)
        if error:
            yield error


def within(value: int | None, low: int, high: int) -> bool:
    return value is None or (isinstance(value, int) and low <= value <= high)


def all_fit(texts: list[str], max_bytes: int) -> bool:
    """``fits`` for each of ``texts``, in a few C-speed passes when all are ASCII."""
    if not texts:
        return True
    joined = "".join(texts)
    if joined.isascii() and "\x00" not in joined:
        return max(map(len, texts)) <= max_bytes
    return all(fits(x, max_bytes) for x in texts)
