# Shared by scripts/*.sh: install what this project needs on Debian, only where missing.
# Runs apt as root directly, or through sudo for a normal user.

# Debian packages the build and the tests need.
SYSTEM_PACKAGES=(pkg-config)

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_system_packages() {
    local missing=()
    for package in "${SYSTEM_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "==> installing ${missing[*]}"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
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
