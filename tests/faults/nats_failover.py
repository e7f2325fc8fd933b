"""``python -m tests.faults.nats_failover [--role ROLE] [--signal kill|term] [--runs N]``: how
long each R3 stream takes no writes after one NATS server of three goes away.

Three ``EmbeddedNatsCluster`` servers (no auth), gpulayer's streams at R3, one client connected
to all three URLs writing to every stream each 50 ms (``tests/faults/write_gaps.py``). The server
stopped is the one holding ``--role``: ``stream-leader`` (of ``--stream``, JOB_EVENTS by
default), ``meta-leader``, ``follower`` (neither of those), or ``client`` (the one the client is
connected to). ``--signal kill`` is SIGKILL (a crash), ``term`` a clean stop. ``--verbose`` logs
every publish with its monotonic times; the summary gives each stream's write gap, ``*`` where
the stopped server was the stream's leader.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.faults.write_gaps import Gap, WriteProbe, close, placements, targets

from gpulayer_contracts.subjects import STREAMS
from gpulayer_runtime.nats import connect, ensure_streams
from gpulayer_runtime.servers import EmbeddedNats, EmbeddedNatsCluster

ROLES = ("stream-leader", "meta-leader", "follower", "client")


def name_of(server: EmbeddedNats) -> str:
    assert server.cluster is not None
    return server.cluster.server_name


def meta_leader(server: EmbeddedNats) -> str:
    url = f"http://{server.host}:{server.monitor_port}/jsz"
    with urllib.request.urlopen(url, timeout=2) as reply:  # our own, on loopback
        return str((json.loads(reply.read()).get("meta_cluster") or {}).get("leader"))


async def once(role: str, stream: str, sig: int, verbose: bool) -> dict[str, tuple[Gap, bool]]:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = EmbeddedNatsCluster(Path(tmp)).start()
        nc = await connect(cluster.url, "nats-failover")
        try:
            js = nc.jetstream()
            async with asyncio.timeout(60):
                while True:
                    try:
                        await ensure_streams(js, replicas=3)
                        break
                    except Exception:  # no meta leader yet
                        await asyncio.sleep(0.25)
            names = [s.name for s in STREAMS]
            groups = await placements(js, names)
            for name, group in groups.items():
                print(f"  {name}: R{group.replicas}, {group.peers} peers, leader {group.leader}")
            leaders = {name: group.leader for name, group in groups.items()}
            meta = meta_leader(cluster.servers[0])
            by_name = {name_of(s): s for s in cluster.servers}
            assert nc.connected_url is not None
            client = next(s for s in cluster.servers if s.port == nc.connected_url.port)
            victim = {
                "stream-leader": by_name[leaders[stream]],
                "meta-leader": by_name[meta],
                "client": client,
                "follower": next(
                    (s for n, s in by_name.items() if n not in (meta, leaders[stream])), client
                ),
            }[role]
            vname = name_of(victim)
            led = sorted(n for n, leader in leaders.items() if leader == vname)
            print(
                f"  stopping {vname} ({role}, {signal.Signals(sig).name}): meta leader "
                f"{meta}, client on {name_of(client)}, {vname} leads {', '.join(led) or 'none'}"
            )
            t0 = time.monotonic()

            def show(s: str, sent: float, done: float, outcome: str) -> None:
                print(f"{done - t0:8.3f} {s:<10} sent {sent - t0:8.3f} {outcome}")

            probe = WriteProbe(js, targets(names), on_outcome=show if verbose else None)
            async with probe:
                await probe.until_started()
                assert victim.proc is not None
                probe.mark()
                victim.proc.send_signal(sig)
                await asyncio.to_thread(victim.proc.wait)
                await probe.until_written(30.0)
            return {s: (g, leaders[s] == vname) for s, g in probe.gaps().items()}
        finally:
            await close(nc)
            cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", choices=ROLES, default="stream-leader")
    parser.add_argument("--stream", default="JOB_EVENTS")
    parser.add_argument("--signal", choices=("kill", "term"), default="kill")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    sig = signal.SIGKILL if args.signal == "kill" else signal.SIGTERM
    led: list[float] = []
    others: list[float] = []
    for run in range(args.runs):
        print(f"run {run + 1}:")
        gaps = asyncio.run(once(args.role, args.stream, sig, args.verbose))
        for _, (gap, was_led) in sorted(gaps.items()):
            (led if was_led else others).append(gap.seconds)
            print(f"  {'*' if was_led else ' '} {gap.line()}")
    for what, values in (("led by the stopped server", led), ("led elsewhere", others)):
        if values:
            print(
                f"write gap of streams {what}: min {min(values):.2f} s, "
                f"max {max(values):.2f} s over {len(values)}"
            )


if __name__ == "__main__":
    main()
