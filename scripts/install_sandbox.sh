#!/usr/bin/env bash
# Set up the code sandbox (k3post/envs/sandbox.py): install bubblewrap (bwrap)
# via apt-get when it is missing and we can (and headless Chromium for
# coding.webdev), then report which isolation backend really works here.
#
# Idempotent (does nothing when bwrap is already installed).  Exits 1 when
# apt-get is available but bubblewrap cannot be installed (not root and no
# passwordless sudo, or the package cannot be fetched): the sandbox refuses to
# run model-written code without isolation, so an install without bwrap is a
# failed install.  Where apt-get is unavailable it warns and exits 0; the
# sandbox then uses `unshare` namespaces if they work, else refuses unless
# sandbox.allow_weak_isolation=true (K3POST_ALLOW_WEAK_ISOLATION=1).
set -u

warn() { echo "install_sandbox: warning: $*" >&2; }
info() { echo "install_sandbox: $*"; }

if [ "$(uname -s)" != "Linux" ]; then
    warn "not Linux; the sandbox will use its rlimit fallback (weak isolation)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    fi
fi

export DEBIAN_FRONTEND=noninteractive
apt_install() {  # PACKAGE...: apt-get install, retried once after an update (a stale index is the usual failure)
    $SUDO apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1 && return 0
    $SUDO apt-get update -q >/dev/null 2>&1 || warn "apt-get update failed"
    $SUDO apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1
}

install_or_fail() {  # WHAT PACKAGE...: apt-get install, or exit 1 (only a warning where apt-get is missing)
    what=$1
    shift
    if ! command -v apt-get >/dev/null 2>&1; then
        warn "apt-get not found; install $* with your package manager ($what)"
    elif [ "$(id -u)" != "0" ] && [ -z "$SUDO" ]; then
        echo "install_sandbox: error: not root and no passwordless sudo; cannot apt-get install $*" >&2
        echo "install_sandbox: run: sudo apt-get install $*" >&2
        exit 1
    else
        info "installing $* with apt-get ($what)"
        if ! apt_install "$@"; then
            echo "install_sandbox: error: apt-get install $* failed" >&2
            exit 1
        fi
    fi
}

if command -v bwrap >/dev/null 2>&1; then
    info "bubblewrap already installed: $(command -v bwrap)"
else
    install_or_fail "full isolation of the code sandbox" bubblewrap
    if command -v apt-get >/dev/null 2>&1; then
        if ! command -v bwrap >/dev/null 2>&1; then
            echo "install_sandbox: error: bubblewrap installed but bwrap is not on PATH" >&2
            exit 1
        fi
        info "installed $(command -v bwrap)"
    fi
fi

# Python packages for the sandbox's system Python (/usr/bin/python3, stdlib only otherwise), from Debian:
# pandas for agents.data_report's analysis, Pillow for general.visual's image tool. A warning, not a failure,
# where one cannot be installed (only that family needs it).
sandbox_python_package() {  # MODULE DEBIAN_PACKAGE FAMILY
    if [ ! -x /usr/bin/python3 ] || /usr/bin/python3 -c "import $1" >/dev/null 2>&1; then
        return 0
    fi
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = "0" ] || [ -n "${SUDO:-}" ]; }; then
        info "installing $2 for the sandbox's python with apt-get"
        apt_install "$2" || warn "apt-get install $2 failed: $3 cannot run its sandboxed Python"
    else
        warn "/usr/bin/python3 has no $1 (install $2): $3 needs it"
    fi
}
sandbox_python_package pandas python3-pandas agents.data_report
sandbox_python_package PIL python3-pil general.visual

# Headless Chromium for coding.webdev (k3post/envs/families/webdev/browser.py): Debian's chromium and
# chromium-driver, driven by Debian's python3-selenium from the sandbox's /usr/bin/python3. Like bubblewrap, a failed
# install where apt-get exists but cannot provide them fails this script: the browser checks run in CI.
if [ -x /usr/lib/chromium/chromium ] && command -v chromedriver >/dev/null 2>&1 \
        && { [ ! -x /usr/bin/python3 ] || /usr/bin/python3 -c "import selenium.webdriver" >/dev/null 2>&1; }; then
    info "headless Chromium already installed: $(/usr/lib/chromium/chromium --version 2>/dev/null)"
else
    install_or_fail "coding.webdev's headless browser" chromium chromium-driver python3-selenium
    if command -v apt-get >/dev/null 2>&1; then
        if [ ! -x /usr/lib/chromium/chromium ] || ! command -v chromedriver >/dev/null 2>&1; then
            echo "install_sandbox: error: chromium installed but /usr/lib/chromium/chromium or chromedriver is missing" >&2
            exit 1
        fi
        info "installed $(/usr/lib/chromium/chromium --version 2>/dev/null)"
    fi
fi

# Report what really works (namespaces are often forbidden inside containers).
PY=${PYTHON:-python3}
if "$PY" -c "import k3post.envs.sandbox" >/dev/null 2>&1; then
    "$PY" - <<'EOF' || warn "could not probe the sandbox backends"
from k3post.envs.sandbox import BACKENDS, probe_backend
works = {b: probe_backend(b) for b in BACKENDS}
best = next(b for b in BACKENDS if works[b])
print("install_sandbox: backends: " + ", ".join(f"{b}={'ok' if ok else 'unavailable'}" for b, ok in works.items()))
if best == "rlimit":
    print("install_sandbox: WARNING: no namespace backend works here (containers often forbid them); the sandbox "
          "refuses to run model-written code unless sandbox.allow_weak_isolation=true")
else:
    print(f"install_sandbox: sandbox backend in use: {best}")
EOF
fi
exit 0
