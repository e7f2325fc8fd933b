"""The placement rules, one module per concern, in the style of kube-scheduler's framework
plugins: each module holds its check, its outcomes (the ``ruled_out`` names a failing node is
counted under, their rank in the explanation order, the requirement each names) and the words of
their reasons. ``gpulayer_matching.registry`` lists them in the order they run.

Adding a rule: a module here with a ``RULE`` (see ``base``), one line in ``registry.RULES``, and
a case in ``tests/unit/matching/test_rules.py``; ``docs/placement-rules.md`` says how.
"""
