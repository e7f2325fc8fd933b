"""Container runtime: a job that names an image (``container``) runs only where the node's probe
found a container runtime and its self-test started a container there."""

from __future__ import annotations

from gpulayer_matching.facts import Facts
from gpulayer_matching.plan import Gpu, Plan
from gpulayer_matching.rules.base import NodeRule, Outcome, Tally
from gpulayer_matching.verdicts import Fail

# A self-test's note is shown in reasons: its first line, this long at most; a longer one keeps
# its start (what was run) and its end (runc and podman put the cause last).
_NOTE_CHARS = 200
_HEAD_CHARS = 60


def _none_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", "no container runtime"


def _failed_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    shown = "; ".join(t.seen[:2])
    more = f" (and {len(t.seen) - 2} other notes)" if len(t.seen) > 2 else ""
    return "have", f"a container runtime that failed its self-test: {shown}{more}"


NONE = Outcome("no_container_runtime", 45, "container", "container runtime", _none_words)
FAILED = Outcome("container_runtime_failed", 46, "container", "container runtime", _failed_words)


def _why(notes: list[str]) -> str:
    note = next((n for n in notes if n.startswith("self-test failed")), None)
    if note is None:
        note = notes[-1] if notes else "no reason given"
    note = note.splitlines()[0] if note.strip() else "no reason given"
    if len(note) <= _NOTE_CHARS:
        return note
    return f"{note[:_HEAD_CHARS]} ... {note[-(_NOTE_CHARS - _HEAD_CHARS - 5) :]}"


def check(plan: Plan, facts: Facts, gpu: Gpu, as_cpu: bool) -> Fail | None:
    if plan.container:
        runtime = facts.caps.container_runtime
        if runtime is None:
            return Fail(NONE.rank, NONE.name)
        if not runtime.works:
            return Fail(FAILED.rank, FAILED.name, _why(runtime.notes))
    return None


RULE = NodeRule("container_runtime", (NONE, FAILED), check)
