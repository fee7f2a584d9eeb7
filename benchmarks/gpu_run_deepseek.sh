# The DeepSeek GPU sequence of one device call (results under $OUT); PART picks it.
set -x
export PYTHONPATH=.
case "${PART:-check}" in
barrier)  # a grid barrier in one kernel against a kernel boundary; two dependent products in one persistent
         # kernel; the batch-1 expert products' kernel variants
  timeout 60 python3 benchmarks/grid_barrier.py 2>&1 | grep "^{\|rror"
  timeout 90 python3 benchmarks/persistent_poc.py 2>&1 | grep "^{\|rror"
  MATVEC_BUDGET_S=250 timeout 330 python3 benchmarks/matvec_configs.py variants 2>&1 | grep "^{\|rror" ;;
pdl)  # programmatic dependent launch: Triton and Mosaic GPU kernel pairs; dependent weight-streaming chains;
     # dependent one-row products as hand-written CUDA kernels in one FFI call against XLA's products
  timeout 280 python3 benchmarks/pdl_probe.py 2>&1 | grep "^{\|rror\|alone"
  timeout 380 python3 benchmarks/pdl_stream.py 2>&1 | grep "^{\|rror"
  timeout 180 python3 benchmarks/cuda_pdl_chain.py 2>&1 | grep "^{\|rror" ;;
check)
  timeout 150 python3 benchmarks/deepseek_kernels_check.py 2>&1 | grep -v Warning | grep "ok"
  timeout 200 python3 benchmarks/deepseek_ab.py 6 default xla_rows matvec_auto default xla_rows 2>&1 | grep "^\["
  timeout 100 python3 benchmarks/deepseek_profile.py 4 2>&1 | grep -v Warning | head -3
  timeout 100 python3 benchmarks/deepseek_profile.py 4 xla_rows 2>&1 | grep -v Warning | head -3
  timeout 330 python3 benchmarks/deepseek_h200.py decode 2>&1 | grep -v Warning | tail -4 ;;
ab)  # this tree against a copy of the previous commit's jspec in prev/ (git archive HEAD jspec)
  timeout 150 python3 benchmarks/deepseek_kernels_check.py 2>&1 | grep -v Warning | grep "ok"
  for i in 1 2; do
    JSPEC_BENCH_TAG=new timeout 150 python3 benchmarks/deepseek_ab.py 6 default 2>&1 | grep "^\["
    OUT=/tmp/prev JSPEC_BENCH_TAG=prev PYTHONPATH=prev:. timeout 150 python3 benchmarks/deepseek_ab.py 6 default 2>&1 | grep "^\["
  done
  timeout 100 python3 benchmarks/deepseek_profile.py 4 2>&1 | grep -v Warning | head -3
  OUT=$OUT/prev PYTHONPATH=prev:. timeout 100 python3 benchmarks/deepseek_profile.py 4 2>&1 | grep -v Warning | head -3 ;;
out)  # MLA output's latent chunks and warps (kernel pair, then the 6-layer model), the profile
  timeout 230 python3 benchmarks/mla_b1_configs.py mla 2>&1 | grep "^{" | cut -c1-330
  timeout 230 python3 benchmarks/deepseek_ab.py 6 default chunk128 out_warps8 default 2>&1 | grep "^\["
  timeout 100 python3 benchmarks/deepseek_profile.py 4 2>&1 | grep -v Warning | head -3 ;;
ab2)  # V2-Lite 6 layers: the post-attention norm in the prologues or not; V3 layer: first product 64 or 128 wide
  timeout 200 python3 benchmarks/deepseek_ab.py 6 default norm_inside out_warps8 default 2>&1 | grep "^\["
  DEEPSEEK_V3_SETTINGS=default,first_bn128,norm_inside timeout 380 python3 benchmarks/deepseek_h200.py v3layer 2>&1 \
    | grep "V3 shape\|v3 layer" ;;
decode)
  timeout 100 python3 benchmarks/deepseek_profile.py 4 2>&1 | grep -v Warning | head -3
  timeout 100 python3 benchmarks/deepseek_profile.py 4 down_bn128 2>&1 | grep -v Warning | head -3
  timeout 330 python3 benchmarks/deepseek_h200.py decode 2>&1 | grep -v Warning | tail -4 ;;
mtpab)  # the 4-token verify rounds with the gated product's 64- and 128-column tiles
  for setting in default down_bn128; do
    DEEPSEEK_SETTING=$setting DEEPSEEK_BATCHES=1 DEEPSEEK_ROUNDS=3x1x4,3x2x4 timeout 290 \
      python3 benchmarks/deepseek_h200.py mtp 2>&1 | grep -v Warning | tail -3
  done ;;
final)  # the 27-layer decode, the V3 layer shape, the 4-layer profile
  timeout 90 python3 benchmarks/deepseek_profile.py 4 2>&1 | grep -v Warning | head -3
  timeout 300 python3 benchmarks/deepseek_h200.py decode 2>&1 | grep -v Warning | tail -3
  mv $OUT/deepseek_h200.json $OUT/deepseek_h200_decode.json
  timeout 280 python3 benchmarks/deepseek_h200.py v3layer 2>&1 | grep -v Warning | tail -3
  mv $OUT/deepseek_h200.json $OUT/deepseek_h200_v3layer.json 2>/dev/null ;;
v3ab)  # the V3 layer shape with the post-attention norm in the kernels' prologues or not
  for setting in norm_inside default; do
    DEEPSEEK_SETTING=$setting timeout 280 python3 benchmarks/deepseek_h200.py v3layer 2>&1 | grep "v3 layer"
  done ;;
graphs)  # command buffers over the loop (the family's default) or XLA's: the MTP rounds, the 6-layer step
  DEEPSEEK_BATCHES=1 DEEPSEEK_ROUNDS=1x1x2,3x1x4,3x2x4 DEEPSEEK_MTP_SETTINGS=default,graphs_off timeout 480 \
    python3 benchmarks/deepseek_h200.py mtp 2>&1 | grep -v Warning | grep "mtp round\|decode\|rror"
  timeout 100 python3 benchmarks/deepseek_ab.py 6 default graphs_off graphs_loop_only default graphs_off 2>&1 | grep "^\[\|rror" ;;
graphs27)  # the 27-layer batch-1 step with and without graphs of single kernels, alternating in one process
  timeout 420 python3 benchmarks/deepseek_ab.py 27 graphs_off default graphs_off default graphs_off default 2>&1 \
    | grep "^\[\|rror" ;;
grouped)  # prefill's grouped expert kernel against ragged_dot: the routed experts, then the 27-layer model's runs
  MOE_PATHS_N=32,1024 MOE_PATHS=ragged,dense,grouped timeout 200 python3 benchmarks/moe_paths.py v2lite 2>&1 | grep "^{'shape"
  timeout 330 python3 benchmarks/deepseek_ab.py 27 default grouped_off default grouped_off 2>&1 | grep "^\[\|rror" ;;
grouped2)  # the grouped kernel's tilings at 32 and 1024 tokens, V2-Lite and V3 expert shapes
  MOE_PATHS_N=32,1024 MOE_PATHS=ragged,grouped timeout 400 python3 benchmarks/moe_paths.py v2lite v3 2>&1 | grep "^{'shape" \
    | cut -c1-200 ;;
final3)  # ragged_dot against the grouped kernel between 48 and 192 tokens, then the 27-layer decode (b1, b32)
  MOE_PATHS_N=48,96,192 MOE_PATHS=ragged,grouped MOE_PATHS_TILES=0 timeout 150 python3 benchmarks/moe_paths.py v2lite \
    2>&1 | grep "^{'shape" | cut -c1-200
  timeout 330 python3 benchmarks/deepseek_h200.py decode 2>&1 | grep -v Warning | tail -3 ;;
tiles)
  MATVEC_BUDGET_S=150 timeout 200 python3 benchmarks/matvec_configs.py down 2>&1 | grep "^{" ;;
mtp)
  DEEPSEEK_BATCHES=1 timeout 580 python3 benchmarks/deepseek_h200.py mtp 2>&1 | grep -v Warning | tail -8 ;;
v3)
  timeout 280 python3 benchmarks/deepseek_h200.py v3layer 2>&1 | grep -v Warning | tail -4
  DEEPSEEK_SETTING=xla_rows timeout 280 python3 benchmarks/deepseek_h200.py v3layer 2>&1 | grep -v Warning | tail -4 ;;
v3b)
  timeout 280 python3 benchmarks/deepseek_h200.py v3layer 2>&1 | grep -v Warning | tail -2
  DEEPSEEK_SETTING=splits_half timeout 280 python3 benchmarks/deepseek_h200.py v3layer 2>&1 | grep -v Warning | tail -2 ;;
cachewrite)  # the latent row written by mla_inputs or by XLA's update after it, in one process
  timeout 130 python3 benchmarks/deepseek_kernels_check.py 2>&1 | grep -v Warning | grep "ok"
  timeout 170 python3 benchmarks/deepseek_ab.py 6 default cache_write_off default 2>&1 | grep "^\[" ;;
rows)  # the MLA kernel's query rows a program, then the 27-layer decode
  timeout 150 python3 benchmarks/mla_b1_configs.py rows 2>&1 | grep "^{" | cut -c1-300
  timeout 330 python3 benchmarks/deepseek_h200.py decode 2>&1 | grep -v Warning | tail -3
  mv $OUT/deepseek_h200.json $OUT/deepseek_h200_decode.json ;;
final2)  # the V3 layer shape, then the 27-layer decode at batch 1 and 32
  timeout 260 python3 benchmarks/deepseek_h200.py v3layer 2>&1 | grep -v Warning | tail -3
  mv $OUT/deepseek_h200.json $OUT/deepseek_h200_v3layer.json 2>/dev/null
  timeout 320 python3 benchmarks/deepseek_h200.py decode 2>&1 | grep -v Warning | tail -3
  mv $OUT/deepseek_h200.json $OUT/deepseek_h200_decode.json ;;
abrows)  # the V3 layer with 16 or 64 MLA query rows a program; V2-Lite 6 layers with the cache write in or out
  DEEPSEEK_V3_SETTINGS=default,rows64,default timeout 330 python3 benchmarks/deepseek_h200.py v3layer 2>&1 \
    | grep "V3 shape\|v3 layer"
  timeout 170 python3 benchmarks/deepseek_ab.py 6 default cache_write_off default 2>&1 | grep "^\[" ;;
mtp2)  # the 4-layer profile, then the MTP rounds at batch 1
  timeout 90 python3 benchmarks/deepseek_profile.py 4 2>&1 | grep -v Warning | head -3
  DEEPSEEK_BATCHES=1 timeout 490 python3 benchmarks/deepseek_h200.py mtp 2>&1 | grep -v Warning | tail -8 ;;
mtpmv)  # MTP rounds with matvec / mla_inputs for the verify's 2-4 rows or not, same weights
  DEEPSEEK_BATCHES=1 DEEPSEEK_ROUNDS=1x1x2,3x1x4 DEEPSEEK_MTP_SETTINGS=default,matvec4 timeout 570 \
    python3 benchmarks/deepseek_h200.py mtp 2>&1 | grep -v Warning | tail -6 ;;
esac
