#!/usr/bin/env bash
# The engine source files a 4 KiB host write, a 4 KiB read and an open run code in
# (docs/architecture.md, "The data path through them"): runs crates/engine/examples/data_path.rs
# under callgrind, collecting only inside `Store::write`, `Store::read` or `Store::open` (the
# second open replays the writes; threads the open starts are not counted), and lists the
# files of crates/engine/src whose functions ran, with how many of their functions did — in
# two builds:
#   release: the build zdisk ships (`--release`, line tables on): the calls a path makes,
#            after the compiler inlined the small helpers into their callers;
#   debug:   nothing inlined, so every function counts, down to derived comparisons
#            (`Lba == Lba`), lock guards' `Deref` and `format::Writer::u32`.
# Usage: scripts/data-path.sh [COUNT [DATA [PATHS]]]   DATA: half (2:1, the default), random
# or zero; PATHS: any of write, read, open (default all three, e.g. "write").
# Needs valgrind; DATA_PATH_FUNCS=1 lists the functions.
set -euo pipefail
cd "$(dirname "$0")/.."
count=${1:-64}
data=${2:-half}
paths=${3:-write read open}
command -v valgrind >/dev/null || { echo "data-path.sh: valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cargo build -q --release -p zdisk-engine --example data_path
cargo build -q -p zdisk-engine --example data_path
for path in $paths; do
  for build in release debug; do
    valgrind --tool=callgrind --callgrind-out-file="$work/$build.out" \
      --toggle-collect="zdisk_engine::store::Store::$path" \
      "${CARGO_TARGET_DIR:-target}/$build/examples/data_path" "$work/store-$build" "$count" "$data" 2>"$work/log" >/dev/null ||
      { cat "$work/log" >&2; exit 1; }
    echo "== $path, $build build"
    # Every function with cost inside the toggle, with its file: `fl=` names files, `fn=` the
    # functions in the current file.
    python3 - "$work/$build.out" <<'PY'
import collections, os, re, sys
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
    if os.environ.get("DATA_PATH_FUNCS"):
        for n in sorted(funcs[f]):
            print(f"        {n}")
print(f"{len(funcs)} engine files")
PY
  done
done
