#!/usr/bin/env bash
# Wheels for running tests/hardware on a machine with no network (a lent GPU machine): the
# project's own packages and every runtime dependency, for that machine's Python, in one
# folder that device-run.sh installs from. Run here, where PyPI is reachable:
#
#     tests/hardware/wheelhouse.sh .hw/wheels 3.12
#
# The folder (about 40 MB) travels with the working tree; keep it out of git (.git/info/exclude).
set -euo pipefail
dest=${1:-.hw/wheels}
py=${2:-3.12}
mkdir -p "$dest"
reqs=$(mktemp)
# The locked versions, without the workspace's own packages (built below).
python3 -m uv export --frozen --no-dev --no-hashes --no-emit-workspace \
    | grep -v '^ *#' | grep -v '^-e' | sed 's/ *;.*//' | grep -v '^nkeys' >"$reqs"
printf 'pytest-asyncio\npytest-timeout\n' >>"$reqs"
python3 -m pip download -q -d "$dest" --only-binary=:all: --python-version "$py" \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any -r "$reqs"
# nkeys is published as an sdist only: pure Python, built here.
python3 -m pip wheel -q --no-deps -w "$dest" "$(grep '^nkeys' <(python3 -m uv export --frozen --no-hashes) | sed 's/ *;.*//')"
python3 -m uv build -q --all-packages --wheel -o "$dest"
rm -f "$reqs"
du -sh "$dest"
