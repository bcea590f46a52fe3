#!/usr/bin/env bash
# The discovery API under an external client: wrk (one thread, pinned to one core) drives
# acquire->release pairs over keep-alive connections against the discovery API and against a
# bare hyper server with canned answers (the baseline), each pinned to the other core, one
# server at a time, alternating in every round so all see the same machine. The discovery API
# runs twice: `discovery` with the 1 s checkpoint only (--no-durable-leases) and `durable` with
# the lease journal (standalone's default: fsync with group commit before answering). Prints
# req/s, p50/p99 per run, the discovery API's share of bare hyper's req/s and durable's share of
# discovery's; exits non-zero if any response was not 2xx.
#
#   bash benches/wrk.sh                 # 3 rounds x {16, 64} connections x 10 s per server
#   EPO_WRK_ROUNDS=5 EPO_WRK_SECS=20 EPO_WRK_CONNECTIONS="16 64 256" bash benches/wrk.sh
#   EPO_WRK_CLIENT_CPU=0 EPO_WRK_SERVER_CPU=1 (the defaults) choose the cores;
#   EPO_WRK_NICE=-5 runs client and server ahead of builds sharing the machine (the script then
#   runs in a session of its own whose autogroup gets that niceness: with autogroup scheduling,
#   which Linux enables by default, a process's own niceness does not count against other
#   sessions' processes);
#   EPO_WRK_DURABLE=0 leaves out the durable runs; EPO_BENCH_STATE_DIR=DIR puts the journal on
#   DIR's file system (default: the system's temp folder);
#   EPO_WRK_COMPARE_BIN=path/to/another/discovery_bench_server adds that build's discovery API
#   (e.g. from another branch) as a third server in every round.
set -euo pipefail
cd "$(dirname "$0")/.."

# A session of its own, so the autogroup's niceness below is this benchmark's alone.
if [ "${EPO_WRK_NICE:-0}" != 0 ] && [ -z "${EPO_WRK_OWN_SESSION:-}" ] && command -v setsid >/dev/null; then
  EPO_WRK_OWN_SESSION=1 exec setsid -w bash "$0" "$@"
fi
if [ -n "${EPO_WRK_OWN_SESSION:-}" ] && [ -w /proc/self/autogroup ]; then
  echo "${EPO_WRK_NICE}" >/proc/self/autogroup 2>/dev/null || echo "could not set the autogroup's niceness" >&2
fi

rounds=${EPO_WRK_ROUNDS:-3}
secs=${EPO_WRK_SECS:-10}
connections=${EPO_WRK_CONNECTIONS:-16 64}
client_cpu=${EPO_WRK_CLIENT_CPU:-0}
server_cpu=${EPO_WRK_SERVER_CPU:-1}
niceness=${EPO_WRK_NICE:-0}

if ! command -v wrk >/dev/null; then
  echo "installing wrk (Debian package)" >&2
  apt-get install -y wrk >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y wrk >/dev/null; }
fi
command -v taskset >/dev/null || { echo "taskset (util-linux) is needed" >&2; exit 1; }

cargo build --release --example discovery_bench_server >&2
target=${CARGO_TARGET_DIR:-target}
server_bin="$target/release/examples/discovery_bench_server"
script=benches/wrk/acquire_release.lua
work=$(mktemp -d)
server_pid=
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

durable_mode=" durable"
[ "${EPO_WRK_DURABLE:-1}" = 0 ] && durable_mode=
modes="bare discovery${durable_mode}${EPO_WRK_COMPARE_BIN:+ compare}"

# Starts a server, waits for its address; sets server_pid and addr.
start_server() {
  local bin=$server_bin mode=$1
  if [ "$mode" = compare ]; then bin=$EPO_WRK_COMPARE_BIN mode=discovery; fi
  : >"$work/server.out"
  nice -n "$niceness" taskset -c "$server_cpu" "$bin" "$mode" >"$work/server.out" 2>"$work/server.err" &
  server_pid=$!
  for _ in $(seq 1 600); do
    addr=$(sed -n 's/^listening on //p' "$work/server.out")
    [ -n "$addr" ] && return 0
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.err" >&2; exit 1; }
    sleep 0.1
  done
  echo "server $1 did not start" >&2
  exit 1
}

stop_server() {
  kill "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=
}

# CPU time (user + system, in clock ticks) the server process has used.
server_ticks() {
  awk '{ print $14 + $15 }' "/proc/$server_pid/stat"
}

# Runs wrk against $addr; prints "rps p50_ms p99_ms cpu_us_per_request non2xx".
measure() {
  local conns=$1 out t0 t1
  # Warm-up: connections, allocator, caches.
  nice -n "$niceness" taskset -c "$client_cpu" wrk -t1 -c"$conns" -d2s -s "$script" "http://$addr" >/dev/null
  t0=$(server_ticks)
  out=$(nice -n "$niceness" taskset -c "$client_cpu" wrk -t1 -c"$conns" -d"${secs}s" -s "$script" "http://$addr")
  t1=$(server_ticks)
  echo "$out" | awk -v ticks=$((t1 - t0)) -v hz="$(getconf CLK_TCK)" '/^RESULT/ {
      for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
      printf "%.0f %.2f %.2f %.2f %d\n", v["requests"] / v["seconds"], v["p50_us"] / 1000, v["p99_us"] / 1000,
        1e6 * ticks / hz / v["requests"], v["non2xx"] + v["socket_errors"]
    }'
}

# Per server and connection count over the rounds: the median share, the lowest share and the
# worst p99, from lines "round conns p99_ms share_percent server".
medians() {
  awk 'NF {
      k = $5 " " $2
      n[k]++; r[k, n[k]] = $4
      if (!(k in worst) || $3 > worst[k]) worst[k] = $3
      if (!(k in low) || $4 < low[k]) low[k] = $4
    }
    END {
      for (c in n) {
        # median of the rounds (insertion sort: a handful of values)
        m = n[c]
        for (i = 1; i <= m; i++) v[i] = r[c, i]
        for (i = 2; i <= m; i++) { x = v[i]; j = i - 1; while (j > 0 && v[j] > x) { v[j + 1] = v[j]; j-- } v[j + 1] = x }
        med = (m % 2) ? v[(m + 1) / 2] : (v[m / 2] + v[m / 2 + 1]) / 2
        split(c, kc, " ")
        printf "  %-9s %3s connections over %d round(s): median %.1f %%, lowest %.1f %%, worst p99 %.2f ms\n", kc[1], kc[2], m, med, low[c], worst[c]
      }
    }'
}

echo "wrk: 1 thread on CPU $client_cpu; server on CPU $server_cpu; acquire->release pairs; ${secs}s per run; $rounds round(s); nice $niceness"
echo "journal folder (durable): $(df -T "${EPO_BENCH_STATE_DIR:-${TMPDIR:-/tmp}}" | awk 'NR == 2 { print $1 " (" $2 ")" }')"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-6s %-6s %-10s %12s %9s %9s %14s\n' round conns server req/s p50_ms p99_ms server_cpu_us/req
failures=0
summary=""
durable_summary=""
for round in $(seq 1 "$rounds"); do
  for conns in $connections; do
    declare -A rps p99s
    for mode in $modes; do
      start_server "$mode"
      read -r r p50 p99 cpu bad < <(measure "$conns")
      stop_server
      rps[$mode]=$r
      p99s[$mode]=$p99
      printf '%-6s %-6s %-10s %12s %9s %9s %14s\n' "$round" "$conns" "$mode" "$r" "$p50" "$p99" "$cpu"
      if [ "$bad" -ne 0 ]; then
        echo "  $bad responses were not 2xx (or socket errors)" >&2
        failures=$((failures + 1))
      fi
      if [ "$mode" = durable ]; then
        durable_summary+=$(printf '%s %s %s %s %s\n' "$round" "$conns" "$p99" \
          "$(awk -v a="${rps[durable]}" -v b="${rps[discovery]}" 'BEGIN { printf "%.1f", 100 * a / b }')" durable)
        durable_summary+=$'\n'
      fi
      # durable's target is against discovery without the journal (below), not bare hyper.
      if [ "$mode" != bare ] && [ "$mode" != durable ]; then
        summary+=$(printf '%s %s %s %s %s %s\n' "$round" "$conns" "$p99" \
          "$(awk -v a="${rps[$mode]}" -v b="${rps[bare]}" 'BEGIN { printf "%.1f", 100 * a / b }')" "$mode" "${p99s[bare]}")
        summary+=$'\n'
      fi
    done
  done
done
echo
echo "discovery API as a share of bare hyper's req/s (targets: >= 60 %, p99 < 2 ms in every run):"
echo "$summary" | awk 'NF {
    ok = ($4 >= 60 && $3 < 2) ? "ok" : "MISSED"
    printf "  %-9s round %s, %3s connections: %5s %% of bare hyper, p99 %s ms (bare hyper: %s ms)  %s\n", $5, $1, $2, $4, $3, $6, ok
  }'
echo "$summary" | medians
if [ -n "$durable_summary" ]; then
  echo
  echo "durable (lease journal) as a share of discovery's req/s without it (targets: >= 80 %, p99 < 3 ms at 64 connections):"
  echo "$durable_summary" | awk 'NF { printf "  round %s, %3s connections: %5s %% of discovery, p99 %s ms\n", $1, $2, $4, $3 }'
  echo "$durable_summary" | medians
  # The targets are at 64 connections. With fewer, each client's next operation waits for the
  # sync of its last (16 clients: ~130 µs of serving, then a ~50 µs sync with nothing else to
  # do), so the share there is reported, not judged.
  echo "$durable_summary" | awk 'NF && $2 == 64 { runs++; if ($4 < 80 || $3 >= 3) missed++ }
    END {
      if (runs == 0) print "durable: no run at 64 connections, nothing judged"
      else if (missed == 0) printf "durable PASS: %d of %d runs at 64 connections at >= 80 %% of discovery with p99 < 3 ms\n", runs, runs
      else printf "durable FAIL: %d of %d runs at 64 connections under 80 %% of discovery or with p99 >= 3 ms\n", missed, runs
    }'
fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
# The verdict: every run of every discovery server at >= 60 % of bare hyper with p99 < 2 ms.
# A bare hyper p99 over 2 ms in the same round means the machine, not the server, was slow then.
echo "$summary" | awk 'NF { runs++; if ($4 < 60 || $3 >= 2) { missed++; if ($6 >= 2) noisy++ } }
  END {
    if (missed == 0) printf "PASS: %d of %d runs at >= 60 %% of bare hyper with p99 < 2 ms\n", runs, runs
    else printf "FAIL: %d of %d runs missed >= 60 %% of bare hyper or p99 < 2 ms (in %d of them bare hyper p99 was >= 2 ms too: a busy machine)\n", missed, runs, noisy
  }'
[ "$failures" -eq 0 ]
