#!/usr/bin/env bash
# The GPU test suite on both ends of the supported Transformers range, in one device call:
#   the image's own Transformers (5.17, the lowest we support) and the newest 5.x carried as a wheel in .whl/.
# Usage on the GPU machine, from the repo root, with .whl/ holding libcst (cp312), transformers-<newest> and what that
# release needs beyond the image (huggingface_hub, kernels, tokenizers and their own needs; the newest end's site only):
#   bash benchmarks/gpu_tests_both_ends.sh          # results: $OUT/gpu_tests_t<version>.json and logs
set -u
export PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results/gpu_suite}
mkdir -p "$out"
status=0
run_suite() {  # $1: site folder (PYTHONPATH) holding the carried wheels of this run
  local version
  version=$(PYTHONPATH="$1" python3 -c "import transformers; print(transformers.__version__)")
  echo "== tests/test_gpu.py on transformers $version"
  PYTHONPATH="$1:$PWD" MLA_FUSER_GPU_RESULTS="$out/gpu_tests_t$version.json" \
    timeout 280 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rs 2>&1 | grep -v Warning \
    | tee "$out/gpu_tests_t$version.log" | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_low .whl/libcst-*.whl
run_suite /tmp/site_low
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_new .whl/*.whl
run_suite /tmp/site_new
exit $status
