#!/usr/bin/env bash
# gpupool on a real NVIDIA GPU, with PyTorch, in one script (about 2-3 minutes):
#
#   scripts/gpu-check.sh            (from the repository, after ./go --list)
#
# It builds the CUDA hook, starts NATS and the four services on this machine with the real
# GPUs (NVML, nothing simulated), and runs PyTorch processes under the hook, unwrapped, on GPU 0:
#
#   1. pod-a (limit 50) gets the GPU; torch.cuda.mem_get_info() reports 50 % of the card as
#      the total; allocating past the limit raises torch.cuda.OutOfMemoryError and the
#      process goes on allocating within it;
#   2. pod-c (limit 100) queues behind it, its stderr shows the waiting line with position 1,
#      and it runs once pod-a's process has exited (the worked example's rule: 50 + 100 > 100);
#   3. preemption: pod-low holds the GPU, pod-high (higher priority) asks for it, pod-low's
#      process is ended with SIGTERM and pod-high runs.
#
# PyTorch: $GPU_CHECK_PYTHON if set, else python3 if it imports torch, else torch is installed
# into .gpu-check-venv with uv (a large download). Exits 0 only if every check passed; prints
# PASS/FAIL per check. Needs one visible NVIDIA GPU with at least 4 GiB of memory.
#
# GPU_CHECK_DRY_RUN=1 runs the script's own plumbing on a SIMULATED GPU (with whatever
# nvidia-smi and torch are on PATH, e.g. stand-ins): it checks the script, not a GPU, and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.tools/bin:$PATH"
work="$(mktemp -d /tmp/gpupool-gpu-check.XXXXXX)"
stack_pid=""
cleanup() {
  if [ -n "$stack_pid" ]; then kill "$stack_pid" 2>/dev/null || true; wait "$stack_pid" 2>/dev/null || true; fi
  echo "gpu-check: logs and outputs kept in $work"
}
trap cleanup EXIT
failures=0
check() {  # check NAME CONDITION-COMMAND...
  local name=$1; shift
  if "$@"; then echo "PASS  $name"; else echo "FAIL  $name"; failures=$((failures + 1)); fi
}

command -v nvidia-smi >/dev/null || { echo "gpu-check: no nvidia-smi: not an NVIDIA GPU machine" >&2; exit 2; }
nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader
gpu_uuid="$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0 | tr -d ' ')"
gpu_mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | tr -d ' ')"
gpus="$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)"
if [ "$gpus" -ne 1 ]; then
  echo "gpu-check: $gpus GPUs visible; the queueing checks need one (set CUDA_VISIBLE_DEVICES is not enough: NVML sees all). Use a machine or container with one GPU." >&2
  exit 2
fi

python="${GPU_CHECK_PYTHON:-}"
if [ -z "$python" ]; then
  if python3 -c "import torch" 2>/dev/null; then
    python=python3
  else
    echo "gpu-check: installing torch into .gpu-check-venv (uv)" >&2
    [ -x .gpu-check-venv/bin/python ] || uv venv -q --python 3.11 .gpu-check-venv
    uv pip install -q --python .gpu-check-venv/bin/python torch
    python=.gpu-check-venv/bin/python
  fi
fi
"$python" -c "import torch; assert torch.cuda.is_available() or True; print('torch', torch.__version__)"

bash scripts/build-cuda-hook.sh
hook="$PWD/libs/cuda_hook/build/libgpupool-cuda-hook.so"
node="gpu-check"
cat > "$work/cluster.yaml" <<EOF
nodes:
  - name: $node
    gpus: 1
    qos: '{"preemptEnabled": true, "preemptGracePeriodSeconds": 5, "waitingMessagePeriodSeconds": 2}'
pods:
  - {name: pod-a, node: $node, requests: {core: 25, memory: 25}, limits: {core: 50, memory: 50}}
  - {name: pod-c, node: $node, requests: {core: 25, memory: 25}, limits: {core: 100, memory: 100}}
  - {name: pod-low, node: $node, priority: 0, requests: {core: 10, memory: 10}, limits: {core: 100, memory: 100}}
  - {name: pod-high, node: $node, priority: 10, requests: {core: 10, memory: 10}, limits: {core: 100, memory: 100}}
EOF
simulate=()
if [ "${GPU_CHECK_DRY_RUN:-}" = 1 ]; then
  echo "gpu-check: DRY RUN on a SIMULATED GPU: this checks the script, not a GPU" >&2
  simulate=(--simulate-gpus 1)
fi
.venv/bin/gpupool up --cluster "$work/cluster.yaml" --node-name "$node" --state-dir "$work/state" \
  --any-ports "${simulate[@]}" > "$work/stack.log" 2>&1 &
stack_pid=$!
socket="$work/state/gpupool.sock"
for _ in $(seq 120); do
  grep -q "gpupool is up" "$work/stack.log" && break
  kill -0 "$stack_pid" 2>/dev/null || { cat "$work/stack.log"; exit 1; }
  sleep 0.5
done
grep -q "gpupool is up" "$work/stack.log" || { echo "gpu-check: the stack did not come up" >&2; cat "$work/stack.log"; exit 1; }
if [ "${GPU_CHECK_DRY_RUN:-}" != 1 ] && grep -q SIMULATED "$work/stack.log" "$work/state/logs/node-executor.log"; then
  echo "gpu-check: the node-executor is on SIMULATED GPUs; this check needs NVML" >&2; exit 1
fi

# The PyTorch workload: touches CUDA, reports, then holds the GPU until its stdin says "go"
cat > "$work/workload.py" <<'EOF'
import ctypes, sys, torch
mib = 1024 * 1024
torch.zeros(1, device="cuda")
free, total = torch.cuda.mem_get_info()
# what the hook set in this process before the real cuInit (os.environ is a copy from start-up)
getenv = ctypes.CDLL(None).getenv
getenv.restype = ctypes.c_char_p
visible = (getenv(b"CUDA_VISIBLE_DEVICES") or b"").decode()
print(f"visible {visible} total_mib {total // mib}", flush=True)
if "oom" in sys.argv:
    try:
        torch.empty(total + 512 * mib, dtype=torch.uint8, device="cuda")
        print("past-limit allocated", flush=True)
    except torch.cuda.OutOfMemoryError:
        print("past-limit OutOfMemoryError", flush=True)
    within = torch.empty(total // 2, dtype=torch.uint8, device="cuda")
    print(f"within-limit allocated {within.numel() // mib} MiB", flush=True)
print("holding", flush=True)
sys.stdin.readline()
EOF
run_pod() {  # run_pod NAME [ARGS...] -> a background PyTorch process of pod NAME under the hook
  local name=$1; shift
  mkfifo "$work/$name.in"
  env LD_PRELOAD="$hook" GPUPOOL_SOCKET="$socket" GPUPOOL_POD_NAMESPACE=default GPUPOOL_POD_NAME="$name" \
    "$python" "$work/workload.py" "$@" < "$work/$name.in" > "$work/$name.out" 2> "$work/$name.err" &
  eval "${name//-/_}_pid=$!"
  exec {fd}> "$work/$name.in"
  eval "${name//-/_}_in=$fd"
}
wait_for() {  # wait_for FILE PATTERN [SECONDS]
  local file=$1 pattern=$2 seconds=${3:-90}
  for _ in $(seq $((seconds * 4))); do grep -q -- "$pattern" "$file" 2>/dev/null && return 0; sleep 0.25; done
  return 1
}
limit50=$((gpu_mib * 50 / 100))

# 1 + 2: pod-a (limit 50) runs, pod-c (limit 100) waits behind it, then runs when pod-a is gone
run_pod pod-a oom
check "pod-a runs on GPU 0 ($gpu_uuid)" wait_for "$work/pod-a.out" "visible $gpu_uuid"
check "pod-a: mem_get_info shows the limit ($limit50 MiB)" grep -q "total_mib $limit50\$" "$work/pod-a.out"
check "pod-a: past the limit -> torch.cuda.OutOfMemoryError" wait_for "$work/pod-a.out" "past-limit OutOfMemoryError" 30
check "pod-a: goes on allocating within the limit" wait_for "$work/pod-a.out" "within-limit allocated" 30
run_pod pod-c
check "pod-c waits with position 1 (50 + 100 > 100)" wait_for "$work/pod-c.err" "Approximate position: 1" 30
check "pod-c has not touched the GPU yet" bash -c "! grep -q visible '$work/pod-c.out'"
echo go >&"$pod_a_in"; wait "$pod_a_pid" || true
check "pod-c runs once pod-a's process has exited" wait_for "$work/pod-c.out" "visible $gpu_uuid" 60
# limit 100: the card's total as the driver reports it (a little below NVML's, never above)
pod_c_total="$(sed -n 's/.*total_mib \([0-9]*\)$/\1/p' "$work/pod-c.out")"
check "pod-c: mem_get_info shows (nearly) the whole card (${pod_c_total:-?} of $gpu_mib MiB)" \
  test "${pod_c_total:-0}" -le "$gpu_mib" -a "${pod_c_total:-0}" -ge $((gpu_mib * 95 / 100))
echo go >&"$pod_c_in"; wait "$pod_c_pid" || true

# 3: preemption ends the holder
run_pod pod-low
check "pod-low holds the GPU" wait_for "$work/pod-low.out" "holding" 60
run_pod pod-high
set +e; wait "$pod_low_pid"; low_status=$?; set -e
check "pod-low's process was ended by SIGTERM (status $low_status)" test "$low_status" -eq 143
check "pod-high runs" wait_for "$work/pod-high.out" "visible $gpu_uuid" 60
echo go >&"$pod_high_in"; wait "$pod_high_pid" || true

.venv/bin/python - "$work/state" <<'EOF'
import asyncio, sys
from pathlib import Path
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
url = next(line.split("NATS: ")[1].split()[0] for line in (Path(sys.argv[1]).parent / "stack.log").read_text().splitlines() if "NATS: " in line)
async def main():
    log = await JetStreamEventLog.connect(url)
    async for entry in log.replay():
        if isinstance(entry, StoredEvent):
            event = entry.envelope.event
            if type(event).__name__ in ("PodReady", "Assigned", "Preempted", "Released"):
                print(" ", type(event).__name__, getattr(event, "pod", getattr(event, "victim", "")), getattr(event, "reason", ""))
    await log.close()
asyncio.run(main())
EOF
if [ "$failures" -eq 0 ]; then echo "gpu-check: all checks passed"; else echo "gpu-check: $failures check(s) failed"; exit 1; fi
