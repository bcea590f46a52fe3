# Shared by scripts/test.sh: Python tools from PyPI, pinned, each in its own virtualenv under
# ~/.cache/egress-proxies-operator/python/ (outside the checkout), made once per version.
# Needs python3 with venv (Debian's python3-venv, in SYSTEM_PACKAGES).

# schemathesis for tests/api_contract.rs (the discovery API against its OpenAPI contract).
SCHEMATHESIS_VERSION=4.32.5

python_tools_dir() {
    echo "${XDG_CACHE_HOME:-$HOME/.cache}/egress-proxies-operator/python"
}

# Makes the virtualenv `name` with `requirement` installed, unless it is there. A virtualenv
# cannot be renamed (its scripts name their interpreter by path), so it is built in place and
# marked complete last: an interrupted install is made again, never taken for a finished one.
ensure_python_tool() {
    local name=$1 requirement=$2
    local dir
    dir="$(python_tools_dir)/$name"
    [ -f "$dir/.complete" ] && return 0
    echo "==> installing $requirement into $dir"
    rm -rf "$dir"
    mkdir -p "$(dirname "$dir")"
    /usr/bin/python3 -m venv "$dir"
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$dir/bin/pip" install -q "$requirement"
    touch "$dir/.complete"
}

ensure_schemathesis() {
    ensure_python_tool "schemathesis-$SCHEMATHESIS_VERSION" "schemathesis==$SCHEMATHESIS_VERSION"
}
