#!/usr/bin/env bash
# The lease API of the operator binary itself, against a bare hyper server in the same run.
#
# Servers (each pinned to one core, wrk with one thread pinned to the other):
#   bare          bare hyper with canned answers of the same sizes (examples/discovery_bench_server
#                 bare): the baseline every share is taken against, measured in the same round
#   operator      `egress-proxies-operator standalone --no-durable-leases` as a user starts it: three
#                 Squids of the `local` provider, health checks through them, logging, metrics,
#                 upkeep (reaper and the 1 s checkpoint) as shipped
#   durable       the same with the lease journal (standalone's default)
#   bare-durable  bare hyper whose every answer first waits for one record synced through the same
#                 lease journal (examples/discovery_bench_server bare-durable): the floor of any
#                 server that makes each answer durable on this disk; durable runs print its share
#                 next to theirs
#   pool          the operator over 10,003 proxies: the three Squids and 10,000 proxies of the
#                 benchmark-only `bench-memory` provider (the `bench-provider` cargo feature, which
#                 no shipped build has), their health checks sent through the three Squids
#                 (moved to the client's core once all are healthy: in production those proxies
#                 are other hosts)
#   pool-durable  the same with the lease journal
#   example       (EPO_WRK_EXAMPLE=1) the old figure: examples/discovery_bench_server discovery
# wrk drives acquire->release pairs (benches/wrk/acquire_release.lua) over keep-alive
# connections. Prints req/s, p50/p99 and the server's CPU per request per run, each operator
# run's share of bare hyper's req/s in the same round, and the verdicts.
#
# Then, unless EPO_WRK_CALLGRIND=0, the machine-independent figure: each of bare hyper and the
# operator (three Squids, --no-durable-leases; `pool` too with EPO_WRK_CALLGRIND_POOL=1) runs
# under valgrind's callgrind; after a warm-up the counters are zeroed, wrk sends
# acquire->release pairs for EPO_WRK_CALLGRIND_SECS seconds, and the user-space instructions are
# dumped: per pair, with the periodic work (checkpoint and reaper, health engine, the manifests
# runner, provider monitor, GC: each task's root's inclusive instructions) reported apart per second.
# Target: the operator's instructions per pair <= 1.5x bare hyper's (PASS/FAIL).
# EPO_WRK_CALLGRIND_SERVERS="pool" profiles only those servers.
#
# Then, unless EPO_WRK_REDIS=0, a Redis + Lua lease of the same semantics (benches/redis_lease.sh)
# in memory and with appendfsync always, in pairs per second against the operator's (and, as
# floors, against bare hyper's and bare-durable's).
#
#   bash benches/wrk.sh                          # 2 rounds x {16, 64} connections x 10 s per server
#   EPO_WRK_ROUNDS=3 EPO_WRK_SECS=20 EPO_WRK_CONNECTIONS="16 64" bash benches/wrk.sh
#   EPO_WRK_SERVERS="bare operator" bash benches/wrk.sh   # a subset (bare is always run)
#   EPO_WRK_CLIENT_CPU=0 EPO_WRK_SERVER_CPU=1 (the defaults) choose the cores;
#   EPO_WRK_NICE=-5 runs client and server ahead of builds sharing the machine (in a session of
#   its own whose autogroup gets that niceness); EPO_BENCH_STATE_DIR=DIR puts the state folders
#   (and so the lease journal) on DIR's file system.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/lib.sh

if [ "${EPO_WRK_NICE:-0}" != 0 ] && [ -z "${EPO_WRK_OWN_SESSION:-}" ] && command -v setsid >/dev/null; then
  EPO_WRK_OWN_SESSION=1 exec setsid -w bash "$0" "$@"
fi
if [ -n "${EPO_WRK_OWN_SESSION:-}" ] && [ -w /proc/self/autogroup ]; then
  echo "${EPO_WRK_NICE}" >/proc/self/autogroup 2>/dev/null || echo "could not set the autogroup's niceness" >&2
fi

rounds=${EPO_WRK_ROUNDS:-2}
secs=${EPO_WRK_SECS:-10}
connections=${EPO_WRK_CONNECTIONS:-16 64}
client_cpu=${EPO_WRK_CLIENT_CPU:-0}
server_cpu=${EPO_WRK_SERVER_CPU:-1}
niceness=${EPO_WRK_NICE:-0}
servers=${EPO_WRK_SERVERS:-operator durable bare-durable pool pool-durable}
[ "${EPO_WRK_EXAMPLE:-0}" = 1 ] && servers+=" example"
pool_size=${EPO_WRK_POOL:-10000}
cg_secs=${EPO_WRK_CALLGRIND_SECS:-20}

# wrk: Debian's package (4.1.0), so every machine runs the same client build.
need_build_deps
need wrk wrk
need taskset util-linux
need squid squid
[ "${EPO_WRK_CALLGRIND:-1}" = 0 ] || need valgrind valgrind

cargo build --release --features bench-provider --bin egress-proxies-operator --example discovery_bench_server >&2
target=${CARGO_TARGET_DIR:-target}
operator_bin="$target/release/egress-proxies-operator"
example_bin="$target/release/examples/discovery_bench_server"
script=benches/wrk/acquire_release.lua
work=$(mktemp -d "${EPO_BENCH_STATE_DIR:-${TMPDIR:-/tmp}}/epo-wrk.XXXXXX")
# Squid drops to user proxy, which must reach the local provider's stateDir.
chmod 755 "$work"
server_pid=
token=bench-token-$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
export EPO_TOKEN=$token

cleanup() {
  stop_server
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 143' INT TERM




# The local provider's Squids inherit the server's CPU pin. In the pools they carry the health
# probes of 10,003 proxies (about 12 % of a core at 333 probes a second), which in production
# run on as many other hosts: they move to the client's core, so the server's core runs the
# operator alone (its own side of the probes stays there).
squids_to_client_core() {
  local pid
  for pid in $(grep -l -a "$work" /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3); do
    grep -q -a squid "/proc/$pid/cmdline" 2>/dev/null && taskset -a -p -c "$client_cpu" "$pid" >/dev/null 2>&1 || true
  done
}

# Starts server $1 (optionally under the command prefix $2, e.g. valgrind); sets server_pid and
# addr, and waits until it serves leases (the operator: until every proxy is Healthy).
start_server() {
  local mode=$1 prefix=${2:-} pool=0 port expect=3 args=() dir
  : >"$work/server.out"
  : >"$work/server.err"
  case $mode in
    bare | bare-durable | example)
      # shellcheck disable=SC2086
      nice -n "$niceness" taskset -c "$server_cpu" $prefix "$example_bin" "${mode/example/discovery}" \
        >"$work/server.out" 2>"$work/server.err" &
      server_pid=$!
      addr=$(listening_address "$work/server.out" "$server_pid")
      return 0
      ;;
    pool*) pool=$pool_size expect=$((pool_size + 3)) ;;
  esac
  port=$(free_port)
  dir=$work/$mode
  make_folder "$dir" "$pool" "$port"
  args=(standalone --manifests "$dir/manifests" --providers-config "$dir/providers.yaml"
    --state "$dir/state" --listen "127.0.0.1:$port" --discovery-tokens "$dir/tokens")
  case $mode in *durable) ;; *) args+=(--no-durable-leases) ;; esac
  addr=127.0.0.1:$port
  # shellcheck disable=SC2086
  nice -n "$niceness" taskset -c "$server_cpu" $prefix "$operator_bin" "${args[@]}" \
    >"$work/server.out" 2>"$work/server.err" &
  server_pid=$!
  local deadline=$((SECONDS + ${EPO_WRK_START_SECS:-900})) healthy=0
  while [ "$SECONDS" -lt "$deadline" ]; do
    kill -0 "$server_pid" 2>/dev/null || { tail -20 "$work/server.err" >&2; exit 1; }
    healthy=$(healthy_count)
    if [ "$healthy" -ge "$expect" ]; then
      squids_to_client_core
      return 0
    fi
    sleep 1
  done
  echo "server $mode: $healthy of $expect proxies Healthy after ${EPO_WRK_START_SECS:-900}s" >&2
  tail -20 "$work/server.err" >&2
  exit 1
}

server_ticks() { awk '{ print $14 + $15 }' "/proc/$server_pid/stat"; }

# Runs wrk against $addr for $2 seconds (after a warm-up of $3 seconds); prints
# "rps p50_ms p99_ms cpu_us_per_request non2xx requests".
measure() {
  local conns=$1 dur=${2:-$secs} warm=${3:-2} out t0 t1
  nice -n "$niceness" taskset -c "$client_cpu" wrk -t1 -c"$conns" -d"${warm}s" -s "$script" "http://$addr" >/dev/null
  t0=$(server_ticks)
  out=$(nice -n "$niceness" taskset -c "$client_cpu" wrk -t1 -c"$conns" -d"${dur}s" -s "$script" "http://$addr")
  t1=$(server_ticks)
  echo "$out" | awk -v ticks=$((t1 - t0)) -v hz="$(getconf CLK_TCK)" '/^RESULT/ {
      for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
      printf "%.0f %.2f %.2f %.2f %d %d\n", v["requests"] / v["seconds"], v["p50_us"] / 1000, v["p99_us"] / 1000,
        1e6 * ticks / hz / v["requests"], v["non2xx"] + v["socket_errors"], v["requests"]
    }'
}

echo "egress-proxies-operator lease API: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+changes'), $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); wrk $(wrk -v 2>&1 | head -1 | awk '{ print $2 }')"
echo "wrk: 1 thread on CPU $client_cpu; server on CPU $server_cpu; acquire->release pairs; ${secs}s per run; $rounds round(s); nice $niceness"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-6s %-6s %-13s %10s %8s %8s %16s\n' round conns server req/s p50_ms p99_ms server_cpu_us/req
failures=0
results=$work/results
: >"$results"
for round in $(seq 1 "$rounds"); do
  for mode in bare $servers; do
    start_server "$mode"
    for conns in $connections; do
      read -r r p50 p99 cpu bad _ < <(measure "$conns")
      printf '%-6s %-6s %-13s %10s %8s %8s %16s\n' "$round" "$conns" "$mode" "$r" "$p50" "$p99" "$cpu"
      echo "$round $conns $mode $r $p99" >>"$results"
      if [ "$bad" -ne 0 ]; then
        echo "  $bad responses were not 2xx (or socket errors)" >&2
        tail -5 "$work/server.err" >&2
        failures=$((failures + 1))
      fi
    done
    stop_server
  done
done

# Shares of bare hyper's req/s in the same round and connection count.
echo
echo "req/s as a share of bare hyper's in the same round (targets: >= 60 %; p99 < 2 ms, durable < 3 ms at 64 connections):"
awk '
  { rps[$1, $2, $3] = $4; p99[$1, $2, $3] = $5; if (!($3 in seen)) { seen[$3] = 1; order[++n] = $3 } key[$1, $2] = 1 }
  END {
    for (k in key) { split(k, rc, SUBSEP); rounds[rc[1]] = 1; conns[rc[2]] = 1 }
    for (i = 1; i <= n; i++) {
      m = order[i]; if (m == "bare") continue
      for (c in conns) {
        lo = 1e9; hi = 0; worst = 0; cnt = 0
        for (r in rounds) {
          if (!((r, c, m) in rps)) continue
          s = 100 * rps[r, c, m] / rps[r, c, "bare"]; cnt++
          if (s < lo) lo = s; if (s > hi) hi = s; if (p99[r, c, m] > worst) worst = p99[r, c, m]
        }
        if (!cnt) continue
        limit = (m ~ /durable/) ? 3 : 2
        judged = (m ~ /durable/) ? (c == 64) : 1
        ok = (lo >= 60 && worst < limit) ? "PASS" : "FAIL"
        if (m == "bare-durable") ok = "(the durable floor, not judged)"
        else if (m == "example") ok = "(second figure, not judged)"
        else if (!judged) ok = "(reported, judged at 64)"
        floor = ""
        if (m ~ /durable/ && m != "bare-durable") {
          flo = 1e9; fhi = 0
          for (r in rounds) if ((r, c, "bare-durable") in rps) {
            f = 100 * rps[r, c, "bare-durable"] / rps[r, c, "bare"]
            if (f < flo) flo = f; if (f > fhi) fhi = f
          }
          if (fhi > 0) floor = sprintf(" (the durable floor: %.1f-%.1f %%)", flo, fhi)
        }
        printf "  %-13s %3s conns: %5.1f-%5.1f %% of bare hyper over %d round(s), worst p99 %.2f ms  %s%s\n", m, c, lo, hi, cnt, worst, ok, floor
      }
    }
  }' "$results" | sort
echo "load average after wrk: $(cut -d' ' -f1-3 /proc/loadavg)"

# --- callgrind: instructions per acquire->release pair -----------------------------------
# Everything the process executes in the window, less the periodic work below, divided by the
# pairs wrk completed: a request's whole cost (accept, scheduler, parsing, handler, allocator).
# Periodic work in a profile: per task that runs on a timer, the inclusive instructions of its
# root (the largest inclusive figure among the functions of its module), summed. The checkpoint's
# snapshot runs on the blocking pool, a root of its own.
periodic_instructions() {
  callgrind_annotate --inclusive=yes --threshold=100 --auto=no "$1" 2>/dev/null | awk '
    /^ *[0-9][0-9,]* \(/ {
      v = $1; gsub(",", "", v); v += 0; g = ""
      if ($0 ~ /BlockingTask</ && $0 ~ /checkpoint|journal/) g = "checkpoint-blocking"
      else if ($0 ~ /lease::checkpoint::|lease::journal::compaction/) g = "checkpoint"
      else if ($0 ~ /egress_proxies_operator::health::/) g = "health"
      else if ($0 ~ /egress_proxies_operator::standalone::(runner::|mode::run_standalone)/) g = "runner"
      else if ($0 ~ /egress_proxies_operator::monitor::/) g = "monitor"
      else if ($0 ~ /egress_proxies_operator::gc::/) g = "gc"
      if (g != "" && v > max[g]) max[g] = v
    }
    END { t = 0; d = ""; for (g in max) { t += max[g]; d = d sprintf(" %s=%.0f", g, max[g]) } printf "%.0f%s\n", t, (d == "" ? "" : " [" substr(d, 2) "]") }' | tr ' ' '_' | sed 's/_/ /'
}

callgrind_figure() {
  local mode=$1 out="$work/callgrind.$1" conns=16 requests total periodic ctl
  rm -f "$out".*
  start_server "$mode" "valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=$out.%p --dump-instr=no --collect-jumps=no --separate-threads=no"
  ctl=$server_pid
  # The valgrind process is the server's own pid (exec'd through nice and taskset).
  callgrind_control -i on "$ctl" >/dev/null
  nice -n "$niceness" taskset -c "$client_cpu" wrk -t1 -c"$conns" -d5s -s "$script" "http://$addr" >/dev/null
  callgrind_control -z "$ctl" >/dev/null
  local t0=$SECONDS
  read -r _ _ _ _ _ requests < <(measure "$conns" "$cg_secs" 1)
  callgrind_control -d "$ctl" >/dev/null
  local elapsed=$((SECONDS - t0))
  stop_server
  # callgrind_control -d wrote the window as the first numbered part: FILE.PID.1.
  local dump
  dump=$(ls "$out".*.1 2>/dev/null | head -1)
  if [ -n "${EPO_WRK_KEEP_PROFILES:-}" ]; then cp "$dump" "$EPO_WRK_KEEP_PROFILES/callgrind.$mode"; fi
  total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ && !done { gsub(",", "", $1); print $1; done = 1 }')
  local split
  read -r periodic split < <(periodic_instructions "$dump")
  echo "$mode $total $periodic $requests $elapsed $dump ${split:-}"
}


if [ "${EPO_WRK_CALLGRIND:-1}" != 0 ]; then
  echo
  echo "callgrind: user-space instructions per acquire->release pair (16 connections, ${cg_secs}s after a 5 s warm-up; valgrind serialises threads):"
  cg_modes=${EPO_WRK_CALLGRIND_SERVERS:-bare operator}
  [ "${EPO_WRK_CALLGRIND_POOL:-0}" = 1 ] && cg_modes+=" pool"
  declare -A per_pair
  for mode in $cg_modes; do
    read -r _ total periodic requests elapsed dump split < <(callgrind_figure "$mode")
    pairs=$((requests / 2))
    [ "$pairs" -gt 0 ] || { echo "  $mode: no pairs measured" >&2; failures=$((failures + 1)); continue; }
    per_pair[$mode]=$(( (total - periodic) / pairs ))
    printf '  %-9s %9d instructions per pair (%d pairs, %d instructions in %d s; periodic work apart: %d per second %s)\n' \
      "$mode" "${per_pair[$mode]}" "$pairs" "$total" "$elapsed" "$((periodic / (elapsed > 0 ? elapsed : 1)))" "$(echo "${split:-}" | tr '_' ' ')"
  done
  for mode in $cg_modes; do
    [ "$mode" = bare ] && continue
    [ -n "${per_pair[$mode]:-}" ] && [ -n "${per_pair[bare]:-}" ] || continue
    awk -v a="${per_pair[$mode]}" -v b="${per_pair[bare]}" -v m="$mode" 'BEGIN {
      r = a / b; printf "  %s / bare hyper: %.2fx instructions per pair (target <= 1.5x)  %s\n", m, r, (r <= 1.5 ? "PASS" : "FAIL") }'
  done
fi

if [ "${EPO_WRK_REDIS:-1}" != 0 ]; then
  echo
  bash benches/redis_lease.sh "$results" || failures=$((failures + 1))
fi
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
[ "$failures" -eq 0 ]
