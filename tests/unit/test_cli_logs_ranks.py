"""`gpulayer logs` of a distributed job reads its ranks from the job's `placed` event."""

from __future__ import annotations

import msgspec

from gpulayer_cli.logs import _placed_ranks
from gpulayer_contracts.codec import encode
from gpulayer_contracts.events import Placed, RankPlacement, Running


def test_the_ranks_of_a_placed_gang_in_rank_order() -> None:
    placed = Placed(
        job_id="j",
        node_id="b",
        accelerator="cpu",
        ranks=[
            RankPlacement(rank=1, node_id="a", job_id="j-rank1"),
            RankPlacement(rank=0, node_id="b", job_id="j-rank0"),
        ],
    )
    assert _placed_ranks(encode(placed)) == [(0, "j-rank0"), (1, "j-rank1")]


def test_other_events_and_garbage_name_no_ranks() -> None:
    assert _placed_ranks(encode(Placed(job_id="j", node_id="a", accelerator="cpu"))) is None
    assert _placed_ranks(encode(Running(job_id="j", node_id="a"))) is None
    assert _placed_ranks(b"\x00not json") is None
    assert _placed_ranks(b"[1, 2]") is None
    bad = {"type": "placed", "ranks": [{"rank": "0", "job_id": 3}, 7, {"rank": 1}]}
    assert _placed_ranks(msgspec.json.encode(bad)) is None
