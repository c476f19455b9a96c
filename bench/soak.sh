#!/usr/bin/env bash
# Soak (`make soak`; not part of `make test`): 1,000 concurrent streaming
# clients for 60 s (each stream 5-20 s of events, a tenth leaving mid-stream)
# plus a trickle of 1 MiB non-stream requests, first against the mock
# upstream directly, then through compactproxy twice: a 20 s rehearsal of
# the same load, then the measured 60 s, in one run (bench/cmd/soak).
# Reports counts, compactproxy's goroutines, RSS (anonymous and
# file-backed) and heap cold, after a light warm-up (start_light), after
# the rehearsal (start), at peak and at the end, each settled (pools idle,
# two collections, RSS flat for 30 s; start_light at most 240 s, the
# others at most SOAK_DRAIN), and p50/p99 TTFB
# of the direct and the measured phase. Flat is end within 10% of start:
# the rehearsal puts the Go runtime's high-water figures (the peak's
# goroutine descriptors, heap goal and metadata) into the start, so growth
# is what the second full run left behind; the end is also given against
# start_light and cold. Exit 1 when a request was not answered or aborted
# correctly, the goroutines did not settle, or RSS was not flat.
# It takes about 12 min (11.5 in the last run; each settle waits for the
# runtime's forced collections, 2 min apart), at most about 18.
#
# Knobs (env): SOAK_STREAMS (1000), SOAK_DURATION (60s), SOAK_REHEARSAL (20s),
# SOAK_TRICKLE (250ms), SOAK_LEAVE (0.1), SOAK_DRAIN (300s: how long the start
# after the rehearsal and the end wait at most for goroutines and RSS to
# settle), SOAK_OUT (bench/results/soak.json).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

streams="${SOAK_STREAMS:-1000}"
duration="${SOAK_DURATION:-60s}"
rehearsal="${SOAK_REHEARSAL:-20s}"
trickle="${SOAK_TRICKLE:-250ms}"
leave="${SOAK_LEAVE:-0.1}"
drain="${SOAK_DRAIN:-300s}"
out="${SOAK_OUT:-$root/bench/results/soak.json}"
mkdir -p "$(dirname "$out")"

# Each proxied stream holds a client and an upstream socket; the mock holds
# one per stream of both phases.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

. bench/lib.sh
bench_init soak soak

log "building into $work (ulimit -n $(ulimit -n))"
go build -o "$work/" ./bench/cmd/mockupstream ./bench/cmd/soak ./bench/cmd/loadgen
CGO_ENABLED=0 go build -o "$work/compactproxy" ./cmd/compactproxy

# The mock closes idle keep-alive connections after 5 s, so the proxy's
# upstream pool drains and the end figures show what the proxy still holds.
start_addr mock mockupstream -latency 20ms -idle-timeout 5s
mock="$addr"

port="$("$work/loadgen" -freeport)"
start_compactproxy compactproxy "$port"
cpid="$last_pid"
wait_healthy "$port" "$cpid" || { log "compactproxy did not start:"; cat "$work/compactproxy.log" >&2; exit 1; }

log "mock http://$mock  compactproxy http://127.0.0.1:$port (pid $cpid); $streams streams for $duration (rehearsal $rehearsal)"
set +e
timeout --kill-after=10s 1500s "$work/soak" -direct "http://$mock/v1" -proxy "http://127.0.0.1:$port/v1" \
	-metrics "http://127.0.0.1:$port/metrics" -pid "$cpid" \
	-streams "$streams" -duration "$duration" -rehearsal "$rehearsal" -trickle "$trickle" -leave "$leave" -drain "$drain" -out "$out"
rc=$?
set -e
log "compactproxy log lines by message:"
sed -n 's/.*"msg":"\([^"]*\)".*/\1/p' "$work/compactproxy.log" | sort | uniq -c | sort -rn | head >&2 || true
exit "$rc"
