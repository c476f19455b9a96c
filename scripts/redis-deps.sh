#!/usr/bin/env bash
# Installs redis-server (Debian's package, which brings redis-cli) when it
# is missing: the store tests (internal/store, test/e2e) start their own
# redis-server processes on free loopback ports, with no persistence, and
# stop them: a single node, a 3-master cluster (joined with
# `redis-cli --cluster create`) and a Sentinel setup (`redis-server
# --sentinel`; no separate redis-sentinel binary is needed). Without them
# they skip with a message; `make test` (and so CI) runs this first, so CI
# never skips them.
#
# Idempotent: nothing is fetched when redis-server and redis-cli are on PATH.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
	echo "redis-deps: $(redis-server --version | head -n1)"
	exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
	echo "redis-deps: redis-server or redis-cli is missing and apt-get is not available; install Redis (>= 6) yourself" >&2
	exit 127
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
	sudo="sudo"
fi
echo "redis-deps: installing redis-server with apt-get"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null
# The package may start a system instance; the tests never use it (each
# starts its own on a free port), so it is left as the package set it up.
for b in redis-server redis-cli; do
	command -v "$b" >/dev/null 2>&1 || { echo "redis-deps: apt-get finished but $b is not on PATH" >&2; exit 1; }
done
echo "redis-deps: $(redis-server --version | head -n1)"
