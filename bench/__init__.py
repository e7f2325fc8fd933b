"""gpulayer benchmarks: figures printed as ``name=value unit``, never timed tests.

``make bench`` (``python -m bench``) runs the quick mode; ``make bench FULL=1`` the full sizes.
Everything runs on loopback against real NATS and PostgreSQL started in a temp folder, with the
real placement service and executor as separate processes. See docs/performance.md.
"""
