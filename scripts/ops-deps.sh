#!/usr/bin/env bash
# Installs what test/ops needs: promtool and prometheus, from Debian's
# `prometheus` package (the rules' unit tests and the real-Prometheus test).
#
# Idempotent: nothing happens when both are on PATH. Otherwise it needs root
# and apt (CI runs as root on Debian). The package's service is not started
# here: there is no init system in CI, and the tests start their own
# Prometheus on a loopback port with a temp config.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
	echo "ops-deps: promtool and prometheus are installed ($(prometheus --version 2>&1 | head -n1))"
	exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
	echo "ops-deps: promtool/prometheus missing and no apt-get here: install Prometheus 2.x so they are on PATH" >&2
	exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
	if ! command -v sudo >/dev/null 2>&1; then
		echo "ops-deps: installing the prometheus package needs root" >&2
		exit 1
	fi
	sudo="sudo"
fi
echo "ops-deps: installing Debian's prometheus package (promtool, prometheus)"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# --no-install-recommends: the server and promtool only, not the node exporter.
$sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool >/dev/null && command -v prometheus >/dev/null || {
	echo "ops-deps: the prometheus package is installed but promtool/prometheus are not on PATH" >&2
	exit 1
}
echo "ops-deps: done ($(prometheus --version 2>&1 | head -n1))"
