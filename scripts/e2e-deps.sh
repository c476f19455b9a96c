#!/usr/bin/env bash
# Installs the end-to-end tests' npm dependencies (the official `openai` and
# `@anthropic-ai/sdk` SDKs, pinned by test/e2e/package-lock.json) into
# test/e2e/node_modules: test/e2e's client.mjs uses openai, test/llama's
# sdkclient.mjs both (the Responses and Messages loops against llama-server).
#
# Idempotent: when node_modules already holds exactly the lockfile's version of
# every package it pins, nothing is fetched. Otherwise `npm ci` installs from
# the committed lockfile (never `npm install`: the lockfile is the contract,
# and ci refuses a lockfile that disagrees with package.json).
#
# test/e2e/e2e_test.go runs this script itself when node_modules is missing,
# so `go test ./...` works on a fresh machine that has npm (test/llama does
# not: it skips its SDK loops and says to run this script, or fails under
# CI=true).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$root/test/e2e"

if ! command -v node >/dev/null 2>&1; then
	echo "e2e-deps: node is not installed (need Node.js >= 20 and npm for the end-to-end test)" >&2
	exit 127
fi
if ! command -v npm >/dev/null 2>&1; then
	echo "e2e-deps: npm is not installed (need npm to install the openai and @anthropic-ai/sdk SDKs for the end-to-end tests)" >&2
	exit 127
fi

node_major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$node_major" -lt 20 ]; then
	echo "e2e-deps: node $(node --version) is too old; the end-to-end test needs Node.js >= 20" >&2
	exit 1
fi

# installed_matches prints nothing and succeeds when every package the lockfile
# pins is present in node_modules with the pinned version.
installed_matches() {
	(cd "$dir" && node --input-type=module -e '
import { readFileSync, existsSync } from "node:fs";
const lock = JSON.parse(readFileSync("package-lock.json", "utf8"));
let ok = true;
for (const [path, meta] of Object.entries(lock.packages ?? {})) {
	if (path === "" || meta.optional || meta.dev) continue;
	const pj = path + "/package.json";
	if (!existsSync(pj)) { console.error(`missing ${path}`); ok = false; continue; }
	const v = JSON.parse(readFileSync(pj, "utf8")).version;
	if (v !== meta.version) { console.error(`${path}: have ${v}, lockfile pins ${meta.version}`); ok = false; }
}
process.exit(ok ? 0 : 1);
' 2>/dev/null)
}

if [ -d "$dir/node_modules" ] && installed_matches; then
	echo "e2e-deps: test/e2e/node_modules is up to date with package-lock.json"
	exit 0
fi

echo "e2e-deps: installing test/e2e dependencies with npm ci"
(cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
installed_matches || { echo "e2e-deps: npm ci finished but node_modules does not match package-lock.json" >&2; exit 1; }
echo "e2e-deps: done"
