#!/usr/bin/env bash
# The GPU suite of the Triton kernels, for one call of the device tool on the H200:
#   GPU_TESTS="tests/test_gpu_kernels.py" bash profiling/gpu_suite.sh
# 1. pytest -m gpu over GPU_TESTS (paths in the repo; default: every GPU-marked test in tests/);
# 2. the interpreter tests (tests/test_triton_interpret.py), compiled on the GPU this time;
# 3. profiling/kernel_timing.py, whose table is printed last.
# Logs go to $OUT (the device tool brings that folder back), or to a temporary folder.
# compiled_attn is imported from a scratch folder that maps compiled_attn.ops to ops/, as
# the editable install does, so nothing needs installing on the machine.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$(mktemp -d)}
site=$(mktemp -d)
cp -r "$repo/compiled_attn" "$site/compiled_attn"
ln -s "$repo/ops" "$site/compiled_attn/ops"
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
cd "$site" || exit 1

python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" | tee "$out/env.txt"
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n 8)  # compiles and batch set-up in parallel

gpu_tests=()
for path in ${GPU_TESTS:-tests}; do gpu_tests+=("$repo/$path"); done

status=0
timeout 330 python3 -m pytest -p no:cacheprovider -q -rs "${parallel[@]}" -m gpu \
    "${gpu_tests[@]}" 2>&1 | tee "$out/pytest_gpu.log" || status=1
timeout 150 python3 -m pytest -p no:cacheprovider -q -rs "${parallel[@]}" \
    "$repo/tests/test_triton_interpret.py" 2>&1 | tee "$out/pytest_interpret_on_gpu.log" || status=1
timeout 120 python3 "$repo/profiling/kernel_timing.py" --out "$out/timing.md" 2>&1 \
    | tee "$out/timing.log" || status=1
echo "== summary"
tail -n 1 "$out/pytest_gpu.log" "$out/pytest_interpret_on_gpu.log"
cat "$out/timing.md" 2>/dev/null
exit $status
