#!/usr/bin/env bash
# Every GPU measurement of the project in one run (fits one 10-minute device call on an H200).
# Usage on the GPU machine, from the repo root, with the libcst and transformers wheels carried in .whl/:
#   bash benchmarks/gpu_suite.sh                 # every step; results under $OUT (or benchmarks/results/gpu_suite/)
#   bash benchmarks/gpu_suite.sh tests graph     # only the named steps
# Steps: tests kernel moe moe_layer ssm model graph generate profile host mamba, and (not in the default set: run
# them by name) serving modes fp8 fp8_sweeps host_generate fp8_experts fp8_tests step_kernels splits split_rows beam
# tune host_gpu serving_http serving_ab fp8_decode tune_gemv fp8_w8a8 fp8_w8a8_tiles fp8_prequant.  Each has its own
# time limit so one slow step cannot eat the others.
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results/gpu_suite}
mkdir -p "$out"
steps=${*:-tests kernel moe moe_layer ssm model graph generate profile host mamba}
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__)"

step() { local limit=$1; shift; echo "== $*"; timeout "$limit" "$@" 2>&1 | grep -v Warning | tail -25; }
want() { [[ " $steps " == *" $1 "* ]]; }

want tests && step 150 env MLA_FUSER_GPU_RESULTS="$out/gpu_tests.json" python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider
want kernel && step 60 python3 benchmarks/bench_mla_decode_kernel.py --out "$out/mla_decode_kernel.json"
want moe && step 90 python3 benchmarks/bench_fused_moe.py --cuda-graph --hf-impls grouped_mm --out "$out/fused_moe.json"
want moe_layer && step 60 python3 benchmarks/bench_moe_layer.py --native-impls grouped_mm,batched_mm --out "$out/moe_layer.json"
want ssm && step 60 python3 benchmarks/bench_ssm_kernels.py --out "$out/ssm_kernels.json"
want model && step 120 python3 -m mla_fuser.cli bench --preset deepseek-v2-lite --device cuda --dtype bf16 \
           --shapes 1x512,16x4096,1x32768 --steps 16 --out "$out/model_bench.json"
want graph && step 180 python3 -m mla_fuser.cli bench --preset deepseek-v2-lite --device cuda --dtype bf16 \
           --shapes 1x512,16x4096,1x32768 --steps 32 --cuda-graph --out "$out/model_bench_cuda_graph.json"
want generate && step 240 python3 -m mla_fuser.cli bench --preset deepseek-v2-lite --device cuda --dtype bf16 \
           --shapes 1x512,16x4096,1x32768 --steps 32 --generate --out "$out/model_bench_generate.json"
want profile && step 150 python3 benchmarks/profile_model.py --out "$out/profile_model.json"
want host && step 120 python3 benchmarks/profile_host.py --out "$out/profile_host.txt"
want mamba && step 120 python3 benchmarks/bench_mamba_generate.py --layers 8 --prompt 2048 --new-tokens 64 \
           --out "$out/mamba2_generate.json"
want serving && step 540 python3 benchmarks/bench_serving.py --requests 1000 --warmup 1000 --static-requests 256 --native-requests 32 \
           --out "$out/serving_v2lite.json" --plot "$out/serving_v2lite.png"
want modes && step 240 env MLA_FUSER_GPU_RESULTS="$out/gpu_generation_modes.json" python3 -m pytest -q -p no:cacheprovider \
           tests/test_gpu_generation_modes.py tests/test_gpu_continuous_batching.py tests/test_gpu_fp8.py
want modes && step 300 python3 benchmarks/bench_generate_modes.py --budget-s 150 --out "$out/generate_modes.json"
want fp8 && step 180 python3 benchmarks/bench_fp8_gemm.py --out "$out/fp8_gemm.json"
want fp8 && step 90 python3 benchmarks/bench_mla_decode_kernel.py --fp8-cache --out "$out/mla_decode_fp8_cache.json"
want fp8 && step 150 env MLA_FUSER_GPU_RESULTS="$out/gpu_tests.json" python3 -m pytest -q -p no:cacheprovider -s \
           tests/test_gpu_fp8.py
want fp8 && step 240 python3 -m mla_fuser.cli bench --preset deepseek-v2-lite --device cuda --dtype bf16 --generate \
           --fp8-weights --fp8-cache --shapes 1x512,16x4096 --steps 32 --out "$out/model_bench_fp8.json"
want fp8_sweeps && step 300 python3 benchmarks/bench_fp8_gemm.py --sweep --out "$out/fp8_gemm_sweep.json"
want fp8_sweeps && step 240 python3 benchmarks/bench_mla_decode_kernel.py --fp8-cache --sweep --sweep-fp8-only --no-check \
           --no-eager --heads 16,128 --shapes 64x8192,1x32768 --sweep-shapes 64x8192 --out "$out/mla_decode_fp8_sweep.json"
want host_generate && step 90 python3 benchmarks/profile_host.py --generate --shape 1x512 --out "$out/profile_host_generate.txt"
want fp8_experts && step 120 python3 benchmarks/bench_fp8_gemm.py --experts --out "$out/fp8_experts.json"
want step_kernels && step 120 python3 benchmarks/profile_decode_step.py --shapes 1x512,1x32768,16x4096 \
           --out "$out/profile_decode_step.json"
want splits && step 200 python3 benchmarks/bench_mla_decode_kernel.py --heads 16,128 --sweep-splits --no-eager --no-check \
           --shapes 1x512,1x2048,1x8192,1x32768,4x1024,16x1024,16x4096,64x8192 --out "$out/mla_decode_splits.json"
want split_rows && step 90 python3 benchmarks/bench_split_rows.py --out "$out/split_rows.json"
want beam && step 200 python3 benchmarks/profile_generate_mode.py --modes greedy,beam4 --out "$out/profile_generate_modes.json"
want fp8_tests && step 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py tests/test_fp8_experts.py \
           tests/test_fp8_cache.py
want tune && step 300 python3 benchmarks/tune_mla_decode.py --out "$out/mla_decode_tune.json" --table "$out/mla_decode.json"
want host_gpu && step 150 python3 benchmarks/bench_host_overhead.py --device cuda --out "$out/host_overhead_gpu.json"
want serving_http && step 540 python3 benchmarks/bench_serving.py --http --http-concurrency 256 --in-process-concurrency 256 \
           --warmup 300 --static-requests 0 --native-requests 0 --out "$out/serving_http_same_load.json"
want serving_ab && step 400 python3 benchmarks/bench_serving.py --in-process-concurrency 256 --warmup 300 --static-requests 0 \
           --native-requests 0 --ab-switch-intervals 0.0005,0.005,0.0005,0.005 --out "$out/serving_switch_ab.json"
want fp8_decode && step 60 python3 benchmarks/bench_fp8_gemm.py --experts --tokens 1,4,8,16 --out "$out/fp8_experts_decode.json"
want fp8_decode && step 240 python3 benchmarks/bench_fp8_gemm.py --gemv-sweep --sweep-rep 20 --out "$out/fp8_gemv_sweep.json"
want fp8_decode && step 200 python3 benchmarks/bench_fp8_gemm.py --experts-sweep --experts-sweep-path aligned --sweep-rep 20 \
           --out "$out/fp8_experts_sweep_aligned.json"
want fp8_decode && step 150 python3 benchmarks/profile_decode_step.py --fp8-weights --fp8-cache --shapes 1x512,16x4096 \
           --out "$out/profile_decode_step_fp8.json"
# the FP8 experts' W8A8 GEMMs: one layer at 4-8192 tokens (W8A8 and weight-only side by side), the whole model's
# step with W8A8 and the split-K fix-up on and off, and (fp8_w8a8_tiles, a call of its own) their decode and prefill
# tiles; the linear's W8A8 variant
# ("w8a8" in bench_fp8_gemm's default section, beside the weight-only GEMM); first their compiled tests (the fix-up's
# graph and stream tests among them)
want fp8_w8a8 && step 120 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py tests/test_fp8_experts.py \
           -k "fixup or w8a8"
want fp8_w8a8 && step 150 python3 benchmarks/bench_fp8_gemm.py --experts --tokens 4,8,16,32,64,512,8192 \
           --out "$out/fp8_experts_w8a8.json"
want fp8_w8a8_tiles && step 420 python3 benchmarks/bench_fp8_gemm.py --experts-sweep --experts-sweep-path aligned \
           --experts-sweep-act-quant --experts-sweep-tokens 16,64,512,8192 --sweep-rep 20 \
           --out "$out/fp8_experts_sweep_aligned_w8a8.json"
want fp8_w8a8 && step 150 python3 benchmarks/profile_decode_step.py --fp8-weights --shapes 16x4096 \
           --ab-env MLA_FUSER_FP8_ACT_QUANT --out "$out/profile_decode_step_fp8_w8a8.json"
want fp8_w8a8 && step 150 python3 benchmarks/bench_fp8_gemm.py --tokens 4,16,64 --out "$out/fp8_gemm_w8a8.json"
want fp8_w8a8 && step 150 python3 benchmarks/profile_decode_step.py --fp8-weights --shapes 16x4096 \
           --ab-env MLA_FUSER_SPLITK_FIXUP --out "$out/profile_decode_step_fp8_splitk_fixup.json"
# the FP8 experts' activations quantised before their GEMMs: below FP8_PREQUANT_MIN_TOKENS (3-8 tokens) and the
# prefill tiles at 512 and 2048 tokens (the 64x64 tile was swept at 8192 only); then the whole model with every FP8
# change in (generate at 1x512 and 16x4096, and the graphed step)
want fp8_prequant && step 100 python3 benchmarks/bench_fp8_gemm.py --experts --tokens 3,4,8,16 \
           --out "$out/fp8_experts_prequant_decode.json"
want fp8_prequant && step 200 python3 benchmarks/bench_fp8_gemm.py --experts-sweep --experts-sweep-path aligned \
           --experts-sweep-act-quant --experts-sweep-tokens 512,2048 --sweep-rep 10 \
           --out "$out/fp8_experts_sweep_aligned_w8a8_prequant_512_2048.json"
want fp8_prequant && step 200 python3 -m mla_fuser.cli bench --preset deepseek-v2-lite --device cuda --dtype bf16 \
           --generate --fp8-weights --fp8-cache --shapes 1x512,16x4096 --steps 32 --out "$out/model_bench_fp8.json"
want fp8_prequant && step 90 python3 benchmarks/profile_decode_step.py --fp8-weights --shapes 16x4096 \
           --out "$out/profile_decode_step_fp8.json"
# the MoE decode GEMVs' tiles: the full grid on V2-Lite, then its top tiles on V2-Lite and V3 shapes -> the table
want tune_gemv && step 330 python3 benchmarks/tune_moe_gemv.py --jobs 14 --out "$out/moe_decode_gemv_sweep.json"
want tune_gemv && step 200 python3 benchmarks/tune_moe_gemv.py --jobs 12 --shapes v2lite,v3 --top 10 \
           --candidates "$out/moe_decode_gemv_sweep.json" --out "$out/moe_decode_gemv_tables.json" \
           --table "$out/moe_decode_gemv.json"
ls -la "$out"
