#!/usr/bin/env bash
# CPU profile of the real binary under the load harness (`make bench-profile`;
# not part of `make test` or `make bench`).
#
# Builds compactproxy with -tags pprof (net/http/pprof on a listener of its
# own, see cmd/compactproxy/pprof.go; release builds have none), starts the
# harness's mock upstream and bare proxy and that binary like bench/run.sh
# does, drives compactproxy alone with loadgen at one scenario and
# concurrency, and fetches a CPU profile of the middle of the run.
#
# Knobs (env): PROFILE_SCENARIO (1MiB; also the agent scenarios cross and
# 1MiB-compaction, run once, the profile covering PROFILE_SECONDS of them),
# PROFILE_CONCURRENCY (1), PROFILE_SECONDS (20),
# PROFILE_OUT (bench/results/profile-<scenario>-c<N>.pprof), BENCH_LATENCY
# (20ms), BENCH_SUMMARIZER_LATENCY (2s).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

scenario="${PROFILE_SCENARIO:-1MiB}"
conc="${PROFILE_CONCURRENCY:-1}"
secs="${PROFILE_SECONDS:-20}"
out="${PROFILE_OUT:-$root/bench/results/profile-$scenario-c$conc.pprof}"
latency="${BENCH_LATENCY:-20ms}"
sumlatency="${BENCH_SUMMARIZER_LATENCY:-2s}"

. bench/lib.sh
bench_init profile profile

go build -o "$work/" ./bench/cmd/mockupstream ./bench/cmd/bareproxy ./bench/cmd/loadgen
CGO_ENABLED=0 go build -tags pprof -o "$work/compactproxy" ./cmd/compactproxy

start_upstreams "$latency" "$sumlatency"

port="$("$work/loadgen" -freeport)"
pport="$("$work/loadgen" -freeport)"
start_compactproxy compactproxy "$port" \
	BENCH_PPROF_ADDR="127.0.0.1:$pport" \
	COMPACTPROXY_MODELS="$("$work/loadgen" -print-models)" \
	COMPACTPROXY_COMPACTION_SUMMARIZER_URL="http://$summock/v1" \
	COMPACTPROXY_COMPACTION_SUMMARIZER_MODEL=bench-summarizer
cpid="$last_pid"
wait_healthy "$port" "$cpid" || { log "compactproxy did not start: $(tail -c 300 "$work/compactproxy.log")"; exit 1; }

# The agent scenarios measure against the mock too (direct).
targets=compactproxy
case "$scenario" in cross | 1MiB-compaction) targets=direct,compactproxy ;; esac
# Enough rounds to outlast the profile; the budget stops loadgen after it.
"$work/loadgen" -direct "http://$mock/v1" -bare "http://$bare/v1" \
	-compact "http://127.0.0.1:$port/v1" -compact-pid "$cpid" -clk-tck "$(getconf CLK_TCK)" \
	-targets "$targets" -scenarios "$scenario" -concurrency "$conc" -rounds 1000 \
	-budget "$((secs + 6))s" >"$work/loadgen.log" 2>&1 &
lpid=$!
pids+=("$lpid")
sleep 3
mkdir -p "$(dirname "$out")"
curl -fsS --max-time "$((secs + 30))" -o "$out" "http://127.0.0.1:$pport/debug/pprof/profile?seconds=$secs"
wait "$lpid" || true
grep -A3 "^$scenario c=" "$work/loadgen.log" >&2 || sed -n '/^cross:/,/^targets/p;/^1MiB-compaction:/,/^targets/p' "$work/loadgen.log" >&2
cp "$work/compactproxy" "${out%.pprof}.bin"
log "profile: $out (binary ${out%.pprof}.bin)"
go tool pprof -top -nodecount=40 "${out%.pprof}.bin" "$out" 2>/dev/null | sed -n '1,50p'
