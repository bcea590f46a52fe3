# Shell pieces the operator-binary benchmarks share (benches/wrk.sh, benches/gateway.sh): the
# Debian packages they install, free ports, a user's standalone folder, and readiness.
# Sourced; expects $token (the discovery token the folder's tokens file holds), $work (the
# run's scratch folder) and $server_pid (the operator's, or empty).

# Installs Debian package $1.
apt_install() { echo "installing $1 (Debian package)" >&2; apt-get install -y "$1" >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y "$1" >/dev/null; }; }
# Installs Debian package $2 unless command $1 exists.
need() { command -v "$1" >/dev/null || apt_install "$2"; }
# What the build needs on a fresh machine: the `virt` crate links libvirt through pkg-config.
need_build_deps() { need pkg-config pkg-config; pkg-config --exists libvirt || apt_install libvirt-dev; }

# The address a benchmark server (examples/discovery_bench_server) prints once it listens: waits
# up to $3 tenths of a second for "listening on ADDR" in file $1 while process $2 lives, else
# shows file $1 and its .err neighbour and exits.
listening_address() {
  local out=$1 pid=$2 addr
  for _ in $(seq 1 "${3:-600}"); do
    addr=$(sed -n 's/^listening on //p' "$out")
    [ -n "$addr" ] && { echo "$addr"; return 0; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "the server writing $out did not start:" >&2
  cat "$out" "${out%.out}.err" >&2 2>/dev/null || true
  exit 1
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# A user's standalone folder: providers.yaml, manifests/ with $4 (default 3) local Squids of
# `maxConcurrent` $5 (default 1000) (and with $2 > 0 that many bench-memory proxies whose
# endpoints are the Squids, `maxConcurrent` $6, default 2), a tokens file. Sets squid_ports.
make_folder() {
  local dir=$1 pool=$2 api_port=$3 squids=${4:-3} squid_max=${5:-1000} pool_max=${6:-2} i
  rm -rf "$dir"
  mkdir -p "$dir/manifests"
  printf 'providers:\n  - name: local\n    type: local\n    settings:\n      stateDir: %s/local\n' "$dir" >"$dir/providers.yaml"
  if [ "$pool" -gt 0 ]; then
    printf '  - name: bench\n    type: bench-memory\n' >>"$dir/providers.yaml"
  fi
  echo "$token" >"$dir/tokens"
  squid_ports=()
  for i in $(seq 1 "$squids"); do
    squid_ports+=("$(free_port)")
    cat >"$dir/manifests/squid-$i.yaml" <<EOF
apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: squid-$i
  namespace: default
spec:
  provider: local
  placement:
    address: 127.0.0.1
  port: ${squid_ports[$((i - 1))]}
  attributes:
    tier: dc
  lease:
    maxConcurrent: $squid_max
  health:
    url: http://127.0.0.1:$api_port/healthz
    intervalSeconds: 5
    timeoutSeconds: 2
EOF
  done
  if [ "$pool" -gt 0 ]; then
    # One multi-document file: the manifests folder as a user with many proxies would write it.
    python3 - "$dir/manifests/pool.yaml" "$pool" "$api_port" "$pool_max" "${squid_ports[@]}" <<'EOF'
import sys
path, n, api, max_concurrent = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ports = sys.argv[5:]
with open(path, "w") as f:
    for i in range(n):
        f.write(f"""---
apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: pool-{i:05d}
  namespace: default
spec:
  provider: bench
  placement:
    address: 127.0.0.1
  port: {ports[i % len(ports)]}
  attributes:
    tier: dc
    region: {("eu", "us", "ap")[i % 3]}
  lease:
    maxConcurrent: {max_concurrent}
  health:
    url: http://127.0.0.1:{api}/healthz
    intervalSeconds: 30
    timeoutSeconds: 5
""")
EOF
  fi
}

# Count of Healthy proxies from the operator's metrics (0 until it answers).
healthy_count() {
  { curl -s --max-time 2 "http://$addr/metrics" 2>/dev/null || true; } |
    awk '/phase="[Hh]ealthy"/ && !/^#/ { n += $NF } END { printf "%d\n", n }'
}

# Kills the server and every Squid its local provider started under $work (by pid).
stop_server() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  server_pid=
  local pid
  for pid in $(grep -l -a "$work" /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3); do
    grep -q -a squid "/proc/$pid/cmdline" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  done
}
