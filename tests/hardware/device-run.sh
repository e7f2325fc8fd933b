#!/usr/bin/env bash
# tests/hardware on a lent NVIDIA machine, as one prepared run (docs/hardware-validation.md):
# installs gpulayer from the wheelhouse (wheelhouse.sh) into a venv that also sees the
# machine's own packages (its CUDA torch), records nvidia-smi, starts the whole stack with
# `gpulayer dev up`, and runs tests/hardware against it. Everything it prints is also written
# to $OUT/hardware.log.
set -uo pipefail
OUT=${OUT:-/tmp/gpulayer-hw}
WHEELS=${WHEELS:-.hw/wheels}
mkdir -p "$OUT"
exec > >(tee "$OUT/hardware.log") 2>&1
set -x
nvidia-smi
nvidia-smi --query-gpu=index,uuid,name,memory.total,compute_cap,driver_version,compute_mode,mig.mode.current --format=csv,nounits
workload=$(command -v python3)
"$workload" -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())'
python3 -m venv --system-site-packages /tmp/gpulayer-venv
/tmp/gpulayer-venv/bin/pip install -q --no-index --find-links "$WHEELS" \
    gpulayer-cli gpulayer-placement gpulayer-executor gpulayer-probe pytest-asyncio pytest-timeout
export PATH=/tmp/gpulayer-venv/bin:$PATH GPULAYER_WORKLOAD_PYTHON=$workload
gpulayer probe --no-torch
# The stack, in the background, until "serving" (its data in ./.gpulayer, where the CLI finds
# the user's credential by itself).
setsid gpulayer dev up >"$OUT/dev-up.log" 2>&1 &
for _ in $(seq 240); do grep -q serving "$OUT/dev-up.log" && break; sleep 0.5; done
cat "$OUT/dev-up.log"
eval "$(grep -o 'export GPULAYER_[A-Z_]*=[^ ,]*' "$OUT/dev-up.log" | sort -u)"
export GPULAYER_NATS_URL=${GPULAYER_NATS_URL:-nats://127.0.0.1:4222}
gpulayer nodes
# -W default: a newer package there may warn where the locked one here does not.
timeout 300 python -m pytest -m hardware tests/hardware -v -rs -s -p no:cacheprovider -W default
status=$?
gpulayer jobs
tar czf "$OUT/service-logs.tgz" $(find .gpulayer -name '*.log') 2>/dev/null
exit $status
