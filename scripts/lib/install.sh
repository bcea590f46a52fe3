# Shared by scripts/*.sh: install what this project needs on Debian, only where missing.
# Runs apt as root directly, or through sudo for a normal user.

# Debian packages the build and the tests need: libvirt (headers for the `virt` crate, the
# daemon and virsh for the kvm providers' tests), QEMU for real guests, Squid for the proxies,
# genisoimage for cloud-init seeds, mmdebstrap for the test guest image; Scrapy, pytest,
# venv/pip and mypy for the Python client's tests (tests/python_client.rs installs
# clients/python into a virtualenv over these and type-checks it, and builds a second one with
# the newest Scrapy from PyPI itself, cached under ~/.cache/egress-proxies-operator/python/), and
# requests with Scrapy for tests/gateway.rs (clients that use the gateway unchanged); prometheus
# for promtool
# (tests/monitoring.rs checks config/monitoring/); chromium and a font for the status page's
# browser test (tests/status_page.rs); kubectl (below) for tests/kubectl.rs.
SYSTEM_PACKAGES=(pkg-config libvirt-dev libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients
    qemu-system-x86 squid genisoimage mmdebstrap e2fsprogs
    python3-scrapy python3-pytest python3-venv python3-pip python3-mypy python3-requests
    prometheus chromium fonts-dejavu-core)

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_system_packages() {
    local missing=()
    for package in "${SYSTEM_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
    done
    # qemu-img (qemu-utils, only recommended by qemu-system-x86) makes the kvm providers'
    # qcow2 overlays; it comes with qemu-system-x86 below.
    if ! dpkg-query -W -f='${Status}' qemu-utils 2>/dev/null | grep -q "install ok installed" \
        && [[ " ${missing[*]} " != *" qemu-system-x86 "* ]]; then
        missing+=(qemu-system-x86)
    fi
    # kubectl for tests/kubectl.rs: Debian's `kubernetes-client` (1.20 on bookworm), only
    # where no kubectl is on PATH (another one, e.g. Google's `kubectl` package, conflicts).
    if ! command -v kubectl >/dev/null 2>&1; then
        missing+=(kubernetes-client)
    fi
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "==> installing ${missing[*]}"
        as_root apt-get update -qq
        local extra=()
        # Some images carry a backported qemu-utils that breaks the release's qemu-system:
        # take qemu-utils from the release qemu-system-x86 comes from.
        if [[ " ${missing[*]} " == *" qemu-system-x86 "* ]]; then
            local release
            release=$(. /etc/os-release && echo "$VERSION_CODENAME")
            extra=(--allow-downgrades "qemu-utils/$release" "qemu-block-extra/$release")
        fi
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" "${extra[@]}"
    fi
}

ensure_rust_components() {
    if ! command -v cargo >/dev/null 2>&1; then
        echo "cargo not found: install Rust with rustup (https://rustup.rs) and re-run" >&2
        exit 1
    fi
    for component in "$@"; do
        case "$component" in
            rustfmt) cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt ;;
            clippy) cargo clippy --version >/dev/null 2>&1 || rustup component add clippy ;;
        esac
    done
}
