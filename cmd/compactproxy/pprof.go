//go:build pprof

package main

// Profiling for the load harness only: `go build -tags pprof` (bench/run.sh
// with BENCH_PPROF set) adds net/http/pprof on BENCH_PPROF_ADDR, a listener
// of its own, never the proxy's. Release builds carry none of this: a
// profile endpoint would show request timing to anyone who can reach it.
// The variable is outside the COMPACTPROXY_ namespace on purpose: it is not
// configuration and must not appear in `compactproxy config`.

import (
	"net"
	"net/http"
	_ "net/http/pprof" // registers on http.DefaultServeMux, served below only
	"os"
)

func init() {
	addr := os.Getenv("BENCH_PPROF_ADDR")
	if addr == "" {
		return
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		os.Stderr.WriteString("compactproxy: pprof listener: " + err.Error() + "\n")
		return
	}
	go func() { _ = http.Serve(ln, http.DefaultServeMux) }()
}
