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

work="$(mktemp -d "${TMPDIR:-/tmp}/compactproxy-profile.XXXXXX")"
pids=()
cleanup() {
	local pid
	for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
	for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
log() { echo "profile: $*" >&2; }

wait_file() {
	local i
	for i in $(seq 1 200); do
		[ -s "$1" ] && return 0
		kill -0 "$2" 2>/dev/null || return 1
		sleep 0.05
	done
	return 1
}

go build -o "$work/" ./bench/cmd/mockupstream ./bench/cmd/bareproxy ./bench/cmd/loadgen
CGO_ENABLED=0 go build -tags pprof -o "$work/compactproxy" ./cmd/compactproxy

"$work/mockupstream" -latency "$latency" -addr-file "$work/mock.addr" >"$work/mock.log" 2>&1 &
pids+=($!)
wait_file "$work/mock.addr" "${pids[-1]}" || { log "mock did not start"; exit 1; }
mock="$(cat "$work/mock.addr")"
"$work/mockupstream" -latency "$sumlatency" -addr-file "$work/summock.addr" >"$work/summock.log" 2>&1 &
pids+=($!)
wait_file "$work/summock.addr" "${pids[-1]}" || { log "summarizer mock did not start"; exit 1; }
summock="$(cat "$work/summock.addr")"
"$work/bareproxy" -upstream "http://$mock" -addr-file "$work/bare.addr" >"$work/bare.log" 2>&1 &
pids+=($!)
wait_file "$work/bare.addr" "${pids[-1]}" || { log "bare proxy did not start"; exit 1; }
bare="$(cat "$work/bare.addr")"

port="$("$work/loadgen" -freeport)"
pport="$("$work/loadgen" -freeport)"
unset_args=()
while IFS= read -r name; do unset_args+=(-u "$name"); done < <(env | sed -n 's/^\(COMPACTPROXY_[A-Za-z0-9_]*\)=.*/\1/p')
(
	cd "$work"
	exec env "${unset_args[@]}" \
		BENCH_PPROF_ADDR="127.0.0.1:$pport" \
		COMPACTPROXY_LISTEN="127.0.0.1:$port" \
		COMPACTPROXY_UPSTREAM_URL="http://$mock/v1" \
		COMPACTPROXY_UPSTREAM_CONTEXT_WINDOW=1000000 \
		COMPACTPROXY_MODELS="$("$work/loadgen" -print-models)" \
		COMPACTPROXY_COMPACTION_SUMMARIZER_URL="http://$summock/v1" \
		COMPACTPROXY_COMPACTION_SUMMARIZER_MODEL=bench-summarizer \
		COMPACTPROXY_LOG_LEVEL=warn \
		./compactproxy
) >"$work/compactproxy.log" 2>&1 &
cpid=$!
pids+=("$cpid")
for _ in $(seq 1 150); do
	curl -fsS -o /dev/null --max-time 1 "http://127.0.0.1:$port/healthz" 2>/dev/null && break
	sleep 0.1
done

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
