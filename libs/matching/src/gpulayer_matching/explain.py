"""The explanation tally: which rule ruled out how many nodes, with each rule's nearest miss, in
the rules' own words. Built only when asked or when nothing fits."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from gpulayer_matching.capability import capability
from gpulayer_matching.facts import FACTS, facts_of
from gpulayer_matching.place import place
from gpulayer_matching.plan import Plan
from gpulayer_matching.registry import HOST_CHECKS, LIVE_RANK, OUTCOMES, outcome
from gpulayer_matching.rules.base import Tally
from gpulayer_matching.rules.health import UNHEALTHY, sick_reasons
from gpulayer_matching.views import NodeView, NoPlacement, Placement

__all__ = ["explain_plan"]

_VERBS = {"have": "has", "are": "is", "lack": "lacks", "can't": "can't"}


def explain_plan(plan: Plan, nodes: Sequence[NodeView]) -> NoPlacement:
    total = len(nodes)
    if plan.failure is not None:
        return NoPlacement(
            summary=f"0/{total} nodes can run this job: {plan.failure}",
            reasons=[plan.failure],
            unsatisfiable=True,
            total=total,
            ruled_out={"job": total},
        )
    if total == 0:
        return NoPlacement(
            summary="0/0 nodes can run this job: no nodes in the fleet",
            reasons=["no nodes in the fleet"],
            unsatisfiable=True,
        )
    tallies: dict[str, Tally] = {}
    fit = could = 0
    key = plan.key
    for view in nodes:
        caps = view.capabilities
        facts = FACTS.get(id(caps))
        if facts is None or facts.caps is not caps:
            facts = facts_of(caps)
        cap = facts.results.get(key)
        if cap is None:
            cap = capability(plan, facts)
        if not cap.ok:
            _count(tallies, cap.rank, cap.rule, view.node_id, cap.value)
            continue
        miss = None
        for check in HOST_CHECKS:  # host_miss, inline: once per node
            failed = check(plan, view)
            if failed is not None and (miss is None or failed.rank < miss.rank):
                miss = failed
        if miss is not None and miss.rank < LIVE_RANK:
            _count(tallies, miss.rank, miss.rule, view.node_id, miss.value)
            continue
        could += 1
        if miss is not None:
            _count(tallies, miss.rank, miss.rule, view.node_id, miss.value)
            continue
        placed = place(plan, cap, view)
        if isinstance(placed, Placement):
            fit += 1
        elif view.sick and isinstance(
            place(plan, cap, msgspec.structs.replace(view, sick=frozenset())), Placement
        ):
            # One node counted; every sick device's reason shown.
            reasons = sick_reasons(view)
            _count(tallies, UNHEALTHY.rank, UNHEALTHY.name, view.node_id, reasons[0])
            seen = tallies[UNHEALTHY.name].seen
            seen.extend(r for r in reasons[1:] if r not in seen)
        else:
            rank = OUTCOMES[placed.rule].rank
            _count(tallies, rank, placed.rule, view.node_id, placed.value)
    return _breakdown(plan, tallies, total, fit, could)


def _breakdown(
    plan: Plan, tallies: dict[str, Tally], total: int, fit: int, could: int
) -> NoPlacement:
    ordered = sorted(tallies.items(), key=lambda kv: kv[1].rank)
    reasons = [_reason(plan, rule, t) for rule, t in ordered]
    summary = f"{fit}/{total} nodes can run this job"
    if fit:
        summary += " now"
    if reasons:
        summary += (": " if not fit else "; ruled out: ") + ", ".join(reasons)
    return NoPlacement(
        summary=summary,
        reasons=reasons,
        unsatisfiable=could == 0,
        total=total,
        can_run_now=fit,
        could_run=could,
        ruled_out={rule: t.count for rule, t in ordered},
    )


def _count(tallies: dict[str, Tally], rank: int, rule: str, node_id: str, value: object) -> None:
    t = tallies.get(rule)
    if t is None:
        t = tallies[rule] = Tally(rank)
    t.count += 1
    if isinstance(value, str):
        if value not in t.seen:
            t.seen.append(value)
    elif isinstance(value, int):
        if not isinstance(t.best, int) or value > t.best:
            t.best, t.best_node = value, node_id
    elif isinstance(value, tuple) and (not isinstance(t.best, tuple) or value > t.best):
        t.best, t.best_node = value, node_id


def _reason(plan: Plan, rule: str, t: Tally) -> str:
    """``<count> <verb> <rest>`` in the rule's own words; the job's profile named when it
    supplied the requirement."""
    said = outcome(rule)
    verb, rest = said.words(plan, rule, t)
    text = f"{t.count} {verb if t.count != 1 else _VERBS[verb]} {rest}"
    if plan.profile is not None and said.field_of(rule) in plan.from_profile:
        text += f" (profile {plan.profile})"
    return text
