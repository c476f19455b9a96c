#!/usr/bin/env bash
# Store backends through the load harness (not part of `make test`):
# the bolt and redis backends' cost over the memory backend, as ratios
# measured in one run each.
#
# Starts on 127.0.0.1 (free ports): the mock upstream (fixed latency), a
# redis-server of its own (no persistence), and three compactproxy
# binaries in front of the mock: store.backend memory, bolt and redis.
# Then runs loadgen twice with the memory proxy in the "bare" slot and,
# in the "compactproxy" slot, first the redis proxy, then the bolt proxy;
# so loadgen's "compactproxy vs bare" figures read "backend vs memory".
#
# Knobs (env): as bench/run.sh (BENCH_ROUNDS 3, BENCH_CONCURRENCY 1,32,
# BENCH_LATENCY 20ms, BENCH_BUDGET 240s, BENCH_CONVERSATIONS same|per-worker,
# BENCH_OUT bench/results/stores, BENCH_BACKENDS "redis bolt").
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
rounds="${BENCH_ROUNDS:-3}"
conc="${BENCH_CONCURRENCY:-1,32}"
latency="${BENCH_LATENCY:-20ms}"
budget="${BENCH_BUDGET:-240s}"
conversations="${BENCH_CONVERSATIONS:-same}"
out="${BENCH_OUT:-$root/bench/results/stores}"

command -v redis-server >/dev/null || { echo "bench: redis-server missing (scripts/redis-deps.sh)" >&2; exit 1; }
. bench/lib.sh
bench_init stores bench

go build -o "$work/" ./bench/cmd/mockupstream ./bench/cmd/loadgen
CGO_ENABLED=0 go build -o "$work/compactproxy" ./cmd/compactproxy

start_addr mock mockupstream -latency "$latency"
mock="$addr"

rport="$("$work/loadgen" -freeport)"
redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no --loglevel warning >"$work/redis.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do redis-cli -p "$rport" ping >/dev/null 2>&1 && break; sleep 0.05; done

# start_proxy NAME ENV...: one compactproxy; sets url[NAME] and pid[NAME].
declare -A url pid
start_proxy() {
	local name="$1" port
	shift
	port="$("$work/loadgen" -freeport)"
	start_compactproxy "$name" "$port" COMPACTPROXY_STORE_TENANT_SECRET=bench "$@"
	pid[$name]="$last_pid"
	url[$name]="http://127.0.0.1:$port/v1"
	wait_healthy "$port" "$last_pid" || { log "$name did not start: $(tail -c 300 "$work/$name.log")"; exit 1; }
}
start_proxy memory COMPACTPROXY_STORE_BACKEND=memory
start_proxy redis COMPACTPROXY_STORE_BACKEND=redis COMPACTPROXY_STORE_REDIS_URL="redis://127.0.0.1:$rport/0"
start_proxy bolt COMPACTPROXY_STORE_BACKEND=bolt COMPACTPROXY_STORE_BOLT_PATH="$work/state.db"

rc=0
for backend in ${BENCH_BACKENDS:-redis bolt}; do
	log "=== $backend vs memory (loadgen: 'bare' = memory backend, 'compactproxy' = $backend backend)"
	timeout --kill-after=10s 600s "$work/loadgen" \
		-direct "http://$mock/v1" -bare "${url[memory]}" -bare-pid "${pid[memory]}" \
		-compact "${url[$backend]}" -compact-pid "${pid[$backend]}" \
		-clk-tck "$(getconf CLK_TCK)" -rounds "$rounds" -concurrency "$conc" -budget "$budget" \
		-conversations "$conversations" -scenarios 16KB,16KB-stream,1MiB -out "$out/$backend" \
		-note "stores.sh: bare = store.backend memory, compactproxy = store.backend $backend" || rc=$?
	for name in memory "$backend"; do
		if grep -q . "$work/$name.log"; then log "$name log (tail):"; tail -n 5 "$work/$name.log" >&2; fi
	done
done
redis-cli -p "$rport" dbsize >&2 || true
exit "$rc"
