#!/usr/bin/env bash
# The main job: the operator in standalone mode on this host, with the three local Squid proxies
# of config/samples/standalone and the discovery API on 127.0.0.1:8080. Installs what a fresh
# Debian machine lacks (Squid, and libvirt headers to build), builds, and runs until Ctrl-C.
# State (status, audit trail, leases, the API token) lives in .standalone/ in this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/install.sh

SYSTEM_PACKAGES=(pkg-config libvirt-dev squid curl)
install_system_packages
ensure_rust_components

echo "==> building"
cargo build --locked --bin egress-proxies-operator
bin=target/debug/egress-proxies-operator

cat <<'HELP'
==> starting standalone mode; in another terminal:

    target/debug/egress-proxies-operator status            # proxies, like kubectl get
    TOKEN=$(cat .standalone/state/discovery-tokens)
    # lease a proxy in region eu
    curl -s -X POST http://127.0.0.1:8080/v1/leases -H "Authorization: Bearer $TOKEN" \
         -H 'content-type: application/json' -d '{"selector":{"region":"eu"},"holder":"me","ttlSeconds":60}'
    # fetch through it (proxyUrl from the answer)
    curl -x http://127.0.0.1:3128 http://127.0.0.1:8080/healthz

HELP
exec "$bin" standalone \
    --manifests config/samples/standalone \
    --providers-config config/samples/standalone/providers.yaml \
    --state .standalone/state \
    --listen 127.0.0.1:8080
