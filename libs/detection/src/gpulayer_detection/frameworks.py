"""Frameworks of the workload interpreter, read in a subprocess of that interpreter.

The interpreter a job will run with is usually not the probe's own. It is asked in a subprocess,
under a timeout, so that a broken or hanging install can neither crash nor stall the probe.

Two steps: versions come from package metadata (fast; nothing is imported), then, only where
torch is installed, a separate and slower query imports torch and asks what it can drive. The
service runs the second in the background so it never delays the first publish.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from gpulayer_detection.base import Finding, ProbeContext
from gpulayer_detection.runner import Runner, resolve

# Framework -> distributions that provide it, first match wins. Variant builds matter (the GPU
# build of onnxruntime is another distribution), so the one found is named in a note.
FRAMEWORK_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "jax": ("jax",),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-macos"),
    "mlx": ("mlx",),
    "cupy": ("cupy", "cupy-cuda12x", "cupy-cuda11x", "cupy-cuda13x"),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml"),
    "tensorrt": ("tensorrt", "tensorrt-cu12", "tensorrt-cu11"),
    "triton": ("triton", "pytorch-triton", "pytorch-triton-rocm"),
    "vllm": ("vllm",),
    "transformers": ("transformers",),
    "numpy": ("numpy",),
}

LAUNCHERS: tuple[str, ...] = ("torchrun", "mpirun", "mpiexec", "deepspeed", "accelerate")

MARKER = "GPULAYER_PROBE_RESULT "

# Runs in the workload interpreter, which may be old: keep it Python 3.6-compatible, import
# nothing but the standard library, and never import a framework. Versions come from the
# `<name>-<version>.dist-info` folder names on sys.path (the same first-on-path-wins lookup
# importlib.metadata does, without the ~40 ms of importing it); importlib.metadata is asked only
# for what a folder name can't settle (egg-info, two dist-infos for one name in one folder).
METADATA_SCRIPT = """
import json, os, platform, re, sys
wanted = json.loads(sys.argv[1])
def norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()
seen, ask = {}, set()
for folder in sys.path:
    try:
        entries = os.listdir(folder or ".")
    except OSError:
        continue
    here = {}
    for entry in entries:
        if entry.endswith(".dist-info"):
            name, sep, version = entry[:-10].partition("-")
            if sep and version:
                here.setdefault(norm(name), []).append(version)
        elif entry.endswith(".egg-info"):
            name = norm(entry[:-9].split("-")[0])
            if name not in seen:
                ask.add(name)
    for name, versions in here.items():
        if name in seen or name in ask:
            continue
        if len(versions) == 1:
            seen[name] = versions[0]
        else:
            ask.add(name)
out = {"python_version": platform.python_version(), "executable": sys.executable,
       "frameworks": {}, "errors": []}
md = None
for fw, dists in sorted(wanted.items()):
    for dist in dists:
        key = norm(dist)
        if key in ask:
            if md is None:
                try:
                    from importlib import metadata as md
                except ImportError:
                    out["errors"].append("%s: no importlib.metadata to read it" % dist)
                    continue
            try:
                out["frameworks"][fw] = {"version": md.version(dist), "dist": dist}
                break
            except Exception as e:
                out["errors"].append("%s: %s: %s" % (dist, type(e).__name__, e))
        elif key in seen:
            out["frameworks"][fw] = {"version": seen[key], "dist": dist}
            break
sys.stdout.write("\\n%s%s\\n" % (%r, json.dumps(out)))
""".replace("(%r,", f"({MARKER!r},")

# Imports torch: slow (seconds), and may hang or crash on a broken install.
TORCH_SCRIPT = """
import json, sys
out = {}
def attempt(key, fn):
    try:
        out[key] = fn()
    except Exception as e:
        out.setdefault("errors", []).append("%s: %s: %s" % (key, type(e).__name__, e))
try:
    import torch
except Exception as e:
    out["import_error"] = "%s: %s" % (type(e).__name__, e)
else:
    out["version"] = str(torch.__version__)
    attempt("cuda_build", lambda: torch.version.cuda)
    attempt("cuda", lambda: bool(torch.cuda.is_available()))
    attempt("cuda_device_count", lambda: int(torch.cuda.device_count()))
    attempt("mps", lambda: bool(torch.backends.mps.is_available()))
    def dist():
        import torch.distributed as d
        if not d.is_available():
            return {}
        return {"gloo": bool(d.is_gloo_available()), "nccl": bool(d.is_nccl_available()),
                "mpi": bool(d.is_mpi_available())}
    attempt("distributed", dist)
sys.stdout.write("\\n%s%s\\n" % (%r, json.dumps(out)))
""".replace("(%r,", f"({MARKER!r},")


class ReportError(ValueError):
    pass


def _report(stdout: str) -> dict[str, object]:
    lines = [line for line in stdout.splitlines() if line.startswith(MARKER)]
    if not lines:
        raise ReportError("the interpreter printed no result")
    try:
        data = json.loads(lines[-1][len(MARKER) :])
    except json.JSONDecodeError as err:
        raise ReportError(f"unreadable result: {err}") from None
    if not isinstance(data, dict):
        raise ReportError("unreadable result: not an object")
    return data


@dataclass(frozen=True, slots=True)
class MetadataReport:
    python_version: str | None
    frameworks: dict[str, str]
    distributions: dict[str, str]
    errors: list[str] = field(default_factory=list)


def parse_metadata_report(stdout: str) -> MetadataReport:
    """The metadata script's result. Raises ReportError when there is none."""
    data = _report(stdout)
    frameworks: dict[str, str] = {}
    distributions: dict[str, str] = {}
    raw = data.get("frameworks")
    for name, info in raw.items() if isinstance(raw, dict) else ():
        if isinstance(info, dict) and isinstance(info.get("version"), str):
            frameworks[str(name)] = info["version"]
            distributions[str(name)] = str(info.get("dist") or name)
    version = data.get("python_version")
    errors = data.get("errors")
    return MetadataReport(
        python_version=version if isinstance(version, str) else None,
        frameworks=frameworks,
        distributions=distributions,
        errors=[str(e) for e in errors] if isinstance(errors, list) else [],
    )


@dataclass(frozen=True, slots=True)
class TorchFacts:
    version: str | None = None
    cuda: bool | None = None
    cuda_build: str | None = None
    cuda_device_count: int | None = None
    mps: bool | None = None
    backends: dict[str, bool] | None = None
    import_error: str | None = None
    errors: list[str] = field(default_factory=list)


def parse_torch_report(stdout: str) -> TorchFacts:
    data = _report(stdout)

    def opt_bool(key: str) -> bool | None:
        v = data.get(key)
        return v if isinstance(v, bool) else None

    dist = data.get("distributed")
    backends = (
        {str(k): bool(v) for k, v in dist.items() if isinstance(v, bool)}
        if isinstance(dist, dict)
        else None
    )
    count = data.get("cuda_device_count")
    errors = data.get("errors")
    return TorchFacts(
        version=str(data["version"]) if isinstance(data.get("version"), str) else None,
        cuda=opt_bool("cuda"),
        cuda_build=str(data["cuda_build"]) if isinstance(data.get("cuda_build"), str) else None,
        cuda_device_count=count if isinstance(count, int) else None,
        mps=opt_bool("mps"),
        backends=backends,
        import_error=str(data["import_error"]) if data.get("import_error") else None,
        errors=[str(e) for e in errors] if isinstance(errors, list) else [],
    )


def torch_finding(facts: TorchFacts) -> Finding:
    """What the torch query means for placement: capabilities, backends, and notes."""
    found = Finding("torch")
    if facts.import_error is not None:
        found.note(f"installed but `import torch` failed: {facts.import_error}")
        return found
    for err in facts.errors:
        found.note(f"query error: {err}")
    if facts.cuda:
        found.framework_capabilities.append("torch.cuda")
    elif facts.cuda is None:
        found.note("torch.cuda availability unknown")
    elif facts.cuda_build:
        found.note(f"built for CUDA {facts.cuda_build} but torch.cuda.is_available() is False")
    if facts.mps:
        found.framework_capabilities.append("torch.mps")
    elif facts.mps is None:
        found.note("torch.mps availability unknown")
    if facts.backends is None:
        found.note("distributed backends unknown")
    else:
        found.distributed_backends = sorted(k for k, ok in facts.backends.items() if ok)
        if not facts.backends:
            found.note("torch.distributed is not available in this build")
    return found


def find_launchers(python: str | None, path: str | None) -> list[str]:
    """Launchers on PATH or next to the workload interpreter (a venv's bin holds its torchrun)."""
    dirs = [] if path is None else path.split(os.pathsep)
    if python and os.sep in python:
        dirs.insert(0, os.path.dirname(python))
    search = os.pathsep.join(d for d in dirs if d) if dirs else None
    return [name for name in LAUNCHERS if resolve(name, search) is not None]


class FrameworksProbe:
    """Versions from package metadata of the workload interpreter; launchers on PATH."""

    name = "frameworks"

    def __init__(self, path: str | None = None) -> None:
        self._path = path

    async def probe(self, ctx: ProbeContext) -> Finding:
        found = Finding(self.name)
        python = ctx.python
        if python is None:
            found.note("not probed: no workload interpreter given")
            return found
        found.workload_python = python
        found.launchers = find_launchers(python, self._path)
        wanted = json.dumps({k: list(v) for k, v in FRAMEWORK_DISTRIBUTIONS.items()})
        result = await ctx.run([python, "-c", METADATA_SCRIPT, wanted], ctx.timeout)
        if result.error is not None:
            found.note(f"unknown: workload interpreter {python}: {result.error}")
            return found
        try:
            report = parse_metadata_report(result.stdout)
        except ReportError as err:
            found.note(f"unknown: workload interpreter {python}: {err} ({result.describe()})")
            return found
        found.workload_python_version = report.python_version
        found.frameworks = report.frameworks
        for name, dist in sorted(report.distributions.items()):
            if dist != name:
                found.note(f"{name} is provided by the {dist} distribution")
        for problem in report.errors:
            found.note(f"metadata error: {problem}")
        if not report.frameworks:
            found.note(f"none of {', '.join(FRAMEWORK_DISTRIBUTIONS)} installed in {python}")
        return found


async def query_torch(python: str, run: Runner, timeout: float) -> Finding:
    """Import torch in the workload interpreter and ask what it can drive (bounded by timeout)."""
    result = await run([python, "-c", TORCH_SCRIPT], timeout)
    if result.error is not None:
        found = Finding("torch")
        found.note(
            f"capability query failed ({result.error}); torch.cuda, torch.mps and "
            "distributed backends unknown"
        )
        return found
    try:
        facts = parse_torch_report(result.stdout)
    except ReportError as err:
        found = Finding("torch")
        found.note(
            f"capability query failed ({err}; {result.describe()}); torch.cuda, torch.mps "
            "and distributed backends unknown"
        )
        return found
    return torch_finding(facts)
