#!/usr/bin/env bash
# One command for a GPU machine (under 8 minutes on one H200): the tests marked gpu or triton,
# then the grouped-GEMM benchmark (fused rows included), the layer benchmark at the Mixtral
# shape, the layer against its peers over the small grid and the exchange/experts overlap
# (chunks 1, 2, 4; one GPU: a loopback exchange). Writes logs, JSON and markdown under $OUT
# (or runs/gpu_suite).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_suite}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
status=0
timeout 240 "$PY" -m pytest -m "gpu or triton" -q tests/kernels tests/parallel/test_sync_free_cuda.py tests/parallel/test_chunked_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1
timeout 240 "$PY" -m benchmarks.grouped_gemm --repeats 10 2>&1 | tee "$OUT/grouped_gemm.log" || status=1
timeout 150 "$PY" -m benchmarks.moe_layer --dtype bfloat16 --repeats 5 2>&1 | tee "$OUT/moe_layer.log" || status=1
timeout 120 "$PY" -m benchmarks.layer_grid --device cuda --dtype bfloat16 --points small --repeats 7 2>&1 | tee "$OUT/layer_grid.log" || status=1
timeout 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-1}" -m benchmarks.ep_overlap \
  --shape 16384x4096 --hidden 1024 --repeats 5 2>&1 | tee "$OUT/ep_overlap.log" || status=1
exit $status
