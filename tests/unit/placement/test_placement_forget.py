"""Forgetting a node alone: what the reply says was released, from the jobs lost and the fence
rows deleted (the forget itself runs against PostgreSQL: tests/integration)."""

from __future__ import annotations

from gpulayer_placement.forget import released


def fence(grant: str, kind: str, resource: str, amount: int) -> dict[str, object]:
    return {
        "grant_id": grant,
        "job_id": f"job-{grant}",
        "kind": kind,
        "resource": resource,
        "amount": amount,
    }


def test_a_forgotten_node_says_which_jobs_it_lost_and_which_grants_and_devices_it_freed() -> None:
    fences = [
        fence("g2", "device", "exclusive", 1),
        fence("g1", "device", "shared", 0),
        fence("g1", "device", "shared", 0),  # two rows for one device: shown once
        fence("g1", "reservation", "cpu", 4000),  # 4 cores: not a device 4000
    ]
    out = released("gpu-7", 3600.4, ["train-3"], fences)
    assert (out["grants_released"], out["devices_released"]) == (["g1", "g2"], [0, 1])
    assert out["silent_s"] == 3600.4
    assert out["summary"] == (
        "node gpu-7 forgotten after 3600 s of silence: 1 job(s) lost (train-3); "
        "2 grant(s) released (devices 0, 1)"
    )


def test_a_node_that_held_nothing_says_so() -> None:
    out = released("gpu-7", 20.0, [], [])
    assert out["summary"] == (
        "node gpu-7 forgotten after 20 s of silence: no job lost; nothing was held there"
    )
    assert out["jobs_lost"] == out["grants_released"] == out["devices_released"] == []
