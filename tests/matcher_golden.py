"""The matcher's answers over the rules test corpus, recorded once and compared since (issue 27).

Every job and fleet that the matcher tests (``tests/unit/test_matcher*.py``: the rule tables,
the health, profile and gang tests, the property tests' generated cases) and the fleet capacity
tests (cores, RAM, slots and shared GPU memory taken and given back) hand to ``match``,
``explain``, ``would_fit_when_idle``, ``match_gang`` and ``explain_gang`` is kept, with what each
of them answered, in ``tests/fixtures/matcher/golden.json.gz``
(gzip: 30 MB of JSON, mostly the property tests' fleets, in 430 kB); ``test_matcher_golden.py`` asks again
and wants the same answers, summaries and reasons word for word.

Recording is a pytest plugin; re-record only when a change to the words is meant:

    .venv/bin/pytest -q -p tests.matcher_golden tests/unit/test_matcher*.py \
        tests/unit/placement/test_fleet_capacity.py

New cases for a new rule are added without asking the recorded ones again (their answers stay as
they were recorded, and the comparison keeps checking them): record only the new test file with
``GPULAYER_GOLDEN_MERGE=1``, e.g. ``GPULAYER_GOLDEN_MERGE=1 .venv/bin/pytest -q -p
tests.matcher_golden tests/unit/test_matcher_containers.py`` (issue 28 added its cases so).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from gpulayer_contracts.capabilities import WorkerCapabilities
from gpulayer_contracts.jobs import JobRequest
from gpulayer_matching.gang import GangPlacement
from gpulayer_matching.matcher import NodeView, NoPlacement, Placement

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "matcher" / "golden.json.gz"


class Case(msgspec.Struct, frozen=True, kw_only=True):
    """One question and the answers it got. ``call``: which function was asked."""

    call: str
    job: JobRequest
    nodes: list[NodeView] = []
    caps: WorkerCapabilities | None = None  # would_fit_when_idle on bare capabilities
    found: int | None = None  # explain_gang's ``found``
    placement: Placement | None = None
    gang: GangPlacement | None = None
    explained: NoPlacement | None = None
    fits: bool | None = None


def ask(case: Case) -> Case:
    """``case`` with the answers the matcher gives now."""
    from gpulayer_matching import explain, match, would_fit_when_idle
    from gpulayer_matching.gang import explain_gang, match_gang

    job, nodes = case.job, case.nodes
    if case.call in ("match", "explain"):
        # Both, whichever was asked: explain's words and match's choice of node and devices.
        decision = match(job, nodes)
        return Case(
            call=case.call,
            job=job,
            nodes=nodes,
            placement=decision if isinstance(decision, Placement) else None,
            explained=explain(job, nodes),
        )
    if case.call == "would_fit_when_idle":
        target: NodeView | WorkerCapabilities = case.caps if case.caps is not None else nodes[0]
        return Case(
            call=case.call,
            job=job,
            nodes=nodes,
            caps=case.caps,
            fits=would_fit_when_idle(job, target),
        )
    if case.call == "match_gang":
        gang = match_gang(job, nodes)
        return Case(
            call=case.call,
            job=job,
            nodes=nodes,
            gang=gang if isinstance(gang, GangPlacement) else None,
            explained=gang if isinstance(gang, NoPlacement) else None,
        )
    if case.call == "explain_gang":
        return Case(
            call=case.call,
            job=job,
            nodes=nodes,
            found=case.found,
            explained=explain_gang(job, nodes, found=case.found),
        )
    raise ValueError(f"unknown call {case.call!r}")


def load() -> list[Case]:
    return msgspec.json.decode(gzip.decompress(GOLDEN.read_bytes()), type=list[Case])


# --- recording (a pytest plugin: ``-p tests.matcher_golden``) ---

_asked: dict[bytes, Case] = {}


def _keep(case: Case) -> None:
    raw = msgspec.json.encode(case)
    _asked.setdefault(hashlib.sha256(raw).digest(), case)


def _recording(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(job: JobRequest, nodes: Any, **kw: Any) -> Any:
        if name == "would_fit_when_idle":
            if isinstance(nodes, NodeView):
                _keep(Case(call=name, job=job, nodes=[nodes]))
            else:
                _keep(Case(call=name, job=job, caps=nodes))
        else:
            found = kw.get("found") if name == "explain_gang" else None
            _keep(Case(call=name, job=job, nodes=list(nodes), found=found))
        return fn(job, nodes, **kw)

    return wrapper


def _write() -> None:
    asked = list(_asked.values())
    cases = [ask(c) for c in asked]
    if os.environ.get("GPULAYER_GOLDEN_MERGE") == "1" and GOLDEN.exists():
        kept = load()
        seen = {msgspec.json.encode(c) for c in kept}
        cases = kept + [c for c in cases if msgspec.json.encode(c) not in seen]
    cases.sort(key=lambda c: msgspec.json.encode(c))
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same answers give the same bytes, so a re-record shows no spurious change.
    GOLDEN.write_bytes(gzip.compress(msgspec.json.encode(cases), compresslevel=9, mtime=0))


def _install(modules: Sequence[Any], names: Sequence[str]) -> None:
    for name in names:
        original = getattr(modules[0], name)
        wrapped = _recording(name, original)
        for module in modules:
            if getattr(module, name, None) is original:
                setattr(module, name, wrapped)


def pytest_configure(config: Any) -> None:
    import gpulayer_matching
    import gpulayer_matching.gang as gang
    import gpulayer_matching.matcher as matcher

    # Before the test modules import them: they bind the names at import.
    _install([matcher, gpulayer_matching], ["match", "explain", "would_fit_when_idle"])
    _install([gang], ["match_gang", "explain_gang"])


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    # The comparison itself would only ask the recorded questions again.
    return True if collection_path.name == "test_matcher_golden.py" else None


def pytest_unconfigure(config: Any) -> None:
    _write()
