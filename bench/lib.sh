# What the bench drivers (run.sh, profile.sh, soak.sh, stores.sh) share.
# Source it from the repository root: . bench/lib.sh, then bench_init.

# bench_init NAME PREFIX: a work directory $work (compactproxy-NAME.*) that
# is removed on exit, after every process in pids is stopped; log lines
# start with "PREFIX: ".
bench_init() {
	log_prefix="$2"
	work="$(mktemp -d "${TMPDIR:-/tmp}/compactproxy-$1.XXXXXX")"
	pids=()
	trap bench_cleanup EXIT
	trap 'exit 130' INT TERM
}

bench_cleanup() {
	local pid
	for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
	for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
	rm -rf "$work"
}

log() { echo "$log_prefix: $*" >&2; }

# wait_file FILE PID: wait up to 10 s for process PID to write FILE (its
# address); 1 when it exits first or never does.
wait_file() {
	local i
	for i in $(seq 1 200); do
		[ -s "$1" ] && return 0
		kill -0 "$2" 2>/dev/null || return 1
		sleep 0.05
	done
	return 1
}

# start_addr NAME BIN [ARGS...]: runs $work/BIN ARGS -addr-file
# $work/NAME.addr (a harness binary: mockupstream, bareproxy), logging to
# $work/NAME.log; sets addr and last_pid, and exits when it does not start.
start_addr() {
	local name="$1" bin="$2"
	shift 2
	"$work/$bin" "$@" -addr-file "$work/$name.addr" >"$work/$name.log" 2>&1 &
	last_pid=$!
	pids+=("$last_pid")
	wait_file "$work/$name.addr" "$last_pid" || { log "$name did not start:"; cat "$work/$name.log" >&2; exit 1; }
	addr="$(cat "$work/$name.addr")"
}

# start_upstreams LATENCY SUMMARIZER_LATENCY: the harness's two mock
# upstreams (chat, summarizer) and the bare proxy in front of the first;
# sets mock, summock, bare and bare_pid (host:port, pid).
start_upstreams() {
	start_addr mock mockupstream -latency "$1"
	mock="$addr"
	start_addr summock mockupstream -latency "$2"
	summock="$addr"
	start_addr bare bareproxy -upstream "http://$mock"
	bare="$addr"
	bare_pid="$last_pid"
}

# start_compactproxy LOG PORT [ENV=value...]: $work/compactproxy on
# 127.0.0.1:PORT in front of $mock with a 1,000,000-token window, configured
# by env alone (run from the work directory: no config file; the caller's
# COMPACTPROXY_* are dropped; the ENV given last wins), logging to
# $work/LOG.log; sets last_pid. wait_healthy tells when it answers.
start_compactproxy() {
	local logname="$1" port="$2" name
	shift 2
	local unset_args=()
	while IFS= read -r name; do unset_args+=(-u "$name"); done < <(env | sed -n 's/^\(COMPACTPROXY_[A-Za-z0-9_]*\)=.*/\1/p')
	(
		cd "$work"
		exec env "${unset_args[@]}" \
			COMPACTPROXY_LISTEN="127.0.0.1:$port" \
			COMPACTPROXY_UPSTREAM_URL="http://$mock/v1" \
			COMPACTPROXY_UPSTREAM_CONTEXT_WINDOW=1000000 \
			COMPACTPROXY_LOG_LEVEL=warn \
			"$@" ./compactproxy
	) >"$work/$logname.log" 2>&1 &
	last_pid=$!
	pids+=("$last_pid")
}

# wait_healthy PORT PID: up to 15 s for /healthz on 127.0.0.1:PORT to
# answer; 1 when process PID exits first or it never does.
wait_healthy() {
	local i
	for i in $(seq 1 150); do
		kill -0 "$2" 2>/dev/null || return 1
		curl -fsS -o /dev/null --max-time 1 "http://127.0.0.1:$1/healthz" 2>/dev/null && return 0
		sleep 0.1
	done
	return 1
}
