"""The matcher answers the rules test corpus as it did when the golden file was recorded: the same
placements, and ``explain``'s summaries, reasons and counts word for word (issue 27: the rules
moved into modules of their own without changing a word). See ``tests/matcher_golden.py``."""

from __future__ import annotations

import collections

import msgspec
from tests.matcher_golden import Case, ask, load


def test_the_corpus_covers_every_call_and_many_rules() -> None:
    # A comparison over a thin corpus would pass for the wrong reason.
    cases = load()
    calls = collections.Counter(c.call for c in cases)
    assert set(calls) == {"match", "explain", "would_fit_when_idle", "match_gang", "explain_gang"}
    assert len(cases) > 1000
    rules = {rule for c in cases if c.explained is not None for rule in c.explained.ruled_out}
    assert len(rules) >= 35


def test_explain_and_match_answer_as_recorded() -> None:
    differ: list[tuple[Case, Case]] = []
    for case in load():
        now = ask(case)
        if now != case:
            differ.append((case, now))
    if differ:
        was, now = differ[0]
        shown = {
            "call": was.call,
            "job": was.job,
            "was": [was.placement, was.gang, was.explained, was.fits],
            "now": [now.placement, now.gang, now.explained, now.fits],
        }
        raise AssertionError(
            f"{len(differ)} answers differ from tests/fixtures/matcher/golden.json.gz; "
            f"the first: {msgspec.json.format(msgspec.json.encode(shown)).decode()}"
        )
