#!/usr/bin/env bash
# Cluster mode on one host: a local Kubernetes control plane (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, and kwok with one fake node), built from source by
# scripts/lib/control-plane.sh and cached outside the checkout; the product installed as the
# README says (`kubectl apply -k config/default`); the operator run out of cluster as the
# ServiceAccount the shipped RBAC binds, with the `local` provider (real Squid processes); and
# three sample Proxies applied. State and the kubeconfig live in .cluster/ in this checkout:
#
#     kubectl --kubeconfig .cluster/kubeconfig get proxies -A
#
# Ctrl-C stops everything it started (the Proxies are deleted first, so their Squids stop).
# Ports on 127.0.0.1: kube-apiserver 6443, etcd 2379/2380, discovery API 8090, admin 8091,
# Squids 3228-3230.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/install.sh
source scripts/lib/control-plane.sh

SYSTEM_PACKAGES=(pkg-config libvirt-dev squid curl openssl)
install_system_packages
ensure_rust_components

echo "==> control plane binaries"
assets=$(control_plane_assets)
echo "==> building the operator"
cargo build --locked --bin egress-proxies-operator
operator=target/debug/egress-proxies-operator

state=.cluster
rm -rf "$state"
mkdir -p "$state/pki" "$state/logs" "$state/etcd" "$state/home"
pki="$state/pki"
export HOME_FOR_KWOK="$PWD/$state/home"

pids=()
cleanup() {
    # A second Ctrl-C must not cut the cleanup short (it would leave etcd or Squids running).
    trap '' INT TERM
    trap - EXIT
    echo
    echo "==> stopping"
    if [ -n "${operator_pid:-}" ] && kill -0 "$operator_pid" 2>/dev/null; then
        # Delete the Proxies while the operator runs, so it stops their Squids.
        "$assets/kubectl" --kubeconfig "$state/kubeconfig" delete proxies --all -A \
            --timeout=60s >/dev/null 2>&1 || true
    fi
    local pid
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        pid=${pids[$i]}
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    # The local provider leaves its Squids running when the operator stops (a restarted one
    # adopts them): those of Proxies not deleted above (the operator had exited) go here.
    local squids="$PWD/$state/local/"
    if pkill -TERM -f -- "$squids" 2>/dev/null; then
        for _ in $(seq 50); do pgrep -f -- "$squids" >/dev/null || break; sleep 0.1; done
        pkill -KILL -f -- "$squids" 2>/dev/null || true
        echo "    stopped the Squids of Proxies that were not deleted"
    fi
    echo "==> stopped; state kept in $state/"
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT

# Each in a session of its own: Ctrl-C reaches this script alone, which then deletes the Proxies
# while the operator still runs, and stops the rest in order.
start() {
    local name=$1; shift
    setsid "$@" >"$state/logs/$name.log" 2>&1 &
    pids+=($!)
    echo "    $name (pid $!, log $state/logs/$name.log)"
}

wait_for() {
    local what=$1; shift
    for _ in $(seq 1 600); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    echo "cluster.sh: $what did not come up; see $state/logs/" >&2
    exit 1
}

echo "==> certificates"
openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=epo-local-ca" \
    -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
sign() { # name subject extensions
    openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$pki/$1.key" -out "$pki/$1.csr" 2>/dev/null
    printf '%s\n' "$3" >"$pki/$1.ext"
    openssl x509 -req -in "$pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
        -days 365 -extfile "$pki/$1.ext" -out "$pki/$1.crt" 2>/dev/null
}
sign apiserver "/CN=kube-apiserver" \
    "subjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc,IP:127.0.0.1,IP:10.0.0.1
extendedKeyUsage=serverAuth"
sign admin "/O=system:masters/CN=epo-admin" "extendedKeyUsage=clientAuth"
openssl genrsa -out "$pki/service-account.key" 2048 2>/dev/null

echo "==> starting the control plane"
start etcd "$assets/etcd" --name=local --data-dir="$state/etcd" \
    --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
    --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
    --initial-cluster=local=http://127.0.0.1:2380 --log-level=warn
wait_for etcd curl -sf http://127.0.0.1:2379/health
start kube-apiserver "$assets/kube-apiserver" \
    --etcd-servers=http://127.0.0.1:2379 --secure-port=6443 \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 \
    --cert-dir="$pki" --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --client-ca-file="$pki/ca.crt" --authorization-mode=RBAC \
    --service-cluster-ip-range=10.0.0.0/24 \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$pki/service-account.key" \
    --service-account-signing-key-file="$pki/service-account.key" \
    --allow-privileged=true --endpoint-reconciler-type=none
wait_for kube-apiserver curl -sf --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \
    https://127.0.0.1:6443/readyz

kubeconfig="$state/kubeconfig"
kubectl=("$assets/kubectl" --kubeconfig "$kubeconfig")
"$assets/kubectl" config --kubeconfig "$kubeconfig" set-cluster local --server=https://127.0.0.1:6443 \
    --certificate-authority="$PWD/$pki/ca.crt" --embed-certs >/dev/null
"$assets/kubectl" config --kubeconfig "$kubeconfig" set-credentials admin \
    --client-certificate="$PWD/$pki/admin.crt" --client-key="$PWD/$pki/admin.key" --embed-certs >/dev/null
"$assets/kubectl" config --kubeconfig "$kubeconfig" set-context local --cluster=local --user=admin >/dev/null
"$assets/kubectl" config --kubeconfig "$kubeconfig" use-context local >/dev/null

start kube-controller-manager "$assets/kube-controller-manager" --kubeconfig="$kubeconfig" \
    --leader-elect=false --secure-port=0 --root-ca-file="$pki/ca.crt" \
    --service-account-private-key-file="$pki/service-account.key" \
    --controllers=namespace-controller,garbage-collector-controller,serviceaccount-controller,deployment-controller,replicaset-controller
start kube-scheduler "$assets/kube-scheduler" --kubeconfig="$kubeconfig" \
    --authentication-kubeconfig="$kubeconfig" --authorization-kubeconfig="$kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1
start kwok env HOME="$HOME_FOR_KWOK" "$assets/kwok" --kubeconfig="$kubeconfig" \
    --config="$assets/kwok-stages.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --cidr=10.0.0.1/24 --node-ip=10.0.0.1 --server-address=127.0.0.1:10247
"${kubectl[@]}" apply -f - >/dev/null <<'EOF'
apiVersion: v1
kind: Node
metadata:
  name: kwok-node-0
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels: {kubernetes.io/hostname: kwok-node-0, kubernetes.io/os: linux, type: kwok}
status:
  allocatable: {cpu: "32", memory: 256Gi, pods: "110"}
  capacity: {cpu: "32", memory: 256Gi, pods: "110"}
EOF

# The API server taints a new node not-ready; the node lifecycle controller (not run here) would
# lift it once kwok reports the node Ready.
"${kubectl[@]}" wait --for=condition=Ready node/kwok-node-0 --timeout=60s >/dev/null
"${kubectl[@]}" patch node kwok-node-0 --type=merge -p '{"spec":{"taints":null}}' >/dev/null

echo "==> installing the product: kubectl apply -k config/default"
"${kubectl[@]}" apply -k config/default
"${kubectl[@]}" wait --for=condition=Established crd/proxies.crawl.example.com \
    crd/providerhealths.crawl.example.com --timeout=60s >/dev/null

echo "==> starting the operator as ServiceAccount egress-proxies-system/egress-proxies-operator"
token=$("${kubectl[@]}" -n egress-proxies-system create token egress-proxies-operator --duration=24h)
operator_kubeconfig="$state/operator.kubeconfig"
cp "$kubeconfig" "$operator_kubeconfig"
"$assets/kubectl" config --kubeconfig "$operator_kubeconfig" set-credentials admin --token="$token" >/dev/null
"$assets/kubectl" config --kubeconfig "$operator_kubeconfig" unset users.admin.client-certificate-data >/dev/null
"$assets/kubectl" config --kubeconfig "$operator_kubeconfig" unset users.admin.client-key-data >/dev/null
cat >"$state/providers.yaml" <<EOF
providers:
  - name: local
    type: local
    settings:
      stateDir: $state/local
      squidPath: /usr/sbin/squid
      bindAddress: 127.0.0.1
EOF
openssl rand -hex 32 >"$state/discovery-tokens"
openssl rand -hex 32 >"$state/lease-key"
start operator env KUBECONFIG="$operator_kubeconfig" POD_NAMESPACE=egress-proxies-system \
    POD_NAME=local-operator RUST_LOG=info \
    "$operator" run --providers-config="$state/providers.yaml" \
    --discovery-tokens="$state/discovery-tokens" --lease-signing-key="$state/lease-key" \
    --admin-listen=127.0.0.1:8091 --discovery-listen=127.0.0.1:8090
operator_pid=${pids[-1]}

echo "==> applying the sample Proxies (namespace crawl)"
"${kubectl[@]}" create namespace crawl >/dev/null
for sample in config/samples/standalone/proxy-local-*.yaml; do
    # The standalone samples, moved to namespace crawl, ports 3228-3230, health through the
    # cluster-mode discovery API, in pool `cluster`.
    sed -e 's/namespace: default/namespace: crawl/' -e 's/port: 31\(2[89]\|30\)/port: 32\1/' \
        -e 's#127.0.0.1:8080#127.0.0.1:8090#' -e 's/pool: standalone/pool: cluster/' "$sample" |
        "${kubectl[@]}" apply -f -
done

cat <<HELP

==> cluster mode is running; in another terminal:

    kubectl --kubeconfig .cluster/kubeconfig get proxies -A
    kubectl --kubeconfig .cluster/kubeconfig -n crawl describe proxy local-1
    TOKEN=\$(cat .cluster/discovery-tokens)
    curl -s -X POST http://127.0.0.1:8090/v1/leases -H "Authorization: Bearer \$TOKEN" \\
         -H 'content-type: application/json' -d '{"selector":{"region":"eu"},"holder":"me","ttlSeconds":60}'

  (kubectl here is any kubectl; the one built with the control plane is $assets/kubectl)
  Ctrl-C stops everything.
HELP
status=0
wait "$operator_pid" || status=$?
echo "==> the operator exited (status $status); its log: $state/logs/operator.log"
exit "$status"
