#!/usr/bin/env bash
# The gateway of the operator binary against the same Squid reached directly, in one run.
#
# One core runs the servers (the target, the Squid, the operator), the other the client; every
# figure is read against the direct path measured in the same round:
#   direct        wrk -> Squid -> target: GETs in absolute form straight to the Squid
#   gateway       wrk -> gateway -> Squid -> target: the same GETs through `--gateway-listen`,
#                 a lease taken and ended per request (no session: the pool's any proxy)
#   session       the same with one sticky session (`bench;session=wrk`): one lease held
#   bare-hop      wrk -> bare hop -> Squid -> target: the cheapest forward-proxy hop hyper makes
#                 (examples/discovery_bench_server forward: one upstream connection per client
#                 connection, requests passed on unchanged; no pool, auth, lease or outcome), the
#                 floor under any hyper-based gateway's figure, reported beside the targets
# The operator is `egress-proxies-operator standalone` as a user starts it (durable leases,
# health checks, metrics, upkeep) with one local Squid, so both paths use the same Squid;
# EPO_GW_NO_DURABLE=1 adds --no-durable-leases. The target is bare hyper
# (examples/discovery_bench_server bare).
# Server CPU per request is the servers' user+system time over wrk's requests (the target, every
# Squid process, and the operator on the gateway's runs). Targets at 64 connections: the gateway
# adds <= 15 % to the CPU per request and <= 1 ms to p99.
#
# Then CONNECT tunnels: EPO_GW_TUNNELS (1,000) fetches of 1 MiB, each its own tunnel (`curl -p`),
# 8 at a time, directly through the Squid, through the bare hop and through the gateway: MiB/s
# and server CPU per MiB (a MiB costs the servers about 1 ms, and CPU time is counted in 10 ms
# ticks: 200 tunnels moved the ratio by 20 points run to run). Both hops relay a tunnel with
# the gateway's relay (gateway::tunnel, splice(2)), so the bare hop's figure is the floor of
# any relay in a process of its own. Target: the gateway adds <= 15 % CPU a MiB.
# Then sessions: EPO_GW_SESSIONS (10,000) sticky sessions opened through the gateway and held at
# once (a pool of the Squid and 10 bench-memory proxies of 1,000 slots each, whose endpoint is
# the Squid): the operator's RSS before and after, against the 64 MB memory target.
# With EPO_GW_CALLGRIND=1, last, a figure that does not depend on the machine: the operator
# under valgrind's callgrind, its user-space instructions per request through the gateway, and
# the bare hop's the same way (EPO_GW_KEEP_PROFILE=FILE keeps the operator's profile for
# callgrind_annotate).
#
#   bash benches/gateway.sh
#   EPO_GW_ROUNDS=3 EPO_GW_SECS=20 EPO_GW_CONNECTIONS="16 64" bash benches/gateway.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/lib.sh

rounds=${EPO_GW_ROUNDS:-1}
secs=${EPO_GW_SECS:-10}
connections=${EPO_GW_CONNECTIONS:-16 64}
tunnels=${EPO_GW_TUNNELS:-1000}
sessions=${EPO_GW_SESSIONS:-10000}
client_cpu=${EPO_WRK_CLIENT_CPU:-0}
server_cpu=${EPO_WRK_SERVER_CPU:-1}

need_build_deps
need wrk wrk
need taskset util-linux
need squid squid
need curl curl

cargo build --release --features bench-provider --bin egress-proxies-operator --example discovery_bench_server >&2
target=${CARGO_TARGET_DIR:-target}
operator_bin="$target/release/egress-proxies-operator"
example_bin="$target/release/examples/discovery_bench_server"
work=$(mktemp -d "${EPO_BENCH_STATE_DIR:-${TMPDIR:-/tmp}}/epo-gateway.XXXXXX")
chmod 755 "$work"
server_pid=
target_pid=
forward_pid=
token=bench-token-$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')

cleanup() {
  stop_server
  [ -z "$target_pid" ] || kill "$target_pid" 2>/dev/null || true
  [ -z "$forward_pid" ] || kill "$forward_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 143' INT TERM

# The target: bare hyper on the servers' core.
taskset -c "$server_cpu" "$example_bin" bare >"$work/target.out" 2>&1 &
target_pid=$!
target_addr=$(listening_address "$work/target.out" "$target_pid")
export EPO_TARGET="http://$target_addr/"

# Starts the operator with the gateway over folder $1 of make_folder's pool $3, Squids $4 and
# slots $5 and $6, and waits until $2 proxies are Healthy; sets
# server_pid, addr (the API), gateway (the gateway's address) and squid (the first Squid's).
start_operator() {
  local dir=$work/$1 expect=$2 pool=$3 port gateway_port args
  shift 3
  port=$(free_port)
  gateway_port=$(free_port)
  make_folder "$dir" "$pool" "$port" "$@"
  args=(standalone --manifests "$dir/manifests" --providers-config "$dir/providers.yaml"
    --state "$dir/state" --listen "127.0.0.1:$port" --discovery-tokens "$dir/tokens"
    --gateway-listen "127.0.0.1:$gateway_port" --gateway-session-idle-seconds 600)
  [ "${EPO_GW_NO_DURABLE:-0}" = 1 ] && args+=(--no-durable-leases)
  addr=127.0.0.1:$port
  gateway=127.0.0.1:$gateway_port
  squid=127.0.0.1:${squid_ports[0]}
  # shellcheck disable=SC2086 # the prefix is words
  taskset -c "$server_cpu" ${operator_prefix:-} "$operator_bin" "${args[@]}" >"$work/server.out" 2>"$work/server.err" &
  server_pid=$!
  local deadline=$((SECONDS + ${EPO_GW_START_SECS:-300}))
  while [ "$(healthy_count)" -lt "$expect" ]; do
    kill -0 "$server_pid" 2>/dev/null || { tail -20 "$work/server.err" >&2; exit 1; }
    [ "$SECONDS" -lt "$deadline" ] || { echo "the operator's proxies did not become Healthy" >&2; tail -20 "$work/server.err" >&2; exit 1; }
    sleep 1
  done
}

# CPU ticks (user + system) of the target, every Squid under $work, and process $1 (the
# operator or the bare hop) if given.
server_ticks() {
  local pids=("$target_pid") pid total=0
  for pid in $(grep -l -a "$work" /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3); do
    grep -q -a squid "/proc/$pid/cmdline" 2>/dev/null && pids+=("$pid")
  done
  [ -n "${1:-}" ] && pids+=("$1")
  for pid in "${pids[@]}"; do
    total=$((total + $(awk '{ print $14 + $15 }' "/proc/$pid/stat" 2>/dev/null || echo 0)))
  done
  echo "$total"
}

# wrk through the proxy at $1 with $3 connections (Proxy-Authorization $2, or none); prints
# "rps p50_ms p99_ms cpu_us_per_request bad requests" ($4: a process whose CPU counts too).
measure() {
  local proxy=$1 auth=$2 conns=$3 who=${4:-} out t0 t1
  EPO_PROXY_AUTH=$auth taskset -c "$client_cpu" wrk -t1 -c"$conns" -d2s -s benches/wrk/through_proxy.lua "http://$proxy" >/dev/null
  t0=$(server_ticks "$who")
  out=$(EPO_PROXY_AUTH=$auth taskset -c "$client_cpu" wrk -t1 -c"$conns" -d"${secs}s" -s benches/wrk/through_proxy.lua "http://$proxy")
  t1=$(server_ticks "$who")
  echo "$out" | awk -v ticks=$((t1 - t0)) -v hz="$(getconf CLK_TCK)" '/^RESULT/ {
      for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
      printf "%.0f %.2f %.2f %.2f %d %d\n", v["requests"] / v["seconds"], v["p50_us"] / 1000, v["p99_us"] / 1000,
        1e6 * ticks / hz / v["requests"], v["non2xx"] + v["socket_errors"], v["requests"]
    }'
}

basic() { printf 'Basic %s' "$(printf '%s' "$1:$token" | base64 -w0)"; }

echo "egress-proxies-operator gateway: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+changes'), $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); wrk $(wrk -v 2>&1 | head -1 | awk '{ print $2 }'); $(squid -v | head -1)"
echo "servers (target, Squid, operator) on CPU $server_cpu, client on CPU $client_cpu; ${secs}s per run; $rounds round(s); durable leases: $([ "${EPO_GW_NO_DURABLE:-0}" = 1 ] && echo no || echo yes)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

start_operator wrk 1 0 1 1000
taskset -c "$server_cpu" "$example_bin" forward "$squid" >"$work/forward.out" 2>&1 &
forward_pid=$!
bare_hop=$(listening_address "$work/forward.out" "$forward_pid")
failures=0
results=$work/results
: >"$results"
printf '%-6s %-6s %-9s %10s %8s %8s %16s\n' round conns path req/s p50_ms p99_ms server_cpu_us/req
for round in $(seq 1 "$rounds"); do
  for conns in $connections; do
    for path in direct bare-hop gateway session; do
      case $path in
        direct) set -- "$squid" "" ;;
        bare-hop) set -- "$bare_hop" "" "$forward_pid" ;;
        gateway) set -- "$gateway" "$(basic bench)" "$server_pid" ;;
        session) set -- "$gateway" "$(basic 'bench;session=wrk')" "$server_pid" ;;
      esac
      read -r r p50 p99 cpu bad _ < <(measure "$1" "$2" "$conns" "${3:-}")
      printf '%-6s %-6s %-9s %10s %8s %8s %16s\n' "$round" "$conns" "$path" "$r" "$p50" "$p99" "$cpu"
      echo "$round $conns $path $r $p99 $cpu" >>"$results"
      if [ "$bad" -ne 0 ]; then
        echo "  $bad responses were not 2xx (or socket errors)" >&2
        failures=$((failures + 1))
      fi
    done
  done
done
echo
echo "the gateway against the same Squid directly, same round (targets at 64 connections: CPU per request <= +15 %, p99 <= +1 ms;"
echo "bare-hop is the floor: a hyper hop with nothing of the gateway's own):"
awk '
  { rps[$1, $2, $3] = $4; p99[$1, $2, $3] = $5; cpu[$1, $2, $3] = $6; rounds[$1] = 1; conns[$2] = 1 }
  END {
    split("bare-hop gateway session", paths, " ")
    for (c in conns) for (i = 1; i <= 3; i++) {
      m = paths[i]; worst_cpu = 0; worst_p99 = -1e9; lo = 1e9
      for (r in rounds) {
        s = 100 * (cpu[r, c, m] / cpu[r, c, "direct"] - 1); if (s > worst_cpu) worst_cpu = s
        d = p99[r, c, m] - p99[r, c, "direct"]; if (d > worst_p99) worst_p99 = d
        q = 100 * rps[r, c, m] / rps[r, c, "direct"]; if (q < lo) lo = q
      }
      verdict = (c == 64) ? ((worst_cpu <= 15 && worst_p99 <= 1) ? "PASS" : "FAIL") : "(reported, judged at 64)"
      if (m == "bare-hop") verdict = "(the floor)"
      printf "  %-8s %3s conns: CPU per request %+6.1f %%, p99 %+6.2f ms, req/s %5.1f %% of direct  %s\n", m, c, worst_cpu, worst_p99, lo, verdict
    }
  }' "$results" | sort -b -k2,2n -k1,1

# --- CONNECT tunnels of 1 MiB --------------------------------------------------------------
# Prints "MiB/s cpu_ms_per_MiB failures" for $tunnels fetches through proxy URL $1.
tunnel_run() {
  local proxy=$1 who=${2:-} t0 t1 start end failed
  t0=$(server_ticks "$who")
  start=$(date +%s.%N)
  failed=$(seq 1 "$tunnels" | taskset -c "$client_cpu" xargs -P 8 -I{} \
    sh -c 'curl -sf -p -x "$0" -o /dev/null "http://$1/mib" || echo failed' "$proxy" "$target_addr" | grep -c failed || true)
  end=$(date +%s.%N)
  t1=$(server_ticks "$who")
  awk -v n="$tunnels" -v s="$start" -v e="$end" -v ticks=$((t1 - t0)) -v hz="$(getconf CLK_TCK)" -v f="$failed" \
    'BEGIN { printf "%.1f %.2f %d\n", n / (e - s), 1000 * ticks / hz / n, f }'
}
echo
echo "CONNECT: $tunnels tunnels of 1 MiB each, 8 at a time (curl -p):"
read -r direct_mibs direct_cpu direct_failed < <(tunnel_run "http://$squid")
read -r hop_mibs hop_cpu hop_failed < <(tunnel_run "http://$bare_hop" "$forward_pid")
read -r gw_mibs gw_cpu gw_failed < <(tunnel_run "http://bench:$token@$gateway" "$server_pid")
printf '  direct   %8s MiB/s %8s ms server CPU per MiB\n' "$direct_mibs" "$direct_cpu"
printf '  bare-hop %8s MiB/s %8s ms server CPU per MiB\n' "$hop_mibs" "$hop_cpu"
printf '  gateway  %8s MiB/s %8s ms server CPU per MiB\n' "$gw_mibs" "$gw_cpu"
awk -v dm="$direct_mibs" -v dc="$direct_cpu" -v hm="$hop_mibs" -v hc="$hop_cpu" -v gm="$gw_mibs" -v gc="$gw_cpu" 'BEGIN {
  printf "  bare-hop / direct: %.1f %% of the throughput, CPU per MiB %+.1f %%  (the floor)\n", 100 * hm / dm, 100 * (hc / dc - 1)
  printf "  gateway / direct: %.1f %% of the throughput, CPU per MiB %+.1f %%  %s\n", 100 * gm / dm, 100 * (gc / dc - 1),
    (gc / dc - 1 <= 0.15 ? "PASS" : sprintf("FAIL (target <= +15 %%; the floor %+.1f %%)", 100 * (hc / dc - 1)))
}'
[ "$direct_failed$hop_failed$gw_failed" = 000 ] || {
  echo "  failed fetches: direct $direct_failed, bare hop $hop_failed, gateway $gw_failed" >&2
  failures=$((failures + 1))
}
stop_server

# --- sessions held at once ------------------------------------------------------------------
rss_kib() { awk '/^VmRSS/ { print $2 }' "/proc/$server_pid/status"; }
echo
start_operator sessions 11 10 1 1000 1000
before=$(rss_kib)
python3 - "$gateway" "$token" "$target_addr" "$sessions" <<'EOF'
import base64, http.client, sys, threading
gateway, token, target, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
host, port = gateway.rsplit(":", 1)
failed = []
def open_sessions(first, step):
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    for i in range(first, n, step):
        auth = base64.b64encode(f"bench;session=s{i}:{token}".encode()).decode()
        conn.request("GET", f"http://{target}/", headers={"Proxy-Authorization": f"Basic {auth}"})
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            failed.append(response.status)
threads = [threading.Thread(target=open_sessions, args=(k, 8)) for k in range(8)]
for t in threads: t.start()
for t in threads: t.join()
if failed:
    sys.exit(f"{len(failed)} session requests failed: {sorted(set(failed))}")
EOF
after=$(rss_kib)
held=$(curl -s --max-time 2 "http://$addr/metrics" | awk '/^[a-z_]*leases_active[ {]/ { n += $NF } END { printf "%d\n", n }')
awk -v b="$before" -v a="$after" -v n="$sessions" -v held="$held" 'BEGIN {
  printf "sessions: %d sticky sessions opened through the gateway, %s leases held by them afterwards\n", n, held
  printf "  operator RSS %.1f MB before, %.1f MB with the sessions (+%.0f bytes per session); target <= 64 MB  %s\n",
    b / 1024, a / 1024, 1024 * (a - b) / n, (a / 1024 <= 64 ? "PASS" : "FAIL")
}'
stop_server

# --- the machine-independent figure: instructions per request through the gateway ---------
# The operator under callgrind, then the bare hop (the floor) the same way, over the same Squid:
# user-space instructions per request of each, and their ratio.
# Prints the instructions per request of the process callgrind runs as $1 (its output files
# "$work/callgrind.<pid>"), wrk sending through proxy $2 with Proxy-Authorization $3.
callgrind_per_request() {
  local pid=$1 proxy=$2 auth=$3 requests dump total
  EPO_PROXY_AUTH=$auth taskset -c "$client_cpu" wrk -t1 -c16 -d5s -s benches/wrk/through_proxy.lua "http://$proxy" >/dev/null
  callgrind_control -i on "$pid" >/dev/null
  callgrind_control -z "$pid" >/dev/null
  requests=$(EPO_PROXY_AUTH=$auth taskset -c "$client_cpu" wrk -t1 -c16 -d20s -s benches/wrk/through_proxy.lua "http://$proxy" |
    awk '/^RESULT/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); if (kv[1] == "requests") print kv[2] } }')
  callgrind_control -d "$pid" >/dev/null
  dump=$(ls "$work/callgrind.$pid".*1)
  [ -z "${4:-}" ] || cp "$dump" "$4"
  total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ && !done { gsub(",", "", $1); print $1; done = 1 }')
  awk -v t="$total" -v n="$requests" 'BEGIN { printf "%.0f %d\n", t / n, n }'
}
if [ "${EPO_GW_CALLGRIND:-0}" = 1 ]; then
  need valgrind valgrind
  echo
  callgrind="valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=$work/callgrind.%p --dump-instr=no --collect-jumps=no --separate-threads=no"
  operator_prefix=$callgrind EPO_GW_START_SECS=900 start_operator callgrind 1 0 1 1000
  read -r gw_instr gw_requests < <(callgrind_per_request "$server_pid" "$gateway" "$(basic bench)" "${EPO_GW_KEEP_PROFILE:-}")
  # shellcheck disable=SC2086 # the prefix is words
  taskset -c "$server_cpu" $callgrind "$example_bin" forward "$squid" >"$work/forward-callgrind.out" 2>&1 &
  hop_pid=$!
  hop=$(listening_address "$work/forward-callgrind.out" "$hop_pid")
  read -r hop_instr hop_requests < <(callgrind_per_request "$hop_pid" "$hop" "")
  kill "$hop_pid" 2>/dev/null || true
  echo "callgrind: user-space instructions per request (16 connections, 20 s after a 5 s warm-up, periodic work included):"
  printf '  gateway (the operator)  %8s  (%s requests)\n' "$gw_instr" "$gw_requests"
  printf '  bare hop (the floor)    %8s  (%s requests)\n' "$hop_instr" "$hop_requests"
  awk -v g="$gw_instr" -v h="$hop_instr" 'BEGIN { printf "  gateway / bare hop: %.2fx; the gateway'"'"'s own work: %.0f a request\n", g / h, g - h }'
  stop_server
fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
[ "$failures" -eq 0 ] || { echo "$failures run(s) had failed requests" >&2; exit 1; }
