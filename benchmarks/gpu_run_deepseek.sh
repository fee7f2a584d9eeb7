# The DeepSeek GPU sequence of one device call (results under $OUT); PART picks it.
set -x
export PYTHONPATH=.
case "${PART:-check}" in
check)
  timeout 150 python3 benchmarks/deepseek_kernels_check.py 2>&1 | grep -v Warning | grep "ok"
  timeout 200 python3 benchmarks/deepseek_ab.py 6 default xla_rows matvec_auto default xla_rows 2>&1 | grep "^\["
  timeout 100 python3 benchmarks/deepseek_profile.py 4 2>&1 | grep -v Warning | head -3
  timeout 100 python3 benchmarks/deepseek_profile.py 4 xla_rows 2>&1 | grep -v Warning | head -3
  timeout 330 python3 benchmarks/deepseek_h200.py decode 2>&1 | grep -v Warning | tail -4 ;;
mtp)
  DEEPSEEK_BATCHES=1 timeout 580 python3 benchmarks/deepseek_h200.py mtp 2>&1 | grep -v Warning | tail -8 ;;
v3)
  timeout 280 python3 benchmarks/deepseek_h200.py v3layer 2>&1 | grep -v Warning | tail -4
  DEEPSEEK_SETTING=xla_rows timeout 280 python3 benchmarks/deepseek_h200.py v3layer 2>&1 | grep -v Warning | tail -4 ;;
v3b)
  timeout 280 python3 benchmarks/deepseek_h200.py v3layer 2>&1 | grep -v Warning | tail -2
  DEEPSEEK_SETTING=splits_half timeout 280 python3 benchmarks/deepseek_h200.py v3layer 2>&1 | grep -v Warning | tail -2 ;;
esac
