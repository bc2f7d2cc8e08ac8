#!/usr/bin/env bash
# One GPU session's device run, prepared on the CPU: the command a session lent a GPU gives
# the device tool (docs/gpu.md, "What has run on a GPU"), in one call so that a machine's
# start is paid once:
#
#   bash benchmarks/gpu_session.sh        (carry: .whl, from `make gpu-wheels`)
#
# 1. installs the carried wheels (what the device image lacks) into /tmp/site;
# 2. `make gpu-check`: the GPU tests, every measurement, the table, and
#    benchmarks/results/gpu-<device>.json (copied to $OUT, to commit from here);
# 3. the profile of CUDA messages (benchmarks/profile_gpu_messages.py), if time is left.
#
# Logs and results go to $OUT (the device tool's folder; /tmp/gpu-session elsewhere). Each
# step has its own timeout within GPU_SESSION_S seconds (default 540: a 600 s call leaves
# room to collect the files). AIORL_GPU_CHECK_DEVICE=cpu runs it here as a dry run.
set -u
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
budget=${GPU_SESSION_S:-540}
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "wheels did not install"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{ nvidia-smi -L; python3 -c "import torch, zmq; print('torch', torch.__version__, 'zmq', zmq.__version__)"; } \
    >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

# The GPU tests and the measurements: at most 420 s, the rest for the profile.
timeout $(( $(left) > 420 ? 420 : $(left) )) python3 benchmarks/gpu_check.py --out "$out" \
    >"$out/gpu-check.log" 2>&1
echo "gpu-check exit $?"
tail -n 40 "$out/gpu-check.log"

if [ "$(left)" -gt 60 ]; then
    timeout $(( $(left) - 15 )) python3 benchmarks/profile_gpu_messages.py --out "$out" \
        --device "${AIORL_GPU_CHECK_DEVICE:-cuda}" >/dev/null 2>"$out/profile-errors.log"
    echo "profile exit $? ($(left) s left)"
fi
ls -la "$out"
