"""The queue policy's gate between the matcher and a placement: quotas and the reservation
(``admit``), reservation and preemption for a job that can't be placed (``blocked``), and the
cancels of preempted jobs once their marking is committed (``send_cancels``).
docs/placement-rules.md ("Order of decisions") is the rule."""

from __future__ import annotations

import logging
import math
from typing import Any

from gpulayer_contracts import CancelJob, JobRequest
from gpulayer_contracts.validation import requested_gpu_count
from gpulayer_matching import NoPlacement, Placement, match
from gpulayer_matching.resources import job_millicores, reservations
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.outcome import Outcome
from gpulayer_placement.policy import Policy
from gpulayer_placement.preemption import Active, choose_victims, with_placed, without
from gpulayer_placement.publisher import Publisher

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")

QUOTA_PREFIX = "owner "  # a quota reason starts so (quotas.over_quota)


def over_quota(decision: NoPlacement) -> bool:
    """Whether the job waits for its owner's quota (not for capacity)."""
    return bool(decision.reasons) and decision.reasons[0].startswith(QUOTA_PREFIX)


class Gate:
    def __init__(self, *, fleet: Fleet, policy: Policy, publisher: Publisher) -> None:
        self.fleet = fleet
        self.policy = policy
        self.publisher = publisher

    def admit(
        self, job_id: str, job: JobRequest, decision: Placement, owner: str, priority: int = 0
    ) -> Placement | NoPlacement:
        """The queue policy's word on a placement the matcher found: the owner's quota, then
        the reservation kept for a large job (another node, or wait)."""
        why = self.policy.over_quota(
            owner, len(decision.devices), decision.accelerator, job_millicores(job)
        )
        if why is not None:
            return NoPlacement(summary=why, reasons=[why], unsatisfiable=False)
        if self.policy.may_backfill(
            job_id, job, decision.node_id, len(decision.devices), priority
        ) or self._leaves_room(job, decision):
            return decision
        r = self.policy.reservation
        assert r is not None
        kept = r.kept()
        others = [v for v in self.fleet.views() if v.node_id not in kept]
        again = match(job, others)
        if isinstance(again, Placement):
            return again
        why = r.why()
        return NoPlacement(summary=why, reasons=[why, *again.reasons], unsatisfiable=False)

    def _leaves_room(self, job: JobRequest, decision: Placement) -> bool:
        """Whether placing ``job`` as ``decision`` on the node kept for a waiting job still lets
        that job start once the node's jobs that end before the reservation's time have ended:
        then it delays nobody (a MIG instance beside a job waiting for a whole GPU, a CPU-light
        job on a node with cores to spare). Single-node reservations only."""
        r = self.policy.reservation
        if r is None or r.job is None or r.nodes or r.node_id != decision.node_id:
            return False
        view = self.fleet.get(decision.node_id)
        if view is None:
            return False
        on_node = list(self.policy.by_node.get(decision.node_id, {}).values())
        gone = [a for a in on_node if a.ends_at <= r.until]
        rest = [a for a in on_node if a.ends_at > r.until]
        held = reservations(job, decision.devices, decision.use)
        placed = with_placed(view, decision.devices, decision.use == "shared", held)
        # The new job counts as one that outlives the reservation: devices it shares stay so.
        new = Active(
            job_id="",
            node_id=decision.node_id,
            owner="",
            accelerator=decision.accelerator,
            devices=tuple(decision.devices),
            shared=decision.use == "shared",
            priority=0,
            preemptible=False,
            started=0.0,
            ends_at=math.inf,
        )
        rest.append(new)
        after = without(placed, gone, rest, self.fleet.reserved_items)
        return isinstance(match(r.job, [after]), Placement)

    def blocked(
        self,
        row: Any,
        job: JobRequest,
        decision: NoPlacement,
        outcome: Outcome,
        *,
        reserve: bool = False,
    ) -> NoPlacement:
        """A job that can't be placed now: the first such in a full pass gets a reservation;
        a job of higher priority than some preemptible running job may preempt."""
        job_id = row["job_id"]
        if decision.unsatisfiable or requested_gpu_count(job) == 0:
            return decision
        if over_quota(decision):
            return decision  # over quota: neither reserves nor preempts
        priority = row.get("priority") or 0
        if reserve and self.policy.reservation is None:
            self.policy.reserve(
                job_id, job, self.fleet.views(), self.fleet.reserved_items, priority
            )
        if not self.policy.may_preempt(job_id, priority):
            return decision
        choice = choose_victims(
            job,
            priority,
            self.fleet.views(),
            self.policy.active_by_node(),
            self.fleet.reserved_items,
        )
        if choice is None:
            return decision
        victims = [v.job_id for v in choice.victims]
        self.policy.preempted(job_id, victims)
        outcome.preempt.append((job_id, priority, victims))
        why = (
            f"preempting {len(victims)} lower-priority job(s) on node {choice.node_id} "
            f"({', '.join(victims)}): placed once they stop"
        )
        return NoPlacement(summary=why, reasons=[why], unsatisfiable=False)

    async def send_cancels(self, outcome: Outcome) -> None:
        """The signed cancels of the jobs preempted in a committed outcome; their executors'
        'cancelled' reports requeue them (apply_status)."""
        for r in outcome.cancels:
            reason = f"preempted for job {r['preempted_for']} of higher priority; requeued"
            cancel = CancelJob(job_id=r["job_id"], reason=reason, grant_id=r["grant_id"])
            subject, payload, headers = self.publisher.cancel_item(r["node_id"], cancel)
            try:
                await self.publisher.js.publish(subject, payload, headers=headers)
            except Exception as err:  # the victim stays marked; its preemptor waits for it
                log.warning("cancel of preempted job %s not sent: %r", r["job_id"], err)
            log.info("job %s preempted for %s", r["job_id"], r["preempted_for"])
