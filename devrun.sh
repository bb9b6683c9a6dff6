#!/bin/bash
# scratch device driver (not committed)
export PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/offload-pycache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python3 -c "import xdist" 2>/dev/null && W="-n 4" || W=""
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_LIMIT:-280} python3 -m pytest -q -p no:cacheprovider $W tests/gpu ${TEST_ARGS:-} > $OUT/gpu_tests.log 2>&1; echo "rc=$?" >> $OUT/gpu_tests.log
  tail -5 $OUT/gpu_tests.log
fi
i=0
for tree in ${TREES:-new old}; do
  i=$((i+1))
  if [ $tree = old ]; then d=bench_old; else d=.; fi
  (cd $d && PYTHONPATH=$PWD timeout ${BENCH_LIMIT:-150} python3 scripts/bench_engine.py ${BENCH_ARGS} --json $OUT/eng_${i}_$tree.json > $OUT/eng_${i}_$tree.log 2>&1; echo "rc=$?" >> $OUT/eng_${i}_$tree.log)
  echo "== $tree"; tail -${TAIL:-30} $OUT/eng_${i}_$tree.log
done
