#!/usr/bin/env bash
# The real Kubernetes control plane the cluster-mode tests and `scripts/cluster.sh` stand on:
# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl (Kubernetes), etcd (3.6) and kwok (fake
# nodes), built from the Go module proxy at pinned versions into a cache folder outside the
# checkout, keyed by those versions. When the binaries are there it does nothing.
#
# Sourced: `control_plane_assets` prints the folder that holds all five binaries (building what
# is missing). Run alone: `bash scripts/lib/control-plane.sh` builds and prints the folder.
#
# KUBEBUILDER_ASSETS (the envtest convention): a folder of binaries a user already has; each
# binary found there is used instead of building it (envtest's folder holds kube-apiserver,
# etcd and kubectl; the rest is still built).
#
# Why a wrapper module: k8s.io/kubernetes requires its staging modules (k8s.io/api,
# k8s.io/apiserver, ...) at v0.0.0 and replaces them with folders of its own repository, which
# a module download does not have (kubernetes issue 79384). The wrapper requires the release
# and replaces each staging module with its published v0.X.Y tag, read from the release's
# go.mod. etcd's server module has relative replaces too (etcd-io/etcd 18501), so `go install`
# of it fails; a wrapper module that requires it as a tool builds it.

set -euo pipefail

EPO_K8S_VERSION=v1.36.3
EPO_ETCD_VERSION=v3.6.17
EPO_KWOK_VERSION=v0.8.0
EPO_CONTROL_PLANE_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok)

control_plane_cache_dir() {
    local root="${EPO_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/egress-proxies-operator/control-plane}"
    echo "$root/k8s-$EPO_K8S_VERSION-etcd-$EPO_ETCD_VERSION-kwok-$EPO_KWOK_VERSION"
}

# Field $2 (`Dir`, `GoMod`) of module $1 (path@version), downloaded from the module proxy.
_module_field() {
    go mod download -json "$1" | sed -n "s/.*\"$2\": \"\(.*\)\".*/\1/p"
}

# Builds the Kubernetes binaries named in "$@" into "$1"'s folder (first argument: output dir).
_build_kubernetes() {
    local out="$1"; shift
    local work; work=$(mktemp -d)
    local staging_version="v0.${EPO_K8S_VERSION#v1.}"
    (
        cd "$work"
        cat >go.mod <<EOF
module epo.local/control-plane

go 1.26

require k8s.io/kubernetes $EPO_K8S_VERSION
EOF
        # The staging modules the release names, each replaced by its published tag.
        local gomod; gomod=$(_module_field "k8s.io/kubernetes@$EPO_K8S_VERSION" GoMod)
        local module
        for module in $(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$gomod"); do
            case "$module" in
                # Examples no binary here imports; not published at every tag.
                k8s.io/sample-*) continue ;;
            esac
            go mod edit -replace="$module=$module@$staging_version"
        done
        local packages=()
        local binary
        for binary in "$@"; do packages+=("k8s.io/kubernetes/cmd/$binary"); done
        local ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$EPO_K8S_VERSION"
        ldflags+=" -X k8s.io/component-base/version.gitMajor=1"
        ldflags+=" -X k8s.io/component-base/version.gitMinor=$(echo "$EPO_K8S_VERSION" | cut -d. -f2)"
        ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
        ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$EPO_K8S_VERSION"
        GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$out/" "${packages[@]}"
    )
    rm -rf "$work"
}

_build_etcd() {
    local out="$1"
    local work; work=$(mktemp -d)
    (
        cd "$work"
        printf 'module epo.local/etcd\n\ngo 1.26\n' >go.mod
        go get -tool "go.etcd.io/etcd/server/v3@$EPO_ETCD_VERSION" >/dev/null
        CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3
    )
    rm -rf "$work"
}

# kwok and its stage configs (what it does to nodes and pods: Ready nodes with heartbeats,
# pods Running with an IP, deleted pods gone), taken from the same module version. kwok is
# built from a copy of its module with easycel (its CEL helper) patched: easycel's type caches
# are global maps without a lock, and kwok fills them from several goroutines at once, which can
# kill it with "concurrent map writes" (scripts/lib/easycel-cache-lock.patch). The marker file
# `kwok.recipe` names that recipe, so a kwok cached before it is built again.
EPO_KWOK_RECIPE="kwok $EPO_KWOK_VERSION, easycel with scripts/lib/easycel-cache-lock.patch"
_build_kwok() {
    local out="$1"
    local patch; patch="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/easycel-cache-lock.patch"
    local work; work=$(mktemp -d)
    (
        cd "$work"
        local kwok_dir easycel_version easycel_dir
        kwok_dir=$(_module_field "sigs.k8s.io/kwok@$EPO_KWOK_VERSION" Dir)
        cp -r "$kwok_dir" kwok
        easycel_version=$(sed -n 's#^\s*github.com/wzshiming/easycel \(v[^ ]*\).*#\1#p' kwok/go.mod)
        easycel_dir=$(_module_field "github.com/wzshiming/easycel@$easycel_version" Dir)
        cp -r "$easycel_dir" easycel
        chmod -R u+w kwok easycel
        (cd easycel && git apply "$patch")
        cd kwok
        go mod edit -replace github.com/wzshiming/easycel=../easycel
        GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out/kwok" ./cmd/kwok
        local stages=kustomize/stage file
        for file in node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml \
            pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
            echo "---"
            cat "$stages/$file"
        done >"$out/kwok-stages.yaml"
    )
    rm -rf "$work"
    echo "$EPO_KWOK_RECIPE" >"$out/kwok.recipe"
}

# Prints the folder holding every control-plane binary; builds (and caches) what is missing.
# Progress goes to stderr, so `dir=$(control_plane_assets)` works.
control_plane_assets() {
    local cache; cache=$(control_plane_cache_dir)
    local assets="${KUBEBUILDER_ASSETS:-}"
    local missing_kubernetes=() need_etcd=0 need_kwok=0 binary
    for binary in "${EPO_CONTROL_PLANE_BINARIES[@]}"; do
        if [ -n "$assets" ] && [ -x "$assets/$binary" ]; then continue; fi
        if [ -x "$cache/$binary" ]; then
            # kwok is whole only with its stages, built by this recipe.
            if [ "$binary" != kwok ] || [ "$(cat "$cache/kwok.recipe" 2>/dev/null)" = "$EPO_KWOK_RECIPE" ]; then
                continue
            fi
        fi
        case "$binary" in
            etcd) need_etcd=1 ;;
            kwok) need_kwok=1 ;;
            *) missing_kubernetes+=("$binary") ;;
        esac
    done
    if [ "${#missing_kubernetes[@]}" -gt 0 ] || [ "$need_etcd" = 1 ] || [ "$need_kwok" = 1 ]; then
        command -v go >/dev/null 2>&1 || {
            echo "control plane: go not found (Go >= 1.26 builds kube-apiserver, etcd and kwok)" >&2
            return 1
        }
        mkdir -p "$cache"
        local partial="$cache.partial"
        rm -rf "$partial"; mkdir -p "$partial"
        local started=$SECONDS
        if [ "${#missing_kubernetes[@]}" -gt 0 ]; then
            echo "==> control plane: building ${missing_kubernetes[*]} $EPO_K8S_VERSION from the Go module proxy" >&2
            _build_kubernetes "$partial" "${missing_kubernetes[@]}" >&2
        fi
        if [ "$need_etcd" = 1 ]; then
            echo "==> control plane: building etcd $EPO_ETCD_VERSION" >&2
            _build_etcd "$partial" >&2
        fi
        if [ "$need_kwok" = 1 ]; then
            echo "==> control plane: building kwok $EPO_KWOK_VERSION" >&2
            _build_kwok "$partial" >&2
        fi
        mv "$partial"/* "$cache/"
        rmdir "$partial"
        echo "==> control plane: built in $((SECONDS - started)) s into $cache" >&2
    fi
    # One folder for the tests: links to wherever each binary lives.
    local merged="$cache/assets"
    mkdir -p "$merged"
    for binary in "${EPO_CONTROL_PLANE_BINARIES[@]}"; do
        if [ -n "$assets" ] && [ -x "$assets/$binary" ]; then
            ln -sfn "$assets/$binary" "$merged/$binary"
        else
            ln -sfn "$cache/$binary" "$merged/$binary"
        fi
    done
    ln -sfn "$cache/kwok-stages.yaml" "$merged/kwok-stages.yaml"
    echo "$merged"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    control_plane_assets
fi
