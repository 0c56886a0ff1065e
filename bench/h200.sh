#!/usr/bin/env bash
# The H200 session script: installs the peers' wheels (if carried in .whl/), then runs the named stages,
# each writing its log and JSON into $OUT/results.tgz. Stages: tests, attention, fused, cross_entropy, fp8,
# dataloader, checkpoint, e2e, e2e_ab, distributed, host_overhead, host_threads, multigpu, convergence, fp8_transpose_probe, attention_clocks, host_trace, adamw, fp8_attention_ablate, linear, mlp, embedding, gemm_tune, attention_sm90, attention_sm90_bwd, fp8_attention_sm90, fp8_attention_sm90_bwd, attention_sm90_bwd_ablate, fp8_attention_sm90_bwd_probe, softmax_rows, attention_passes, train124m (Triton ops), train124m-ref (PyTorch reference ops).  Example: bash bench/h200.sh tests attention fused
set -uo pipefail
cd "$(dirname "$0")/.."
# snapshot.tgz (`git archive -o snapshot.tgz HEAD`, carried beside the tree): run that commit's files, not the
# live working tree, so a result belongs to exactly one commit.
if [ -f snapshot.tgz ] && [ -z "${TILEWISE_SNAPSHOT:-}" ]; then
  export TILEWISE_SNAPSHOT=/tmp/tilewise-snapshot
  rm -rf "$TILEWISE_SNAPSHOT" && mkdir -p "$TILEWISE_SNAPSHOT" && tar xzf snapshot.tgz -C "$TILEWISE_SNAPSHOT"
  [ -d .whl ] && cp -r .whl "$TILEWISE_SNAPSHOT/"
  exec bash "$TILEWISE_SNAPSHOT/bench/h200.sh" "$@"
fi
FINAL=${OUT:-/tmp/tilewise-out}   # the device tool brings back at most 8 files: everything goes into one tarball
OUT=/tmp/tilewise-results
mkdir -p "$OUT" "$FINAL"
export PYTHONPATH=src PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for stage in "$@"; do
  start=$(date +%s)
  case "$stage" in
    tests)   # TESTS_PARALLEL=1: one pytest process per path of TESTS, side by side (for compile-bound tests)
      if [ -n "${TESTS_PARALLEL:-}" ]; then
        i=0
        for path in ${TESTS:-tests}; do
          i=$((i + 1))
          timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu -p no:cacheprovider "$path" > "$OUT/tests_$i.log" 2>&1 &
        done
        wait
      else
        timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests} > "$OUT/tests.log" 2>&1
      fi ;;
    attention|fused|cross_entropy|fp8|dataloader|checkpoint|e2e|e2e_ab|distributed|host_overhead|host_threads|multigpu|convergence|fp8_transpose_probe|attention_clocks|host_trace|adamw|fp8_attention_ablate|linear|mlp|embedding|gemm_tune|attention_sm90|attention_sm90_bwd|fp8_attention_sm90|fp8_attention_sm90_bwd|attention_sm90_bwd_ablate|fp8_attention_sm90_bwd_probe|softmax_rows|attention_passes)
      timeout ${BENCH_TIMEOUT:-300} python3 "bench/$stage.py" --out "$OUT" ${QUICK:+--quick} ${BENCH_ARGS:-} > "$OUT/$stage.log" 2>&1 ;;
    train124m|train124m-ref)   # the trainer on GPT-2 124M: Triton ops (auto) or the PyTorch reference ops
      ops=auto; [ "$stage" = train124m-ref ] && ops=reference
      TILEWISE_OPS=$ops timeout ${TRAIN_TIMEOUT:-300} python3 -m tilewise train --preset gpt2-124m \
        --set train.max_steps=${STEPS:-150} --set train.eval_every=10000 --set train.log_every=25 \
        --set train.progress=false --set checkpoint.every=0 --set train.out_dir="\"/tmp/$stage\"" \
        > "$OUT/$stage.log" 2>&1
      cp /tmp/$stage/summary.json "$OUT/${stage}_summary.json" 2>/dev/null
      cp /tmp/$stage/metrics.jsonl "$OUT/${stage}_metrics.jsonl" 2>/dev/null ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "== $stage: exit $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/stages.log"
  tar czf "$FINAL/results.tgz" -C "$OUT" .   # after every stage, so a timeout still returns what ran
done
