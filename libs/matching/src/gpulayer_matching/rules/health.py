"""Health: devices the probe saw unhealthy or degraded (and a sick GPU's MIG instances) get no
new grant (``NodeView.sick``). A node is counted here when it would take the job but for them;
the placement step keeps them out (``place``)."""

from __future__ import annotations

from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import Outcome, Rule, Tally, seen_all
from gpulayer_matching.views import NodeView


def _words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", (
        f"GPUs kept from new grants by their health (unhealthy or degraded){seen_all(t)}"
    )


UNHEALTHY = Outcome("unhealthy", 40_050, "health", "health", _words)


def sick_reasons(view: NodeView) -> list[str]:
    """``<node> GPU <i>: <health reason>`` for each sick device, in index order."""
    return [
        f"{view.node_id} GPU {i}: {view.health.get(i, 'unhealthy')}" for i in sorted(view.sick)
    ][:8]


RULE = Rule("health", (UNHEALTHY,))
