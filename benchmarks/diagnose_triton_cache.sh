#!/usr/bin/env bash
# Does a second process on a warm machine reuse Triton's compiled kernels?  Runs
# benchmarks/diagnose_register_compile.py twice (VARIANTS, default "scalar_sort (1 register)") and lists the Triton
# cache entries the second process added: each is a kernel compiled again, whose metadata (<name>.json: constants,
# specialisation) shows what differed from the first process's entry of the same kernel.  Everything is packed into OUT/triton_cache.tar.gz.
#
#   bash benchmarks/diagnose_triton_cache.sh OUT
set -uo pipefail
OUT=${1:?usage: bash benchmarks/diagnose_triton_cache.sh OUT}
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
C=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
W=$(mktemp -d)
mkdir -p "$W/first" "$W/second" "$OUT"
for i in 1 2; do
    timeout "${SECONDS_PER_PROCESS:-150}" python3 "$REPO/benchmarks/diagnose_register_compile.py" --size d256 \
        --variants "${VARIANTS:-scalar_sort (1 register)}" > "$W/process$i.log" 2>&1
    echo "process $i rc=$?"; grep -v -i warn "$W/process$i.log" | tail -3
    ls "$C" | sort > "$W/after$i.txt"
done
comm -13 "$W/after1.txt" "$W/after2.txt" > "$W/added_by_second.txt"
echo "cache entries after the first process: $(wc -l < "$W/after1.txt"); added by the second: $(wc -l < "$W/added_by_second.txt")"
while read -r d; do for f in "$C/$d"/*.json; do [ -e "$f" ] && cp "$f" "$W/second/$d-$(basename "$f")"; done; done < "$W/added_by_second.txt"
while read -r d; do for f in "$C/$d"/*.json; do [ -e "$f" ] && cp "$f" "$W/first/$d-$(basename "$f")"; done; done < "$W/after1.txt"
ls "$W/second" | sed 's/^[^-]*-//' | sort | uniq -c | sort -rn | head -20
tar -czf "$OUT/triton_cache.tar.gz" -C "$W" .
