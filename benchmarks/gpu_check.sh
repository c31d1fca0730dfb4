#!/usr/bin/env bash
# The one command to run on a GPU machine, from the repository root (about 7 minutes on an H100):
#   benchmarks/gpu_check.sh [OUT_DIR]        (default: $OUT if set, else ./gpu_check_out)
# 1. installs what the machine's image lacks from wheels carried in .whl/ (benchmarks/gpu_wheels.txt lists them
#    and says how to download them; nothing is fetched here: GPU machines may have no network);
# 2. runs the tests that need CUDA (-m cuda) and the Triton kernels' tests (attention, fused MoE) on the GPU, and
#    times the fused MoE layer against the expert loop (benchmarks/moe_kernel.py);
# 3. runs the parity suites (Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE), LLaVA-OneVision/NeXT-Video,
#    Qwen2-Audio, Qwen2.5-Omni, async scheduling) against transformers on the GPU, with CUDA graphs (the default)
#    and with VLSERVE_ENFORCE_EAGER=1, and beside them the serving suites (HTTP server, P/D disaggregation, audio,
#    Responses) with the engines on the GPU;
# 4. runs benchmarks/gpu_bench.py (vlserve vs transformers on the same GPU, batch-1 decode vs the HBM bound,
#    graphs on vs off, async scheduling on vs off, the vision tower with and without graphs).
# Everything lands in OUT_DIR; OUT_DIR/summary.txt is the one file to read. Without a GPU it says what it skipped.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
# the project's venv where there is one (a dry run here), else the machine's python3 (a GPU machine's image)
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

export PYTHONPATH="$PWD"
PY_TAG=$($PY -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')" 2>/dev/null)
# wheels built for one Python (cpXY-cpXY) must be this interpreter's; abi3 and pure ones go anywhere
OTHER_PY=$(ls .whl/*.whl 2>/dev/null | grep -E -- "-(cp3[0-9]+)-\1-" | grep -v -- "-$PY_TAG-$PY_TAG-" | head -1)
if ls .whl/*.whl > /dev/null 2>&1 && [ -z "$OTHER_PY" ]; then
    SITE=/tmp/vlserve-gpu-site
    if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
            > "$OUT_DIR/pip.log" 2>&1; then
        export PYTHONPATH="$PWD:$SITE"
        say "wheels: installed $(ls .whl/*.whl | wc -l) from .whl/ into $SITE"
    else
        say "wheels: install FAILED (see pip.log)"
    fi
elif ls .whl/*.whl > /dev/null 2>&1; then
    say "wheels: .whl/ holds wheels for another Python than this $PY_TAG: not installed"
else
    say "wheels: none carried (.whl/ empty); using the machine's packages as they are"
fi
export PYTHONUNBUFFERED=1
export VLSERVE_CPU_KERNELS=0  # the engine runs on CUDA; the CPU kernels' one-minute build would be wasted

$PY - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import torch, platform
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
try:
    import triton, transformers
    print(f"triton {triton.__version__}, transformers {transformers.__version__}")
except ImportError as e:
    print(f"missing: {e}")
EOF

if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "no GPU here: skipped the CUDA tests, both parity runs on the GPU and the GPU benchmark."
    say "dry run: the CUDA-marked tests collect and skip:"
    $PY -m pytest tests/test_cuda.py -m cuda -q -p no:cacheprovider 2>&1 | tail -1 | tee -a "$SUMMARY"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader \
    2>/dev/null | sed 's/^/nvidia-smi: /' | tee -a "$SUMMARY"

# step NAME SECONDS COMMAND...: runs it under a time limit, logs to OUT_DIR/NAME.log, one summary line.
step() {
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    local last
    last=$(grep -E "^=* ?[0-9]+ (passed|failed|error|skipped)|no tests ran" "$OUT_DIR/$name.log" | tail -1)
    [ $rc = 124 ] && last="TIMED OUT after ${limit}s; $last"
    say "$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$last")"
}

PARITY="tests/test_parity.py tests/test_qwen3_vl.py tests/test_qwen3_5_parity.py tests/test_llava_parity.py
        tests/test_audio_parity.py tests/test_omni_parity.py tests/test_async_scheduling.py"
SERVING="tests/test_server_api.py tests/test_pd_disagg.py tests/test_audio_server.py tests/test_responses.py"
PYTEST="$PY -m pytest -p no:cacheprovider -rfE --timeout 300"  # pyproject's -q: one more would hide the counts
# -n: pytest-xdist, a file per worker (module fixtures stay in one process); the references run on the CPU
XDIST="-n 4 --dist loadfile"
$PY -c "import xdist" 2> /dev/null || XDIST=""

step cuda_tests 240 $PYTEST tests/test_cuda.py tests/test_triton_attention.py tests/test_triton_moe.py \
    tests/test_gated_delta.py::test_chunked_rule_on_cuda tests/test_sampler.py::test_cuda_matches_device $XDIST
step moe_kernel 60 $PY benchmarks/moe_kernel.py
grep "^|" "$OUT_DIR/moe_kernel.log" >> "$SUMMARY" 2>/dev/null
# The parity runs (graphs, eager) and the serving suites (the HTTP server, P/D and E->P->D moving KV between two
# engines on the GPU, audio) run side by side: 12 workers on the 16 cores; each worker's CPU references get 2 threads.
OMP_NUM_THREADS=2 step parity_graphs 300 $PYTEST -m engine $PARITY $XDIST &
OMP_NUM_THREADS=2 VLSERVE_ENFORCE_EAGER=1 step parity_eager 300 $PYTEST -m engine $PARITY $XDIST &
OMP_NUM_THREADS=2 step serving 300 $PYTEST $SERVING $XDIST &
wait
# GPU_CHECK_SECONDS caps the whole script (a lease's per-command limit): the benchmark gets what is left
BENCH_LIMIT=$(( ${GPU_CHECK_SECONDS:-900} - SECONDS - 10 ))
[ $BENCH_LIMIT -gt 360 ] && BENCH_LIMIT=360
step gpu_bench $BENCH_LIMIT $PY benchmarks/gpu_bench.py --json "$OUT_DIR/gpu_bench.json" --profile-decode
grep -A8 "^| model" "$OUT_DIR/gpu_bench.log" >> "$SUMMARY" 2>/dev/null
grep -A24 "^decode profile" "$OUT_DIR/gpu_bench.log" > "$OUT_DIR/decode_profile.txt" 2>/dev/null
for log in cuda_tests parity_graphs parity_eager serving; do
    grep -E "^(FAILED|ERROR)" "$OUT_DIR/$log.log" | head -20 | sed "s/^/$log: /" >> "$SUMMARY"
done
echo "--- summary ($SUMMARY) ---"
cat "$SUMMARY"
