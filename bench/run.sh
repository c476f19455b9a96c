#!/usr/bin/env bash
# Load harness driver (`make bench`; not part of `make test`).
#
# Builds and starts, all on 127.0.0.1 with free ports:
#   mockupstream  OpenAI-compatible upstream, fixed 20 ms latency
#   mockupstream  a second one as the summarizer, fixed 2 s latency
#   bareproxy     plain httputil.ReverseProxy in front of the mock (the floor)
#   compactproxy  the real binary from ./cmd/compactproxy in front of the mock,
#                 configured by env alone, with a context window large enough
#                 that the 16KB and 1MiB requests stay below the compaction
#                 trigger, and windows for the agent scenarios' models
#                 (loadgen -print-models) that put them over it
# then runs loadgen against the three (rounds interleaved), then the agent
# scenarios against compactproxy (cross: the request that crosses the
# trigger, with think time between steps; 1MiB-compaction: the first
# over-trigger request and re-applied ones at 1 MiB), and stops them all.
# If compactproxy does not build or start, the harness still measures direct
# and bare and reports compactproxy as failing.
#
# Knobs (env): BENCH_ROUNDS (5), BENCH_SCALE (1: multiplies request counts),
# BENCH_CONCURRENCY (1,32), BENCH_OUT (bench/results), BENCH_LATENCY (20ms),
# BENCH_BUDGET (270s: no round starts that would end after it),
# BENCH_CONVERSATIONS (same: identical requests, one conversation; per-worker:
# each concurrent worker sends its own X-Compactproxy-Conversation),
# BENCH_SCENARIOS (all; e.g. "cross" or "1MiB,1MiB-compaction"),
# BENCH_SUMMARIZER_LATENCY (2s), BENCH_THINK (2.5s: agent think time),
# BENCH_PRESUMMARIZE_RATIO (compactproxy's default; 0 turns background
# summaries off, to measure the crossing request without them),
# BENCH_COMPACTPROXY_BIN (a prebuilt binary instead of building
# ./cmd/compactproxy: an earlier commit's, to hold a change against it).
# Bounded: every wait has a timeout, loadgen gives up on a stuck target
# (-cell-timeout) and stops starting rounds past the budget.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

rounds="${BENCH_ROUNDS:-5}"
scale="${BENCH_SCALE:-1}"
conc="${BENCH_CONCURRENCY:-1,32}"
out="${BENCH_OUT:-$root/bench/results}"
latency="${BENCH_LATENCY:-20ms}"
budget="${BENCH_BUDGET:-270s}"
conversations="${BENCH_CONVERSATIONS:-same}"
scenarios="${BENCH_SCENARIOS:-}"
sumlatency="${BENCH_SUMMARIZER_LATENCY:-2s}"
think="${BENCH_THINK:-2.5s}"
presum=()
if [ -n "${BENCH_PRESUMMARIZE_RATIO:-}" ]; then
	presum=(COMPACTPROXY_COMPACTION_PRESUMMARIZE_RATIO="$BENCH_PRESUMMARIZE_RATIO")
fi

. bench/lib.sh
bench_init bench bench

log "building harness and compactproxy into $work"
go build -o "$work/" ./bench/cmd/mockupstream ./bench/cmd/bareproxy ./bench/cmd/loadgen
note=""
if [ -n "${BENCH_COMPACTPROXY_BIN:-}" ]; then
	cp "$BENCH_COMPACTPROXY_BIN" "$work/compactproxy"
elif ! CGO_ENABLED=0 go build -o "$work/compactproxy" ./cmd/compactproxy >"$work/build.log" 2>&1; then
	note="compactproxy did not build: $(head -c 300 "$work/build.log" | tr '\n' ' ')"
	log "$note"
fi

start_upstreams "$latency" "$sumlatency"

compact_args=()
if [ -z "$note" ]; then
	port="$("$work/loadgen" -freeport)"
	start_compactproxy compactproxy "$port" \
		COMPACTPROXY_MODELS="$("$work/loadgen" -print-models)" \
		COMPACTPROXY_COMPACTION_SUMMARIZER_URL="http://$summock/v1" \
		COMPACTPROXY_COMPACTION_SUMMARIZER_MODEL=bench-summarizer \
		"${presum[@]}"
	compact_pid="$last_pid"
	if wait_healthy "$port" "$compact_pid"; then
		compact_args=(-compact "http://127.0.0.1:$port/v1" -compact-pid "$compact_pid")
	else
		note="compactproxy did not answer /healthz within 15s: $(tail -c 300 "$work/compactproxy.log" | tr '\n' ' ')"
		log "$note"
	fi
fi

log "mock http://$mock  summarizer http://$summock  bare http://$bare (pid $bare_pid)  compactproxy ${compact_args[1]:-(absent)} (pid ${compact_pid:-none})"
if [ -n "${BENCH_PRESUMMARIZE_RATIO:-}" ]; then
	note="${note:+$note; }compaction.presummarize_ratio=$BENCH_PRESUMMARIZE_RATIO"
fi
if [ -n "${BENCH_COMPACTPROXY_BIN:-}" ]; then
	note="${note:+$note; }compactproxy binary: $BENCH_COMPACTPROXY_BIN"
fi
set +e
timeout --kill-after=10s 600s "$work/loadgen" \
	-direct "http://$mock/v1" -bare "http://$bare/v1" -bare-pid "$bare_pid" \
	"${compact_args[@]}" \
	-clk-tck "$(getconf CLK_TCK)" -rounds "$rounds" -scale "$scale" -concurrency "$conc" -budget "$budget" -conversations "$conversations" \
	-scenarios "$scenarios" -summarizer-latency "$sumlatency" -think "$think" \
	-out "$out" -note "$note"
rc=$?
set -e
if [ -s "$work/compactproxy.log" ]; then
	log "compactproxy log (tail):"
	tail -n 20 "$work/compactproxy.log" >&2
fi
exit "$rc"
