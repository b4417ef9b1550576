#!/usr/bin/env bash
# Where host writes wait, seen from the kernel's scheduler (docs/space.md, "Yielding locks").
# Attaches bpftrace to the nbdkit plugin's write callback and to the scheduler's switch and
# wake-up tracepoints for SECONDS, while a workload runs against a served store, and prints:
#   - per write, the time preempted (runnable, not running), woken but not yet running, and
#     asleep, summed separately for writes slower than SLOW_US (default 2000) and the rest;
#   - who took the core from a write in flight, and the waits that followed;
#   - sched_yield calls from the server's threads (a spinning lock yields the core).
# Needs bpftrace (apt-get install bpftrace) and root; not part of CI.
#   usage: bash scripts/trace-write-waits.sh [SECONDS=20] [PLUGIN=target/release/libnbdkit_zdisk_plugin.so]
#   e.g.   bash scripts/consistency.sh 1G 10 45 & sleep 40; bash scripts/trace-write-waits.sh 20
# For user stacks in the yield counts, build with RUSTFLAGS="-C force-frame-pointers=yes".
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-20}
plugin=$(realpath "${2:-$here/target/release/libnbdkit_zdisk_plugin.so}")
slow_us=${SLOW_US:-2000}
command -v bpftrace >/dev/null || { echo "bpftrace is not installed (apt-get install bpftrace)" >&2; exit 1; }
# The nbdkit crate's C entry point for pwrite (a mangled Rust name).
symbol=$(nm "$plugin" | awk '/ _ZN6nbdkit3ffi6pwrite/ {s = $3} END {print s}')
[[ -n $symbol ]] || { echo "no nbdkit pwrite entry point in $plugin" >&2; exit 1; }
bpftrace -e "
uprobe:$plugin:$symbol { @start[tid] = nsecs; @pre[tid] = 0; @wake[tid] = 0; @sleep[tid] = 0; }

tracepoint:sched:sched_switch
{
  if (@start[args->prev_pid]) {
    @off[args->prev_pid] = nsecs;
    // 1: preempted (still runnable), 0: went to sleep.
    @runnable[args->prev_pid] = args->prev_state == 0 ? 1 : 0;
    if (args->prev_state == 0) { @preempted_by[args->next_comm] = count(); @by[args->prev_pid] = args->next_comm; }
  }
  if (@start[args->next_pid] && @off[args->next_pid]) {
    \$d = (uint64)(nsecs - @off[args->next_pid]);
    if (@runnable[args->next_pid] == 1) {
      @pre[args->next_pid] += \$d;
      @preempted_wait_us_by[@by[args->next_pid]] = sum(\$d / 1000);
    } else {
      @wake[args->next_pid] += \$d;
    }
    delete(@off[args->next_pid]);
  }
}

tracepoint:sched:sched_waking
{
  if (@start[args->pid] && @off[args->pid] && @runnable[args->pid] == 0) {
    @sleep[args->pid] += (uint64)(nsecs - @off[args->pid]);
    @off[args->pid] = nsecs;
    @runnable[args->pid] = 2;
  }
}

tracepoint:syscalls:sys_enter_sched_yield /comm == \"nbdkit\" || comm == \"zdisk-worker\" || comm == \"zdisk-writer\"/
{
  @yields[comm, ustack(4)] = count();
}

uretprobe:$plugin:$symbol /@start[tid]/
{
  \$us = (uint64)(nsecs - @start[tid]) / 1000;
  \$slow = \$us > $slow_us ? 1 : 0;
  @writes[\$slow] = count();
  @total_us[\$slow] = sum(\$us);
  @preempted_us[\$slow] = sum(@pre[tid] / 1000);
  @woken_waiting_us[\$slow] = sum(@wake[tid] / 1000);
  @asleep_us[\$slow] = sum(@sleep[tid] / 1000);
  @latency_us = hist(\$us);
  delete(@start[tid]); delete(@pre[tid]); delete(@wake[tid]); delete(@sleep[tid]);
}

interval:s:$seconds { exit(); }
END {
  clear(@start); clear(@pre); clear(@wake); clear(@sleep); clear(@off); clear(@runnable); clear(@by);
  printf(\"[1]: writes slower than $slow_us us, [0]: the rest\n\");
}
" 2>&1 | grep -Ev "WARNING|~~|RLIMIT_MEMLOCK|^ +[@$]|^ +if|^$"
