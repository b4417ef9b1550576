#!/usr/bin/env bash
# The engine source files a 4 KiB host write runs code in (docs/architecture.md, "The data
# path through them"): runs crates/engine/examples/write_path.rs (a debug build, so nothing
# is inlined away) under callgrind, collecting only inside `Store::write` on the writing
# thread, and lists the files of crates/engine/src whose functions ran, with how many of
# their functions did. Usage: scripts/write-path.sh [COUNT]   (needs valgrind)
set -euo pipefail
cd "$(dirname "$0")/.."
count=${1:-64}
command -v valgrind >/dev/null || { echo "write-path.sh: valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
cargo build -q -p zdisk-engine --example write_path
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
valgrind --tool=callgrind --callgrind-out-file="$work/out" \
  --toggle-collect='zdisk_engine::store::Store::write' \
  "${CARGO_TARGET_DIR:-target}/debug/examples/write_path" "$work/store" "$count" 2>"$work/log" >/dev/null
# Every function with cost inside the toggle, with its file: `fl=` names files, `fn=` the
# functions in the current file.
python3 - "$work/out" <<'PY'
import re, sys, collections
files, names = {}, {}
current = None
funcs = collections.defaultdict(set)
for line in open(sys.argv[1], encoding="utf-8", errors="replace"):
    line = line.rstrip("\n")
    m = re.match(r"^(c?fl|c?fi|c?fe)=\((\d+)\)(?: (.*))?$", line)
    if m:
        if m.group(3):
            files[m.group(2)] = m.group(3)
        if m.group(1) == "fl":
            current = m.group(2)
        continue
    m = re.match(r"^(c?fn)=\((\d+)\)(?: (.*))?$", line)
    if m:
        if m.group(3):
            names[m.group(2)] = m.group(3)
        if m.group(1) == "fn":
            path = files.get(current, "")
            if "crates/engine/src/" in path:
                funcs[path.split("crates/engine/src/")[1]].add(names.get(m.group(2), m.group(2)))
for f in sorted(funcs):
    print(f"{len(funcs[f]):4d}  {f}")
print(f"{len(funcs)} engine files")
PY
