"""The node's container runtime in its capabilities (issue 28): bounded like every field,
absent from an older probe's report, and checked alike by the fast and the detailed bounds."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulayer_contracts import bounds as b
from gpulayer_contracts import encode
from gpulayer_contracts.bounds import nodes as bounds_nodes
from gpulayer_contracts.capabilities import ContainerRuntime, WorkerCapabilities
from gpulayer_contracts.codec import capabilities_decoder, decode_message

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def caps(runtime: ContainerRuntime | None) -> WorkerCapabilities:
    return WorkerCapabilities(
        node_id="n1", agent_version="0.1.0", detected_at=NOW, container_runtime=runtime
    )


def rt(**fields: Any) -> ContainerRuntime:
    base: dict[str, Any] = {"name": "podman", "version": "4.3.1", "oci_runtime": "runc"}
    base.update(fields)
    return ContainerRuntime(**base)


def test_an_older_probes_report_decodes_without_a_runtime() -> None:
    old = msgspec.json.encode(
        {"node_id": "n1", "agent_version": "0.0.9", "detected_at": NOW.isoformat()}
    )
    assert decode_message(capabilities_decoder, old).container_runtime is None


def test_a_runtime_survives_the_wire_and_a_newer_field_is_ignored() -> None:
    sent = caps(rt(works=True, cdi_devices=["nvidia.com/gpu=0", "nvidia.com/gpu=all"]))
    raw = msgspec.json.decode(encode(sent))
    raw["container_runtime"]["rootless"] = False  # a field a later probe may add
    got = decode_message(capabilities_decoder, msgspec.json.encode(raw))
    assert got == sent


@pytest.mark.parametrize(
    ("runtime", "text"),
    [
        (rt(works=True), "podman 4.3.1/runc"),
        (rt(oci_runtime=None, works=True), "podman 4.3.1"),
        (rt(), "podman 4.3.1/runc (self-test failed)"),
        (
            rt(oci_runtime="crun", works=True, machine_provider="libkrun"),
            "podman 4.3.1/crun (machine: libkrun)",
        ),
    ],
)
def test_describe(runtime: ContainerRuntime, text: str) -> None:
    assert runtime.describe() == text


OUTSIDE_INSIDE = [
    (
        "huge version",
        rt(version="4" * (b.MAX_SHORT_TEXT_BYTES + 1)),
        "$.container_runtime.version: 257 bytes, over the limit of 256 bytes",
        rt(version="4" * b.MAX_SHORT_TEXT_BYTES),
    ),
    (
        "NUL in the name",
        rt(name="pod\x00man"),
        "$.container_runtime.name: contains a NUL character (\\x00)",
        rt(name="podman"),
    ),
    (
        "lone surrogate in the OCI runtime",
        rt(oci_runtime="runc\ud800"),
        "$.container_runtime.oci_runtime: contains a lone surrogate",
        rt(oci_runtime="runc"),
    ),
    (
        "huge machine provider",
        rt(machine_provider="k" * (b.MAX_SHORT_TEXT_BYTES + 1)),
        "$.container_runtime.machine_provider: 257 bytes, over the limit of 256 bytes",
        rt(machine_provider="libkrun"),
    ),
    (
        "notes count",
        rt(notes=["n"] * (b.MAX_NOTES + 1)),
        "$.container_runtime.notes: 257 entries, over the limit of 256",
        rt(notes=["n"] * b.MAX_NOTES),
    ),
    (
        "note size",
        rt(notes=["n" * (b.MAX_NOTE_BYTES + 1)]),
        "$.container_runtime.notes[0]: 1025 bytes, over the limit of 1024 bytes",
        rt(notes=["n" * b.MAX_NOTE_BYTES]),
    ),
    (
        "thousands of CDI devices",
        rt(cdi_devices=[f"nvidia.com/gpu={i}" for i in range(b.MAX_CDI_DEVICES + 1)]),
        "$.container_runtime.cdi_devices: 4097 entries, over the limit of 4096",
        rt(cdi_devices=[f"nvidia.com/gpu={i}" for i in range(b.MAX_CDI_DEVICES)]),
    ),
    (
        "a CDI name too long",
        rt(cdi_devices=["nvidia.com/gpu=" + "0" * b.MAX_SHORT_TEXT_BYTES]),
        "$.container_runtime.cdi_devices[0]: 271 bytes, over the limit of 256 bytes",
        rt(cdi_devices=["nvidia.com/gpu=" + "0" * (b.MAX_SHORT_TEXT_BYTES - 15)]),
    ),
]


@pytest.mark.parametrize(
    ("outside", "expected", "inside"),
    [pytest.param(o, e, i, id=name) for name, o, e, i in OUTSIDE_INSIDE],
)
def test_a_runtime_bound_is_named_and_just_inside_passes(
    outside: ContainerRuntime, expected: str, inside: ContainerRuntime
) -> None:
    errors = b.validate_capabilities(caps(outside))
    assert any(expected in e for e in errors), errors
    assert b.validate_capabilities(caps(inside)) == []


_text = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["", "x\x00", "\ud800", "é" * 200, "a" * 256, "a" * 257, "a" * 1025]),
)


@given(
    present=st.booleans(),
    name=_text,
    version=st.one_of(st.none(), _text),
    oci=st.one_of(st.none(), _text),
    provider=st.one_of(st.none(), _text),
    notes=st.lists(_text, max_size=3),
    cdi=st.one_of(
        st.lists(_text, max_size=3),
        st.sampled_from([["d"] * b.MAX_CDI_DEVICES, ["d"] * (b.MAX_CDI_DEVICES + 1)]),
    ),
)
def test_the_fast_check_agrees_with_the_detailed_one(
    present: bool,
    name: str,
    version: str | None,
    oci: str | None,
    provider: str | None,
    notes: list[str],
    cdi: list[str],
) -> None:
    runtime = ContainerRuntime(
        name=name,
        version=version,
        oci_runtime=oci,
        notes=notes,
        cdi_devices=cdi,
        machine_provider=provider,
    )
    report = caps(runtime if present else None)
    detailed = list(bounds_nodes._capabilities(report))
    assert bounds_nodes._capabilities_within_bounds(report) == (not detailed), detailed


def test_drift_names_a_runtime_lost_or_failing() -> None:
    from gpulayer_contracts.health import drift

    works = rt(works=True)
    # Found: no news (a probe reports none until its first self-test answers).
    assert drift(caps(None), caps(works)) == []
    assert drift(caps(works), caps(rt(notes=["self-test failed"]))) == [
        "container runtime: podman 4.3.1/runc -> podman 4.3.1/runc (self-test failed)"
    ]
    assert drift(caps(works), caps(None)) == ["container runtime: podman 4.3.1/runc -> none"]
    # Its CDI devices or notes alone are no drift worth a warning.
    assert drift(caps(works), caps(rt(works=True, cdi_devices=["nvidia.com/gpu=0"]))) == []
    assert drift(caps(None), caps(None)) == []
