#!/usr/bin/env bash
# Nsight Compute profile of bench/attention_ncu.py's kernels (one launch each), on a Firecracker H200:
# the report, its details page and each kernel's SASS with stall samples, under ${OUT:-/tmp/attention-ncu}.
# Usage: bash bench/attention_ncu.sh [attention_ncu.py arguments]; NCU_SET picks ncu's --set (default full)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/attention-ncu}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
"$NCU" --version | tail -1
timeout ${NCU_TIMEOUT:-400} "$NCU" --clock-control none --profile-from-start off --set ${NCU_SET:-full} -f -o "$OUT/attention" \
  python3 bench/attention_ncu.py "$@" > "$OUT/ncu_run.log" 2>&1
echo "ncu exit $?"; tail -5 "$OUT/ncu_run.log"
"$NCU" -i "$OUT/attention.ncu-rep" --page details > "$OUT/details.txt" 2>&1
i=0   # one SASS page per profiled launch, in launch order
for kernel in $("$NCU" -i "$OUT/attention.ncu-rep" --page raw --csv --metrics launch__grid_size 2>/dev/null \
                | python3 -c "import csv,sys; print(' '.join(r['Kernel Name'] for r in csv.DictReader(sys.stdin) if r.get('ID', '').isdigit()))"); do
  "$NCU" -i "$OUT/attention.ncu-rep" --page source --print-source sass --csv --launch-skip $i --launch-count 1 \
    > "$OUT/sass_${i}_$kernel.csv" 2>&1
  i=$((i + 1))
done
[ $i -gt 0 ] || "$NCU" -i "$OUT/attention.ncu-rep" --page source --print-source sass --csv > "$OUT/sass_all.csv" 2>&1
# the device tool brings back few files: the pages in one tarball (the report itself is ~20 MB)
tar czf "$OUT/ncu_pages.tgz" -C "$OUT" details.txt ncu_run.log $(cd "$OUT" && ls sass_*.csv) && rm -f "$OUT"/sass_*.csv
ls -la "$OUT"
