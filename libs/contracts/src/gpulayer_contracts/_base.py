"""Struct bases shared by every contract."""

from __future__ import annotations

import msgspec


class Input(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base for structs decoded from user input (job files, submitted jobs): a typo is an error."""


class Wire(msgspec.Struct, frozen=True, kw_only=True):
    """Base for service-to-service messages: unknown fields are tolerated so that services of
    different versions keep talking; every field added later gets a default."""
