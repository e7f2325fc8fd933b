"""The bounds of a job request: ``job_bound_errors`` and its fast mirror for the common case."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sized

from gpulayer_contracts.bounds.checks import (
    JOB_ID,
    compute_capability_errors,
    count_errors,
    env_path,
    fits,
    opt_text_errors,
    range_error,
    show,
    text_errors,
    text_map_errors,
    texts_errors,
    utf8_len,
)
from gpulayer_contracts.bounds.limits import (
    ENV_NAME_PATTERN,
    MAX_AFTER,
    MAX_ARG_BYTES,
    MAX_ARGV_BYTES,
    MAX_ARGV_ITEMS,
    MAX_ARRAY_BYTES,
    MAX_ARRAY_COUNT,
    MAX_BACKOFF_S,
    MAX_DISTRIBUTED_NODES,
    MAX_ENV_BYTES,
    MAX_ENV_NAME_BYTES,
    MAX_ENV_VALUE_BYTES,
    MAX_ENV_VARS,
    MAX_GPU_COUNT,
    MAX_GPU_MEMORY_GB,
    MAX_IMAGE_REF_BYTES,
    MAX_JOB_CPU_CORES,
    MAX_JOB_ID_CHARS,
    MAX_JOB_MEMORY_GB,
    MAX_LIST_ITEMS,
    MAX_NAME_BYTES,
    MAX_PRIORITY,
    MAX_PROCESSES_PER_NODE,
    MAX_RETRIES,
    MAX_SHORT_TEXT_BYTES,
    MAX_TIMEOUT_S,
)
from gpulayer_contracts.jobs import (
    IMAGE_REF_PATTERN,
    JOB_ID_PATTERN,
    PROFILE_REF_PATTERN,
    RANK_SUFFIX,
    Distributed,
    GpuUsage,
    JobRequest,
    Requirements,
    rank_job_id,
)

_ENV_NAME = re.compile(ENV_NAME_PATTERN)
_PROFILE_REF = re.compile(PROFILE_REF_PATTERN.removeprefix("^").removesuffix("$"))
_IMAGE_REF = re.compile(IMAGE_REF_PATTERN.removeprefix("^").removesuffix("$"))


def _image_ref_fits(image: object) -> bool:
    return (
        isinstance(image, str)
        and len(image) <= MAX_IMAGE_REF_BYTES
        and _IMAGE_REF.fullmatch(image) is not None
    )


def job_bound_errors(job: JobRequest) -> list[str]:
    """Every hard bound ``job`` breaks, each naming the field path and the limit."""
    if _within_bounds(job):
        return []  # the common case, without building a path per field
    return list(_job_bounds(job))


def _within_bounds(job: JobRequest) -> bool:
    """True when ``_job_bounds`` would find nothing; False means: look closer. Checked on every
    submit, so it is the fast mirror of ``_job_bounds`` (tests/unit/test_bounds.py compares the
    two on generated jobs)."""
    if not isinstance(job.job_id, str) or not JOB_ID.fullmatch(job.job_id):
        return False
    if job.name is not None and not fits(job.name, MAX_NAME_BYTES):
        return False
    command, env = job.command, job.env
    if len(command) > MAX_ARGV_ITEMS or len(env) > MAX_ENV_VARS:
        return False
    argv_bytes = 0
    for arg in command:
        if not fits(arg, MAX_ARG_BYTES):
            return False
        argv_bytes += len(arg) if arg.isascii() else utf8_len(arg)
    if argv_bytes > MAX_ARGV_BYTES:
        return False
    env_bytes = 0
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name) or len(name) > MAX_ENV_NAME_BYTES:
            return False
        if not fits(value, MAX_ENV_VALUE_BYTES):
            return False
        env_bytes += len(name) + 1 + (len(value) if value.isascii() else utf8_len(value))
    if env_bytes > MAX_ENV_BYTES:
        return False
    return _numbers_and_short_texts_fit(job)


def _numbers_and_short_texts_fit(job: JobRequest) -> bool:
    if job.timeout_s is not None and range_error(
        "", job.timeout_s, 0, MAX_TIMEOUT_S, low_open=True
    ):
        return False
    req = job.requirements
    if range_error("", req.gpu_count, 0, MAX_GPU_COUNT):
        return False
    if req.gpu_memory_gb is not None and range_error(
        "", req.gpu_memory_gb, 0, MAX_GPU_MEMORY_GB, low_open=True
    ):
        return False
    if req.min_cuda_compute_capability is not None and any(
        compute_capability_errors("", req.min_cuda_compute_capability)
    ):
        return False
    if range_error("", req.cpu_cores, 0, MAX_JOB_CPU_CORES, low_open=True) or range_error(
        "", req.memory_gb, 0, MAX_JOB_MEMORY_GB, low_open=True
    ):
        return False
    short = MAX_SHORT_TEXT_BYTES
    texts: list[str] = [*req.frameworks, *req.frameworks.values(), *req.framework_capabilities]
    lists: list[Sized] = [req.frameworks, req.framework_capabilities]
    texts += [v for v in (req.python, req.driver, req.os) if v is not None]
    texts += job.profile_fields
    lists.append(job.profile_fields)
    if job.profile is not None and not (
        isinstance(job.profile, str) and _PROFILE_REF.fullmatch(job.profile)
    ):
        return False
    if job.container is not None and not _image_ref_fits(job.container.image):
        return False
    gpus = [job.gpu or GpuUsage(), *(v.gpu for v in job.variants.values())]
    for gpu in gpus:
        texts += gpu.apis_any
        lists.append(gpu.apis_any)
    dist = job.distributed
    if dist is not None:
        if range_error("", dist.nodes, 1, MAX_DISTRIBUTED_NODES) or range_error(
            "", dist.processes_per_node, 1, MAX_PROCESSES_PER_NODE
        ):
            return False
        texts += [v for v in (dist.backend, dist.launcher) if v is not None]
    if job.requires_core is not None:
        texts.append(job.requires_core)
    if not _lifecycle_fits(job) or range_error("", job.priority, -MAX_PRIORITY, MAX_PRIORITY):
        return False
    return all(len(x) <= MAX_LIST_ITEMS for x in lists) and all(fits(x, short) for x in texts)


def _lifecycle_fits(job: JobRequest) -> bool:
    """The fast mirror of ``_lifecycle_bounds``."""
    if range_error("", job.retries, 0, MAX_RETRIES):
        return False
    r = job.restart
    if r is not None and (
        range_error("", r.backoff_s, 0, MAX_BACKOFF_S)
        or range_error("", r.max_backoff_s, 0, MAX_BACKOFF_S)
    ):
        return False
    a = job.array
    if a is not None:
        if range_error("", a.count, 1, MAX_ARRAY_COUNT) or _array_id_error(job.job_id, a.count):
            return False
        if a.index is not None and range_error("", a.index, 0, MAX_ARRAY_COUNT - 1):
            return False
    if _rank_id_error(job):
        return False
    after = job.after
    return len(after) <= MAX_AFTER and all(
        isinstance(x, str) and JOB_ID.fullmatch(x) for x in after
    )


def _array_id_error(job_id: object, count: int) -> str | None:
    """An array's last job id, ``<job_id>-<count - 1>``, must still be a job id."""
    if not isinstance(job_id, str) or not isinstance(count, int) or count < 1:
        return None  # reported by the checks of the id and of the count
    last = f"{job_id}-{count - 1}"
    if JOB_ID.fullmatch(last):
        return None
    return (
        f"$.array.count: the array's last job id {show(last)} is {len(last)} characters, "
        f"over the job id's 128 ({JOB_ID_PATTERN}): use a shorter job_id"
    )


def _rank_id_error(job: JobRequest) -> str | None:
    """A distributed job's last rank id, ``<job_id>-rank<nodes - 1>`` (of the array's last job
    for an array), must still be a job id: a distributed job's id is that much shorter."""
    dist, a = job.distributed, job.array
    if (
        dist is None
        or not isinstance(dist.nodes, int)
        or not 1 <= dist.nodes <= MAX_DISTRIBUTED_NODES
    ):
        return None  # reported by the check of nodes
    if not isinstance(job.job_id, str) or not JOB_ID.fullmatch(job.job_id):
        return None  # reported by the check of the id
    base, shape, of = job.job_id, "<job_id>", ""
    if a is not None and a.index is None and isinstance(a.count, int) and a.count >= 1:
        base, shape, of = (
            f"{job.job_id}-{a.count - 1}",
            "<job_id>-<i>",
            f" in an array of {a.count}",
        )
        if not JOB_ID.fullmatch(base):
            return None  # reported by the check of the array
    last = rank_job_id(base, dist.nodes - 1)
    if JOB_ID.fullmatch(last):
        return None
    most = MAX_JOB_ID_CHARS - (len(last) - len(job.job_id))
    return (
        f"$.job_id: a distributed job's id may have at most {most} characters for {dist.nodes} "
        f"nodes{of} (its ranks are {shape}{RANK_SUFFIX}<R>)"
    )


def _lifecycle_bounds(job: JobRequest) -> Iterator[str]:
    error = range_error("$.retries", job.retries, 0, MAX_RETRIES)
    if error:
        yield error
    r = job.restart
    if r is not None:
        for path, value in (
            ("$.restart.backoff_s", r.backoff_s),
            ("$.restart.max_backoff_s", r.max_backoff_s),
        ):
            error = range_error(path, value, 0, MAX_BACKOFF_S)
            if error:
                yield error
    a = job.array
    if a is not None:
        error = range_error("$.array.count", a.count, 1, MAX_ARRAY_COUNT) or _array_id_error(
            job.job_id, a.count
        )
        if error:
            yield error
        if a.index is not None:
            error = range_error("$.array.index", a.index, 0, MAX_ARRAY_COUNT - 1)
            if error:
                yield error
    error = _rank_id_error(job)
    if error:
        yield error
    yield from count_errors("$.after", job.after, MAX_AFTER)
    for i, dep in enumerate(job.after[: MAX_AFTER + 1]):
        if not isinstance(dep, str) or not JOB_ID.fullmatch(dep):
            yield f"$.after[{i}]: {show(dep)} is not a job id ({JOB_ID_PATTERN})"


def array_size_error(count: int, encoded_len: int) -> str | None:
    """The rejection for an array of ``count`` jobs of ``encoded_len`` bytes each (as stored);
    None when they fit MAX_ARRAY_BYTES together."""
    total = count * encoded_len
    if total <= MAX_ARRAY_BYTES:
        return None
    return (
        f"$.array.count: {count} jobs of {encoded_len} bytes are {total} bytes together, over "
        f"the limit of {MAX_ARRAY_BYTES} bytes for one array"
    )


def _job_bounds(job: JobRequest) -> Iterator[str]:
    # Constructed in Python, a JobRequest skips msgspec's constraints: check the id here too.
    if not isinstance(job.job_id, str) or not JOB_ID.fullmatch(job.job_id):
        yield f"$.job_id: {show(job.job_id)} is not a job id ({JOB_ID_PATTERN})"
    yield from text_errors("$.name", job.name, MAX_NAME_BYTES)
    yield from _command_bounds(job.command)
    yield from _env_bounds(job.env)
    if job.timeout_s is not None:
        yield from _present(
            range_error("$.timeout_s", job.timeout_s, 0, MAX_TIMEOUT_S, low_open=True)
        )
    yield from _requirement_bounds(job.requirements)
    sections: list[tuple[str, GpuUsage]] = [("$.gpu", job.gpu or GpuUsage())]
    sections += [(f"$.variants.{k}.gpu", v.gpu) for k, v in job.variants.items()]
    for path, gpu in sections:
        yield from texts_errors(
            f"{path}.apis_any", gpu.apis_any, MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES
        )
    if job.distributed is not None:
        yield from _distributed_bounds(job.distributed)
    if job.requires_core is not None:
        yield from text_errors("$.requires_core", job.requires_core, MAX_SHORT_TEXT_BYTES)
    yield from _profile_and_container_bounds(job)
    yield from _lifecycle_bounds(job)
    # Queue policy (issue 15 part A).
    yield from _present(range_error("$.priority", job.priority, -MAX_PRIORITY, MAX_PRIORITY))


def _present(*errors: str | None) -> Iterator[str]:
    """The errors that are there (``range_error`` gives None for a value in range)."""
    for error in errors:
        if error:
            yield error


def _command_bounds(command: list[str]) -> Iterator[str]:
    yield from count_errors("$.command", command, MAX_ARGV_ITEMS)
    total = 0
    for i, arg in enumerate(command):
        size = utf8_len(arg)
        total += size
        if i <= MAX_ARGV_ITEMS:
            yield from text_errors(f"$.command[{i}]", arg, MAX_ARG_BYTES)
    if total > MAX_ARGV_BYTES:
        yield f"$.command: {total} bytes in all, over the limit of {MAX_ARGV_BYTES} bytes"


def _env_bounds(env: dict[str, str]) -> Iterator[str]:
    yield from count_errors("$.env", env, MAX_ENV_VARS)
    total = 0
    for i, (name, value) in enumerate(env.items()):
        total += utf8_len(name) + 1 + utf8_len(value)
        if i > MAX_ENV_VARS:
            continue
        path = env_path(name)
        if utf8_len(name) > MAX_ENV_NAME_BYTES:
            yield (
                f"$.env: the name {show(name)} is {utf8_len(name)} bytes, "
                f"over the limit of {MAX_ENV_NAME_BYTES} bytes"
            )
        elif not _ENV_NAME.fullmatch(name):
            yield f"{path}: {show(name)} is not a variable name ({ENV_NAME_PATTERN})"
        yield from text_errors(path, value, MAX_ENV_VALUE_BYTES)
    if total > MAX_ENV_BYTES:
        yield f"$.env: {total} bytes in all (NAME=value), over the limit of {MAX_ENV_BYTES} bytes"


def _requirement_bounds(req: Requirements) -> Iterator[str]:
    p = "$.requirements"
    yield from _present(range_error(f"{p}.gpu_count", req.gpu_count, 0, MAX_GPU_COUNT))
    if req.gpu_memory_gb is not None:
        yield from _present(
            range_error(
                f"{p}.gpu_memory_gb", req.gpu_memory_gb, 0, MAX_GPU_MEMORY_GB, low_open=True
            )
        )
    if req.min_cuda_compute_capability is not None:
        yield from compute_capability_errors(
            f"{p}.min_cuda_compute_capability", req.min_cuda_compute_capability
        )
    yield from _present(
        range_error(f"{p}.cpu_cores", req.cpu_cores, 0, MAX_JOB_CPU_CORES, low_open=True),
        range_error(f"{p}.memory_gb", req.memory_gb, 0, MAX_JOB_MEMORY_GB, low_open=True),
    )
    yield from text_map_errors(
        f"{p}.frameworks",
        req.frameworks,
        MAX_LIST_ITEMS,
        MAX_SHORT_TEXT_BYTES,
        MAX_SHORT_TEXT_BYTES,
    )
    yield from texts_errors(
        f"{p}.framework_capabilities",
        req.framework_capabilities,
        MAX_LIST_ITEMS,
        MAX_SHORT_TEXT_BYTES,
    )
    for field in ("python", "driver", "os"):
        yield from opt_text_errors(f"{p}.{field}", getattr(req, field), MAX_SHORT_TEXT_BYTES)


def _distributed_bounds(dist: Distributed) -> Iterator[str]:
    p = "$.distributed"
    yield from _present(
        range_error(f"{p}.nodes", dist.nodes, 1, MAX_DISTRIBUTED_NODES),
        range_error(f"{p}.processes_per_node", dist.processes_per_node, 1, MAX_PROCESSES_PER_NODE),
    )
    for field in ("backend", "launcher"):
        value = getattr(dist, field)
        if value is not None:
            yield from text_errors(f"{p}.{field}", value, MAX_SHORT_TEXT_BYTES)


def _profile_and_container_bounds(job: JobRequest) -> Iterator[str]:
    if job.profile is not None and not (
        isinstance(job.profile, str) and _PROFILE_REF.fullmatch(job.profile)
    ):
        # msgspec checks the pattern with re.search, where "$" also matches before a final
        # newline; a Python-built job skips it altogether.
        yield f"$.profile: {show(job.profile)} is not name@version ({PROFILE_REF_PATTERN})"
    yield from texts_errors(
        "$.profile_fields", job.profile_fields, MAX_LIST_ITEMS, MAX_SHORT_TEXT_BYTES
    )
    if job.container is None or _image_ref_fits(job.container.image):
        return
    image = job.container.image
    if isinstance(image, str) and len(image) > MAX_IMAGE_REF_BYTES:
        yield f"$.container.image: {len(image)} characters, over the limit of {MAX_IMAGE_REF_BYTES}"
    else:
        yield (
            f"$.container.image: {show(image)} is not an image reference "
            "([registry[:port]/]path[:tag][@digest], lower-case path, e.g. localhost/train:1)"
        )
