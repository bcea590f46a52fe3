#!/usr/bin/env bash
# The Redis baselines of benches/wrk.sh: a lease in Redis + Lua over 10,000 proxies, Redis from
# Debian (`redis-server`, installed if missing), pinned like the operator (server on
# EPO_WRK_SERVER_CPU, redis-benchmark with one thread on EPO_WRK_CLIENT_CPU), twice: in memory
# (no persistence) and with `appendonly yes` + `appendfsync always` (every write fsynced before
# it is answered: the durable operator's promise).
#
# One EVALSHA is one acquire->release pair: the script takes a free proxy, issues a fencing
# token, records the lease (holder, token, expiry) with its expiry in a sorted set, then releases
# it by checking the token, deleting the lease and freeing the proxy. That is both operations'
# work in one round trip and (AOF) one fsync, where the operator answers two HTTP requests and
# syncs each: Redis's pairs per second here are an upper bound on a real client's, so "operator
# >= 2x Redis" is judged conservatively. bare and bare-durable rows in RESULTS are printed too,
# as floors (not judged): what a server that only answers (and journals) makes against Redis.
#
#   bash benches/redis_lease.sh [RESULTS]   # RESULTS: benches/wrk.sh's "round conns server rps p99" lines
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-}
client_cpu=${EPO_WRK_CLIENT_CPU:-0}
server_cpu=${EPO_WRK_SERVER_CPU:-1}
connections=${EPO_WRK_CONNECTIONS:-16 64}
requests=${EPO_REDIS_REQUESTS:-300000}
if ! command -v redis-server >/dev/null; then
  echo "installing redis-server (Debian package)" >&2
  apt-get install -y redis-server >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y redis-server >/dev/null; } || {
    echo "redis: redis-server could not be installed; no Redis baseline" >&2
    exit 1
  }
fi
work=$(mktemp -d)
redis_pid=
cleanup() {
  if [ -n "$redis_pid" ]; then kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 143' INT TERM

pair_lua='
local t = redis.call("TIME")
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local proxy = redis.call("LPOP", "free")
if not proxy then return redis.error_reply("no proxy free") end
local token = redis.call("INCR", "fence")
local id = proxy .. ":" .. token
redis.call("HSET", "lease:" .. id, "proxy", proxy, "holder", ARGV[1], "token", token, "expires", now + 60000)
redis.call("ZADD", "expiries", now + 60000, id)
-- release: the fencing token must match
local have = redis.call("HGET", "lease:" .. id, "token")
if tonumber(have) ~= token then return redis.error_reply("fencing token mismatch") end
redis.call("DEL", "lease:" .. id)
redis.call("ZREM", "expiries", id)
redis.call("RPUSH", "free", proxy)
return token
'

port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Starts Redis with extra arguments; sets redis_pid and rport; loads 10,000 proxies and the script.
start_redis() {
  rport=$(port)
  rm -rf "$work/data"
  mkdir -p "$work/data"
  taskset -c "$server_cpu" redis-server --port "$rport" --bind 127.0.0.1 --dir "$work/data" --save '' \
    --daemonize no --logfile "$work/redis.log" "$@" &
  redis_pid=$!
  for _ in $(seq 1 100); do redis-cli -p "$rport" ping >/dev/null 2>&1 && break; sleep 0.1; done
  seq -f 'proxy-%05g' 0 9999 | xargs -n 1000 redis-cli -p "$rport" RPUSH free >/dev/null
  sha=$(redis-cli -p "$rport" SCRIPT LOAD "$pair_lua")
}

stop_redis() {
  kill "$redis_pid" 2>/dev/null || true
  wait "$redis_pid" 2>/dev/null || true
  redis_pid=
}

# Pairs per second at $1 connections.
measure() {
  local n=$requests
  [ "$2" = aof ] && n=$((requests / 5))
  taskset -c "$client_cpu" redis-benchmark -p "$rport" -c "$1" -n "$n" --threads 1 --csv -q EVALSHA "$sha" 0 bench |
    awk -F'"' 'NR == 2 { printf "%.0f\n", $4 }'
}

echo "Redis $(redis-server --version | awk '{ print $3 }' | cut -d= -f2) + Lua lease, 10,000 proxies; one EVALSHA = one acquire->release pair (server on CPU $server_cpu, redis-benchmark on CPU $client_cpu):"
declare -A pairs
for mode in memory aof; do
  if [ "$mode" = aof ]; then
    start_redis --appendonly yes --appendfsync always
  else
    start_redis --appendonly no
  fi
  for conns in $connections; do
    pairs[$mode, $conns]=$(measure "$conns" "$mode")
    printf '  redis %-6s %3s connections: %8s pairs/s\n' "$mode" "$conns" "${pairs[$mode, $conns]}"
  done
  stop_redis
done

[ -n "$results" ] && [ -s "$results" ] || exit 0
# The operator's pairs per second: half its req/s, its median over rounds.
op_pairs() {
  awk -v m="$1" -v c="$2" '$3 == m && $2 == c { v[++n] = $4 / 2 } END {
      if (!n) exit; for (i = 2; i <= n; i++) { x = v[i]; j = i - 1; while (j > 0 && v[j] > x) { v[j + 1] = v[j]; j-- } v[j + 1] = x }
      printf "%.0f\n", (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2 }' "$results"
}

for conns in $connections; do
  # bare and bare-durable are the floors (canned answers; each answer journalled), not judged:
  # what any server of this kind does against the same Redis on this machine.
  for pair in "bare memory" "operator memory" "pool memory" "bare-durable aof" "durable aof" "pool-durable aof"; do
    read -r server mode <<<"$pair"
    op=$(op_pairs "$server" "$conns")
    [ -n "$op" ] || continue
    awk -v o="$op" -v r="${pairs[$mode, $conns]}" -v s="$server" -v m="$mode" -v c="$conns" 'BEGIN {
      x = o / r; v = (s ~ /^bare/) ? "(a floor, not judged)" : ((x >= 2) ? "PASS" : "FAIL")
      printf "  %-13s %3s conns: %8d pairs/s = %.2fx redis %s (target >= 2x)  %s\n", s, c, o, x, m, v }'
  done
done
