"""How the CLI shows a distributed job (issue 14): its placed event with every rank, its ranks'
table under ``gpulayer job``, and the job list's node column."""

from __future__ import annotations

import io

from rich.console import Console

from gpulayer_cli.render import describe_event, jobs_table, ranks_table
from gpulayer_contracts.events import Placed, RankPlacement


def text(renderable: object) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def test_a_gangs_placed_event_names_every_rank() -> None:
    placed = Placed(
        job_id="g",
        node_id="b",
        accelerator="cuda",
        devices=[0],
        ranks=[
            RankPlacement(rank=0, node_id="b", job_id="g-rank0", devices=[0]),
            RankPlacement(rank=1, node_id="a", job_id="g-rank1", devices=[2, 3]),
        ],
    )
    assert describe_event(placed) == (
        "placed on 2 nodes (cuda): rank 0 on b (devices 0), rank 1 on a (devices 2,3)"
    )


def test_the_ranks_table_shows_each_ranks_node_devices_state_and_exit() -> None:
    shown = text(
        ranks_table(
            [
                {
                    "rank": 0,
                    "job_id": "g-rank0",
                    "node_id": "b",
                    "devices": [0],
                    "state": "cancelled",
                    "exit_code": None,
                    "reason": None,
                },
                {
                    "rank": 1,
                    "job_id": "g-rank1",
                    "node_id": "a",
                    "devices": [1],
                    "state": "failed",
                    "exit_code": 3,
                    "reason": None,
                },
            ]
        )
    )
    rows = [line for line in shown.splitlines() if "g-rank" in line]
    assert [line.split() for line in rows] == [
        ["│", "0", "│", "g-rank0", "│", "b", "│", "0", "│", "cancelled", "│", "-", "│", "│"],
        ["│", "1", "│", "g-rank1", "│", "a", "│", "1", "│", "failed", "│", "3", "│", "│"],
    ]


def test_the_job_list_says_distributed_where_a_node_would_be() -> None:
    shown = text(jobs_table([{"job_id": "g", "state": "running", "is_gang": True}]))
    assert "(distributed)" in shown
