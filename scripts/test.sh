#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what a fresh Debian machine lacks (system
# packages via apt, Rust components), then checks formatting, runs clippy with warnings as
# errors, builds the code's docs with broken links as errors, and runs every test (generated
# files are compared with their sources by tests).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/install.sh
source scripts/lib/control-plane.sh
source scripts/lib/python-tools.sh

install_system_packages
ensure_rust_components rustfmt clippy
ensure_schemathesis

# The real Kubernetes control plane every cluster-mode test starts (kube-apiserver, etcd,
# kube-controller-manager, kube-scheduler, kubectl, kwok): built from source once, then cached.
echo "==> control plane (kube-apiserver $EPO_K8S_VERSION, etcd $EPO_ETCD_VERSION, kwok $EPO_KWOK_VERSION)"
control_plane_started=$SECONDS
EPO_CONTROL_PLANE_ASSETS=$(control_plane_assets)
export EPO_CONTROL_PLANE_ASSETS
echo "    ready in $((SECONDS - control_plane_started)) s: $EPO_CONTROL_PLANE_ASSETS"

echo "==> cargo fmt --check"
cargo fmt --all --check
echo "==> cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --locked -- -D warnings
echo "==> cargo doc (the code's own docs, private items included: every link resolves)"
RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" \
    cargo doc --locked --no-deps --document-private-items
echo "==> tests"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --locked --no-fail-fast
else
    cargo test --locked --no-fail-fast
fi
