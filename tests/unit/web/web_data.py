"""Plain API data shaped as placement answers it, for the web service's unit tests."""

from __future__ import annotations

from typing import Any


def node(node_id: str = "gpu-01", **over: Any) -> dict[str, Any]:
    devices = [
        {"accelerator": "cuda", "index": i, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
         "compute_capability": "9.0", "driver_version": "550.54.15", "execution_supported": True}
        for i in range(4)
    ]  # fmt: skip
    base: dict[str, Any] = {
        "node_id": node_id,
        "online": True,
        "executor": "up",
        "last_seen": "2026-12-01T10:00:00+00:00",
        "busy_devices": [0],
        "resources": {"cores": 64.0, "cores_used": 8.0, "memory_gb": 512.0, "memory_gb_used": 32.0},
        "capabilities": {
            "host": {"platform": "linux-x86_64"},
            "accelerators": devices,
            "gpu_apis": {
                "host": ["cuda", "vulkan"],
                "containers": ["cuda"],
                "evidence": {"cuda": "nvidia-smi: driver 550.54.15", "vulkan": "vulkaninfo: GPU"},
            },
        },
        "health": {
            "health": "degraded",
            "devices": [
                {"index": 0, "health": "healthy"},
                {"index": 1, "health": "healthy"},
                {"index": 2, "health": "unhealthy", "reason": "uncorrectable ECC errors: 3"},
                {"index": 3, "health": "healthy"},
            ],
            "held_back": {"2": "unhealthy: uncorrectable ECC errors: 3"},
        },
    }
    return base | over


def job(job_id: str, state: str = "pending", owner: str = "alice", **over: Any) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "state": state,
        "owner": owner,
        "priority": 0,
        "submitted_at": "2026-12-01T10:00:00+00:00",
        "node_id": None,
        "devices": [],
        "reason": None,
        "owner_usage_gpu_s": 0.0,
    } | over
