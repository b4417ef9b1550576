#!/bin/bash
# A `git bisect run` step for write amplification: builds the checked-out commit, runs the
# full space bench for one pattern at one utilisation, and calls the commit good when WA is
# below a threshold. Every run's line is appended to $WA_BISECT_OUT, so the numbers of every
# step stay (docs/space.md, "The full bench's geometry, and where uniform's 1.50 went").
#
#   git worktree add /tmp/wt GOOD && cd /tmp/wt && git bisect start BAD GOOD
#   WA_THRESHOLD=1.55 git bisect run /path/to/scripts/wa-bisect.sh
#
# WA_THRESHOLD (required), WA_UTIL (0.8), WA_PATTERN (uniform), WA_BISECT_OUT
# (/tmp/wa-bisect.out), CARGO_TARGET_DIR (shared between steps: incremental builds).
# Pacing is off (ZDISK_PACING=off) so that commits from before it was the default compare.
set -u
threshold=${WA_THRESHOLD:?set WA_THRESHOLD, e.g. 1.55}
util=${WA_UTIL:-0.8}
pattern=${WA_PATTERN:-uniform}
out=${WA_BISECT_OUT:-/tmp/wa-bisect.out}
commit=$(git rev-parse --short HEAD)
log=$(mktemp /tmp/wa-bisect-"$commit".XXXX.log)
ZDISK_PACING=off ZDISK_BENCH_DIR=${ZDISK_BENCH_DIR:-/tmp} ZDISK_BENCH_UTIL=$util ZDISK_BENCH_PATTERNS=$pattern \
    ZDISK_BENCH_OP= ZDISK_BENCH_NO_RECOVERY=1 cargo bench -p zdisk-engine --bench space >"$log" 2>&1 || exit 125
# The table row: | 80% | [pattern |] working set | WA | ... (older benches have no pattern column).
wa=$(grep -E '^\| +[0-9]+%' "$log" | tr '|' '\n' | grep -E '^ *[0-9]\.[0-9]{3} *$' | head -1 | tr -d ' ')
[ -n "$wa" ] || exit 125
echo "$commit WA=$wa $(grep 'per host byte' "$log" | tail -1)" >>"$out"
awk -v wa="$wa" -v t="$threshold" 'BEGIN { exit !(wa < t) }'
