#!/usr/bin/env bash
# Make `promtool` available; print its path on stdout.
#
# Idempotent:
#   1. promtool already on PATH           -> use it (nothing installed)
#   2. root with apt-get (Debian/Ubuntu)  -> apt-get install prometheus, which
#      ships /usr/bin/promtool (Debian 12: ~100 MB, about 30 s)
#   3. otherwise                          -> exit 1 with a message; this script
#      never downloads a binary by itself.
# Used by tests/deploy/test_deploy.py; safe to call from a Makefile or CI.
set -euo pipefail

found() {
    command -v promtool
    exit 0
}

command -v promtool > /dev/null 2>&1 && found

if [ "$(id -u)" != "0" ]; then
    echo "install-promtool: promtool is not on PATH and this is not root; install Debian's" \
         "'prometheus' package (sudo apt-get install --no-install-recommends prometheus)" \
         "or put a promtool binary on PATH" >&2
    exit 1
fi
if ! command -v apt-get > /dev/null 2>&1; then
    echo "install-promtool: promtool is not on PATH and apt-get is missing; put a promtool binary on PATH" >&2
    exit 1
fi

# The package's maintainer scripts would start a prometheus daemon where an
# init system answers; in a container or on CI only promtool is wanted. When no
# policy-rc.d exists, add one that denies service starts for this install, and
# remove it again afterwards (an existing one is left alone).
policy=/usr/sbin/policy-rc.d
own_policy=""
cleanup() {
    if [ -n "$own_policy" ]; then
        rm -f "$policy"
    fi
}
trap cleanup EXIT
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    own_policy=1
fi

export DEBIAN_FRONTEND=noninteractive
apt_install() {
    apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 prometheus >&2
}
# The package lists of a fresh machine may be empty or stale: update once on failure.
if ! apt_install; then
    apt-get update -q -o DPkg::Lock::Timeout=300 >&2
    if ! apt_install; then
        echo "install-promtool: apt-get install prometheus failed" >&2
        exit 1
    fi
fi

hash -r
if command -v promtool > /dev/null 2>&1; then
    found
fi
echo "install-promtool: the prometheus package is installed but promtool is not on PATH" >&2
exit 1
