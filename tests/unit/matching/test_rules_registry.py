"""The rule registry: every outcome a rule declares is reachable, names in its reason the field
it checks, and has a place of its own in the explanation order (issue 27)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from tests.unit.matching.rule_cases import EXAMPLES

from gpulayer_contracts.jobs import Container, Distributed, GpuUsage, Requirements
from gpulayer_matching import NodeView, explain
from gpulayer_matching import rules as rules_package
from gpulayer_matching.registry import OUTCOMES, RULES, outcome
from gpulayer_matching.rules.base import DeviceRule, HostRule, NodeRule

# Where an outcome's field lives: a requirement, a section of the job, or the node's view.
_FIELDS = {
    **{f: Requirements for f in Requirements.__struct_fields__},
    "gpu": GpuUsage,
    "distributed": Distributed,
    "container": Container,
}


def test_every_registered_outcome_has_an_example() -> None:
    # A rule added to the registry without an example here fails this test: add one.
    assert set(EXAMPLES) == set(OUTCOMES)


@pytest.mark.parametrize("name", sorted(OUTCOMES))
def test_each_rules_reason_names_the_field_it_checks(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, view = EXAMPLES[name](monkeypatch)
    why = explain(job, [view])
    assert len(why.ruled_out) == 1, why.summary
    (rule,) = why.ruled_out
    assert rule.partition(":")[0] == name
    said = outcome(rule)
    assert said.names_of(rule) in why.reasons[0], (said, why.reasons)
    assert why.reasons[0].startswith("1 ")
    # A family's member (framework:torch) is named too.
    assert rule.partition(":")[2] in why.reasons[0]


@pytest.mark.parametrize("name", sorted(OUTCOMES))
def test_each_rules_field_is_a_field_of_the_job_or_the_node(name: str) -> None:
    head, _, rest = OUTCOMES[name].field.partition(".")
    if head in NodeView.__struct_fields__:
        assert not rest
        return
    owner = _FIELDS[head]
    if rest:
        assert rest in owner.__struct_fields__
    elif owner is not Requirements:
        # A whole section is named only for rules of the section (the support matrix's mode,
        # the container runtime a job with an image needs).
        assert name in ("matrix", "no_container_runtime", "container_runtime_failed")


def test_outcomes_have_distinct_names_and_ranks() -> None:
    outcomes = [o for r in RULES for o in r.outcomes]
    assert len({o.name for o in outcomes}) == len(outcomes)
    assert len({o.rank for o in outcomes}) == len(outcomes)
    assert len({r.concern for r in RULES}) == len(RULES)


def test_device_rules_run_as_one_chain_between_node_rules() -> None:
    kinds = [type(r).__name__ for r in RULES if isinstance(r, NodeRule | DeviceRule)]
    first, last = kinds.index("DeviceRule"), len(kinds) - kinds[::-1].index("DeviceRule")
    assert set(kinds[first:last]) == {"DeviceRule"}
    assert "NodeRule" in kinds[:first]
    assert "NodeRule" in kinds[last:]


def test_capability_outcomes_rank_before_liveness_and_occupancy_after() -> None:
    # would_fit_when_idle and unsatisfiable rest on it: below liveness means "never here".
    live = OUTCOMES["offline"].rank
    capability = {o.name for r in RULES if isinstance(r, NodeRule | DeviceRule) for o in r.outcomes}
    assert all(OUTCOMES[n].rank < live for n in capability)
    host = {o.name for r in RULES if isinstance(r, HostRule) for o in r.outcomes}
    assert {n for n in host if OUTCOMES[n].rank < live} == {"cores", "host_memory"}


def test_a_profile_is_named_only_for_what_it_supplied() -> None:
    job, view = EXAMPLES["os"](pytest.MonkeyPatch())
    with_profile = msgspec.structs.replace(job, profile="torch@1", profile_fields=["os"])
    assert explain(with_profile, [view]).reasons[0].endswith("(profile torch@1)")
    other = msgspec.structs.replace(job, profile="torch@1", profile_fields=["python"])
    assert "profile" not in explain(other, [view]).reasons[0]


def test_the_rules_page_lists_every_outcome_and_its_module() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "placement-rules.md").read_text()
    for rule in RULES:
        for said in rule.outcomes:
            assert f"`{said.name}" in text, f"docs/placement-rules.md: {said.name} missing"
    modules = Path(rules_package.__file__).parent
    for module in modules.glob("*.py"):
        if module.stem not in ("__init__", "base"):
            assert f"`{module.name}`" in text, f"docs/placement-rules.md: {module.name} missing"
