#!/usr/bin/env bash
# Installs redis-server (Debian's package) when it is missing: the store
# tests (internal/store, test/e2e) start their own redis-server on a free
# loopback port, with no persistence, and stop it. Without it they skip with
# a message; `make test` (and so CI) runs this first, so CI never skips them.
#
# Idempotent: nothing is fetched when redis-server is already on PATH.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
	echo "redis-deps: $(redis-server --version | head -n1)"
	exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
	echo "redis-deps: redis-server is missing and apt-get is not available; install redis-server (>= 6) yourself" >&2
	exit 127
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
	sudo="sudo"
fi
echo "redis-deps: installing redis-server with apt-get"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends redis-server >/dev/null
# The package may start a system instance; the tests never use it (each
# starts its own on a free port), so it is left as the package set it up.
command -v redis-server >/dev/null 2>&1 || { echo "redis-deps: apt-get finished but redis-server is not on PATH" >&2; exit 1; }
echo "redis-deps: $(redis-server --version | head -n1)"
