#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md in one prepared run, on a CUDA machine (H200-class, 16 cores).
#
#   OUT=/path/for/results benchmarks/gpu_check.sh        # from any directory; at most about 8 minutes
#
# 1. finds a Python with torch (CUDA) and the project's dependencies; where some are missing it makes a
#    virtual environment outside the repository (reusing the system's torch) and pip-installs the
#    project into it; without a network it prints what is missing and stops;
# 2. the fast path's CUDA tests: the CUDA-graph update gives the eager update's loss, gradients and
#    parameters; frames kept on the GPU are sampled byte-exact;
# 3. throughput on cuda, DQN on Breakout: plain loop against the fast loop (16 envs, frames on the GPU),
#    the update's variants, replay memory (host and GPU); then algos/dqn.py itself, plain against fast;
# 4. throughput on the CPU with all cores: plain loop against the fast loop (8 envs);
# 5. with the time left: the fast loop with 32 envs, and the torch.compile variants on cuda.
# Each step has its own time limit, and a failed step does not stop the others. Everything lands in
# $OUT: one JSON and one log per step, and summary.txt. (GPU_CHECK_ALLOW_CPU=1 rehearses it on a CPU-only
# machine: the CUDA steps then fail at once, the CPU step runs.)
set -u
START=$SECONDS
DEADLINE=${DEADLINE:-470}  # seconds for the whole script
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/benchmarks/out}"
mkdir -p "$OUT"
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CI=true
say() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$OUT/summary.txt"; }
left() { echo $((DEADLINE - (SECONDS - START))); }

# ---- 1. Python and dependencies
PY="${PYTHON:-python3}"
deps_report() {  # prints what is there and what is missing; exit 0 only when all is there and CUDA works
    "$1" - <<'EOF'
import importlib, os, sys
missing = []
for name in ["torch", "numpy", "gymnasium", "ale_py", "tyro", "psutil", "cv2", "tensorboard", "tqdm", "pytest"]:
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '')}")
    except Exception as error:
        print(f"  MISSING {name}: {type(error).__name__}: {error}")
        missing.append(name)
try:
    import torch
    cuda = torch.cuda.is_available()
    print(f"  torch CUDA build {torch.version.cuda}, device available: {cuda}",
          f"({torch.cuda.get_device_name(0)})" if cuda else "")
except Exception:
    cuda = False
sys.exit(0 if not missing and (cuda or os.environ.get("GPU_CHECK_ALLOW_CPU")) else 1)
EOF
}
say "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB memory"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"
say "python: $("$PY" --version 2>&1) at $(command -v "$PY")"
if ! deps_report "$PY" 2>&1 | tee -a "$OUT/summary.txt"; then
    VENV="${TMPDIR:-/tmp}/value-atari-gpu-venv"
    say "some dependencies are missing: making $VENV (reusing the system's packages) and installing the project"
    "$PY" -m venv --system-site-packages "$VENV" >>"$OUT/install.log" 2>&1
    if ! "$PY" -c "import torch" 2>/dev/null; then
        say "no torch at all: pip will download it (a CUDA build, several GB)"
    fi
    timeout 200 "$VENV/bin/python" -m pip install --quiet -e ".[test]" >>"$OUT/install.log" 2>&1
    status=$?
    PY="$VENV/bin/python"
    if ! deps_report "$PY" 2>&1 | tee -a "$OUT/summary.txt"; then
        say "STOP: still missing (pip exit status $status; no network here?). Install these, then run again:"
        say "  pip install -e '.[test]'  (and a CUDA build of torch). The pip log: $OUT/install.log"
        tail -5 "$OUT/install.log" | tee -a "$OUT/summary.txt"
        exit 2
    fi
fi

step() {  # step NAME LIMIT_SECONDS COMMAND...: runs with a time limit (never past the deadline), logs to $OUT
    local name=$1 limit=$2
    shift 2
    local remaining
    remaining=$(left)
    if [ "$remaining" -lt 30 ]; then
        say "$name: skipped, ${remaining}s left"
        return 1
    fi
    [ "$limit" -gt "$remaining" ] && limit=$remaining
    say "$name: start (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    say "$name: exit status $rc (124: time limit) after $((SECONDS - START))s in all"
    return $rc
}

# ---- 2. the CUDA tests of the fast path
step tests_cuda 100 "$PY" -m pytest -q -p no:cacheprovider tests/test_fast_update.py tests/test_bench_fast_update.py \
    tests/test_fast_path.py \
    -k "cuda or gpu" -rs
tail -3 "$OUT/tests_cuda.log" | tee -a "$OUT/summary.txt"

# ---- 3. cuda: plain against fast, frames on the GPU
step gpu_dqn_breakout 170 "$PY" benchmarks/throughput.py --algo dqn --env-id BreakoutNoFrameskip-v4 --device cuda \
    --compare --num-envs 16 --buffer-device cuda --seconds 12 --rounds 2 --no-compile-variants \
    --memory-transitions 100000 --json "$OUT/gpu_dqn_breakout.json"

# ---- 3b. cuda: the shipped script itself, --no-fast --num-envs 1 against its default with 16 envs, frames on the GPU
step gpu_scripts_dqn 100 "$PY" benchmarks/throughput.py --scripts --algo dqn --device cuda --num-envs 16 \
    --buffer-device cuda --rounds 1 --script-steps 4000 --json "$OUT/gpu_scripts_dqn.json"

# ---- 4. the CPU with all its cores
step cpu_dqn_breakout 110 "$PY" benchmarks/throughput.py --algo dqn --env-id BreakoutNoFrameskip-v4 --device cpu \
    --compare --num-envs 8 --seconds 10 --rounds 2 --no-compile-variants --memory-transitions 0 \
    --json "$OUT/cpu_dqn_breakout.json"

# ---- 5. with the time left
step gpu_fast_32envs 60 "$PY" benchmarks/throughput.py --algo dqn --device cuda --num-envs 32 --buffer-device cuda \
    --seconds 15 --rounds 1 --no-variants --memory-transitions 0 --json "$OUT/gpu_fast_32envs.json"
step gpu_compile_variants 150 "$PY" benchmarks/throughput.py --algo dqn --device cuda --only-variants \
    --compile-variants --json "$OUT/gpu_compile_variants.json"

# ---- summary
"$PY" - "$OUT" <<'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for path in sorted(out.glob("*.json")):
    report = json.loads(path.read_text())
    print(f"\n== {path.name}: {report['command']}\n   {report['machine'].get('gpu', report['machine']['cpu'])}, "
          f"{report['machine']['cores']} cores, {report['machine']['date']}, {report.get('load_at_start')}")
    for name, f in report.get("loops", {}).items():
        print(f"   {name:<5} envs {f['num_envs']:>2} {f['settings']:<28} env {f['env_steps_per_s']:>7.0f}/s "
              f"act {1e3 * f['t_act']:.3f} ms/step, update {1e3 * f['t_update']:.2f} ms, "
              f"limit {f['limit_steps_per_s']:.0f}/s, end-to-end {f['end_to_end_steps_per_s']:.0f}/s, "
              f"efficiency {f['efficiency']:.2f}")
    if "fast_over_plain" in report:
        print(f"   fast / plain: {report['fast_over_plain']:.2f}x")
    for name, f in report.get("scripts", {}).items():
        print(f"   script {name:<5} {f['flags']:<40} end-to-end {f['end_to_end_steps_per_s']:.0f}/s")
    if "scripts_fast_over_plain" in report:
        print(f"   script fast / plain: {report['scripts_fast_over_plain']:.2f}x")
    for row in report.get("update_variants", []):
        print(f"   update {row['variant']:<32} {row['ms']:7.3f} ms  x{row['speedup_vs_eager']:.2f}  "
              f"{row['gflops_per_s']:.0f} GFLOP/s")
    if "matmul_peak_gflops" in report:
        print(f"   matmul peak {report['matmul_peak_gflops']:.0f} GFLOP/s")
    for where, m in report.get("replay_memory", {}).items():
        if "bytes_per_transition" in m:
            print(f"   replay ({where}): {m['bytes_per_transition']:.0f} B/transition, 1M: {m['projected_1m_gb']:.2f} GB")
EOF
say "done in $((SECONDS - START))s; results in $OUT"
