"""Runtime profiles: named, versioned bundles of requirements a job names instead of spelling
them out (``profile = "torch-2.5-cu124@1"``). A profile is a compatibility aid, not a
guarantee: placement adds its requirements to the job's own at submit and still matches them
against what each node reports.

The profiles file is TOML, one table per profile under ``[profiles]``, keyed ``name@version``::

    [profiles."torch-2.5-cu124@1"]
    description = "PyTorch 2.5 on CUDA 12.4"
    python = ">=3.10,<3.13"
    frameworks = {torch = "==2.5.*"}
    accelerator = "cuda"
    min_cuda_compute_capability = 7.0
    driver = ">=550"
    os = "linux"
    container = {image = "localhost/torch:2.5-cu124", pull = "never"}

``container`` is the job's own field, not a requirement: a job of the profile runs in that image
(and is matched as a container job).

Pure: ``parse_profiles`` takes the file's text; ``load_profiles`` is the one reader of a path.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Final

import msgspec

from gpulayer_contracts._base import Input
from gpulayer_contracts.bounds import MAX_SHORT_TEXT_BYTES, clip_text
from gpulayer_contracts.codec import InvalidInput, describe_validation_error
from gpulayer_contracts.jobs import (
    PROFILE_REF_PATTERN,
    Accelerator,
    Container,
    JobRequest,
    PlatformFamily,
    Requirements,
)
from gpulayer_contracts.validation import parse_compute_capability, validate_job

__all__ = [
    "MAX_PROFILES",
    "MAX_PROFILES_FILE_BYTES",
    "PROFILE_FIELDS",
    "Profile",
    "Profiles",
    "expand_profile",
    "load_profiles",
    "parse_profiles",
    "same_submission",
]

# A profiles file is written by an operator, read once at start; these keep a mistaken one (a
# log file given by accident, a generated file gone wrong) from holding placement's memory.
MAX_PROFILES_FILE_BYTES: Final = 1 << 20
MAX_PROFILES: Final = 1024
MAX_DESCRIPTION_BYTES: Final = 1024
# Known profiles listed in one rejection at most (the rest are counted).
_LISTED: Final = 20

_TOP_UNKNOWN = re.compile(r"^\$: Object contains unknown field `(?P<field>[^`]+)`$")
_REF = re.compile(PROFILE_REF_PATTERN.removeprefix("^").removesuffix("$"))


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class Profile(Input, frozen=True):
    """One profile's requirements; each is a ``requirements`` field of a job, unset: none."""

    description: Annotated[str, _doc("What the profile is for, shown by gpulayer profiles")] = ""
    python: str | None = None
    frameworks: dict[str, str] = {}
    framework_capabilities: list[str] = []
    accelerator: Accelerator | None = None
    min_cuda_compute_capability: float | str | None = None
    driver: str | None = None
    os: PlatformFamily | None = None
    container: Annotated[
        Container | None, _doc("Run the profile's jobs in this OCI image (the job's container)")
    ] = None


# The requirement fields a profile may set, in the order conflicts are reported.
PROFILE_FIELDS: Final = (
    "python",
    "frameworks",
    "framework_capabilities",
    "accelerator",
    "min_cuda_compute_capability",
    "driver",
    "os",
)


class Profiles(msgspec.Struct, frozen=True, kw_only=True):
    """The profiles placement knows, by ``name@version``; ``source``: the file they came from
    (empty: none configured)."""

    by_ref: dict[str, Profile] = {}
    source: str = ""

    def versions(self, name: str) -> list[str]:
        """The known ``name@version`` refs of ``name``, oldest version first."""
        refs = [r for r in self.by_ref if r.rpartition("@")[0] == name]
        return sorted(refs, key=lambda r: int(r.rpartition("@")[2]))


def load_profiles(path: str | Path) -> Profiles:
    """Read and check a profiles file. Raises InvalidInput naming the file and what is wrong."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_PROFILES_FILE_BYTES + 1)
    except OSError as err:
        raise InvalidInput(f"{p}: cannot read the profiles file: {err.strerror or err}") from err
    if len(data) > MAX_PROFILES_FILE_BYTES:
        raise InvalidInput(
            f"{p}: over the limit of {MAX_PROFILES_FILE_BYTES} bytes for a profiles file"
        )
    try:
        text = data.decode()
    except UnicodeDecodeError as err:
        raise InvalidInput(f"{p}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    return parse_profiles(text, str(p))


def parse_profiles(text: str, source: str = "<profiles>") -> Profiles:
    """Profiles from a TOML text. Every error is collected and raised as one InvalidInput,
    each line naming the profile and field (``profiles."x@1".python: ...``)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InvalidInput(f"{source}: not valid TOML: {err}") from err
    errors: list[str] = [
        f"{source}: {k!r}: unknown key (only [profiles])" for k in raw if k != "profiles"
    ]
    table = raw.get("profiles", {})
    if not isinstance(table, dict):
        raise InvalidInput(f"{source}: profiles: must be a table of name@version = {{...}}")
    if len(table) > MAX_PROFILES:
        raise InvalidInput(f"{source}: {len(table)} profiles, over the limit of {MAX_PROFILES}")
    by_ref: dict[str, Profile] = {}
    for ref, body in table.items():
        where = f'profiles."{clip_text(ref.encode("unicode_escape").decode(), 80)}"'
        if not _REF.fullmatch(ref):
            errors.append(
                f"{where}: not name@version (a name of letters, digits, . _ + -, up to 64 "
                "characters, then @ and a version number from 1)"
            )
            continue
        profile, problems = _profile(where, body)
        errors += problems
        if profile is not None and not problems:
            by_ref[ref] = profile
    if errors:
        shown = errors[:_LISTED] + (
            [f"... and {len(errors) - _LISTED} more"] if len(errors) > _LISTED else []
        )
        raise InvalidInput(f"{source}: " + "; ".join(shown))
    return Profiles(by_ref=by_ref, source=source)


def _profile(where: str, body: Any) -> tuple[Profile | None, list[str]]:
    """One profile, decoded strictly and checked with the rules a job's requirements follow."""
    try:
        profile = msgspec.convert(body, Profile, strict=True)
    except msgspec.ValidationError as err:
        text = describe_validation_error(err)
        # At the top of a table msgspec names no path: "$: Object contains unknown field `x`".
        if m := _TOP_UNKNOWN.match(text):
            text = f"$.{m['field']}: unknown field"
        return None, [f"{where}{text.removeprefix('$')}"]
    errors: list[str] = []
    size = len(profile.description.encode("utf-8", "surrogatepass"))
    if size > MAX_DESCRIPTION_BYTES or "\x00" in profile.description:
        errors.append(f"{where}.description: over {MAX_DESCRIPTION_BYTES} bytes, or holds NUL")
    probe = JobRequest(
        job_id="profile",
        command=["true"],
        requirements=_requirements(profile),
        container=profile.container,
    )
    for error in validate_job(probe).errors:
        # "$.requirements.python: ..." -> 'profiles."x@1".python: ...', and "$.container.image:
        # ..." -> 'profiles."x@1".container.image: ...'
        errors.append(f"{where}{error.removeprefix('$.requirements').removeprefix('$')}")
    return profile, errors


def _requirements(profile: Profile) -> Requirements:
    return Requirements(**{f: getattr(profile, f) for f in PROFILE_FIELDS})


def _unknown(ref: str, profiles: Profiles) -> str:
    name = ref.rpartition("@")[0] if "@" in ref else ref
    shown = repr(clip_text(ref, MAX_SHORT_TEXT_BYTES // 4))
    versions = profiles.versions(name)
    if versions:
        return f"$.profile: unknown version {shown}; known versions: {', '.join(versions)}"
    if not profiles.by_ref:
        return f"$.profile: {shown}: no profiles are configured on this placement"
    known = sorted(profiles.by_ref)
    listed = ", ".join(known[:_LISTED]) + (
        f", ... ({len(known)} in all)" if len(known) > _LISTED else ""
    )
    return f"$.profile: unknown profile {shown}; known profiles: {listed}"


def _same(field: str, a: Any, b: Any) -> bool:
    if field == "min_cuda_compute_capability":
        try:
            return parse_compute_capability(a) == parse_compute_capability(b)
        except ValueError:
            return False
    return bool(a == b)


def expand_profile(job: JobRequest, profiles: Profiles) -> tuple[JobRequest, list[str]]:
    """``job`` with its profile's requirements added to its own, and the errors that make it
    invalid: an unknown profile or version (naming the known versions), or a field both set
    differently (naming both values). ``profile_fields`` is set to what the profile supplied.

    Expanding an expanded job changes nothing: its fields then equal the profile's.
    """
    if job.profile is None:
        if job.profile_fields:
            job = msgspec.structs.replace(job, profile_fields=[])
        return job, []
    ref = job.profile
    profile = profiles.by_ref.get(ref)
    if profile is None:
        return job, [_unknown(ref, profiles)]
    changes, supplied, errors = _merged_requirements(ref, profile, job.requirements)
    container = job.container
    if profile.container is not None:
        # The job's own field, not a requirement; the same rule: set both, they must agree.
        if container is not None and container != profile.container:
            errors.append(
                f"$.container: the job's {msgspec.to_builtins(container)!r} conflicts with "
                f"profile {ref}'s {msgspec.to_builtins(profile.container)!r}"
            )
        container = profile.container
        supplied.append("container")
    expanded = msgspec.structs.replace(
        job,
        requirements=msgspec.structs.replace(job.requirements, **changes),
        container=container,
        profile_fields=supplied,
    )
    return expanded, errors


def _merged_requirements(
    ref: str, profile: Profile, req: Requirements
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The requirement fields profile ``ref`` changes in ``req`` (with their new values), the
    fields it supplied, and the conflicts between the two."""
    changes: dict[str, Any] = {}
    supplied: list[str] = []
    errors: list[str] = []

    def conflict(path: str, own: Any, theirs: Any) -> None:
        errors.append(
            f"$.requirements.{path}: the job's {own!r} conflicts with profile {ref}'s {theirs!r}"
        )

    for field in PROFILE_FIELDS:
        theirs = getattr(profile, field)
        own = getattr(req, field)
        if field == "frameworks":
            merged = dict(own)
            for name, spec in theirs.items():
                if name in own and own[name] != spec:
                    conflict(f"frameworks.{name}", own[name], spec)
                merged[name] = spec
                supplied.append(f"frameworks.{name}")
            if theirs:
                changes[field] = merged
        elif field == "framework_capabilities":
            # A list of must-haves: the profile's are added, nothing can conflict.
            if theirs:
                changes[field] = [*own, *(c for c in theirs if c not in own)]
                supplied += [f"framework_capabilities.{c}" for c in theirs]
        elif theirs is not None:
            if own is not None and not _same(field, own, theirs):
                conflict(field, own, theirs)
            changes[field] = theirs
            supplied.append(field)
    return changes, supplied, errors


def same_submission(stored: JobRequest, job: JobRequest) -> bool:
    """Is ``stored`` (a job as placement recorded it, its profile expanded) what submitting
    ``job`` made? The profile's values are read back from ``stored``'s ``profile_fields``."""
    if stored.profile != job.profile:
        return False
    if job.profile is None:
        return stored == job
    req = stored.requirements
    values: dict[str, Any] = {}
    frameworks: dict[str, str] = {}
    capabilities: list[str] = []
    for path in stored.profile_fields:
        head, _, rest = path.partition(".")
        if head == "frameworks" and rest in req.frameworks:
            frameworks[rest] = req.frameworks[rest]
        elif head == "framework_capabilities" and rest:
            capabilities.append(rest)
        elif head in PROFILE_FIELDS and not rest:
            values[head] = getattr(req, head)
        elif head == "container" and not rest:
            values[head] = stored.container
    profile = Profile(frameworks=frameworks, framework_capabilities=capabilities, **values)
    expanded, errors = expand_profile(job, Profiles(by_ref={job.profile: profile}))
    return not errors and expanded == stored
