"""``gpulayer probe``: what this machine can do, as JSON, for a person at the node.

This is an edge: it reads GPULAYER_NODE_ID (default: the hostname), GPULAYER_PROBE_PODMAN (none: don't
look for a container runtime), GPULAYER_OCI_RUNTIME and GPULAYER_PROBE_HOST_ROOT (where the host's
/proc, /sys, /dev and /usr/lib/wsl are read), and passes plain values in.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import msgspec

from gpulayer_contracts import encode
from gpulayer_contracts.capabilities import WorkerCapabilities
from gpulayer_runtime.settings import default_node_id, number_option


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpulayer probe",
        description="Detect this machine's GPUs, drivers, GPU APIs and frameworks; print JSON.",
    )
    p.add_argument(
        "--python",
        metavar="PATH",
        help="workload interpreter whose frameworks are reported (default: this one)",
    )
    p.add_argument(
        "--gpu-apis",
        action="store_true",
        help='print only {"host", "containers", "evidence", "platform", "agent_version"}',
    )
    p.add_argument(
        "--no-torch", action="store_true", help="skip the (slower) torch capability query"
    )
    p.add_argument(
        "--timeout",
        type=number_option(),
        default=10.0,
        metavar="S",
        help="limit for each detection source, seconds (default 10)",
    )
    p.add_argument(
        "--torch-timeout",
        type=number_option(),
        default=60.0,
        metavar="S",
        help="limit for the torch query, seconds (default 60)",
    )
    return p


def gpu_apis_view(caps: WorkerCapabilities) -> dict[str, Any]:
    """The ``--gpu-apis`` shape other agents use."""
    return {
        "host": list(caps.gpu_apis.host),
        "containers": list(caps.gpu_apis.containers),
        "evidence": dict(caps.gpu_apis.evidence),
        "platform": caps.host.platform,
        "agent_version": caps.agent_version,
    }


def main(argv: list[str]) -> int:
    """Run ``gpulayer probe`` with ``argv`` (without the program name); returns the exit code."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return exc.code if isinstance(exc.code, int) else 2
    from gpulayer_detection.containers import ContainerSettings, settings_from_env
    from gpulayer_detection.registry import detect_capabilities, host_root_from_env

    try:
        # --gpu-apis answers about GPU APIs alone: no container self-test for it.
        containers = (
            ContainerSettings(podman=None) if args.gpu_apis else settings_from_env(os.environ)
        )
        root = host_root_from_env(os.environ)
    except ValueError as err:
        print(f"gpulayer probe: {err}", file=sys.stderr)
        return 2
    node = os.environ.get("GPULAYER_NODE_ID", "").strip() or default_node_id()
    caps = asyncio.run(
        detect_capabilities(
            node,
            python=args.python,
            include_torch=not args.no_torch and not args.gpu_apis,
            include_frameworks=not args.gpu_apis,
            timeout=args.timeout,
            torch_timeout=args.torch_timeout,
            advertise_address=os.environ.get("GPULAYER_ADVERTISE_ADDRESS") or None,
            containers=containers,
            host_root=root,
        )
    )
    data = encode(gpu_apis_view(caps) if args.gpu_apis else caps)
    sys.stdout.write(msgspec.json.format(data, indent=2).decode() + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
