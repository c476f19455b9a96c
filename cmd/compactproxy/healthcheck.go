package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"

	"github.com/spf13/pflag"
)

// runHealthcheck GETs /healthz of the local server (or --url) and returns 0
// on 200, 1 otherwise. It exists for container HEALTHCHECKs in images
// without a shell or curl. It needs only `listen` from the configuration, so
// an otherwise invalid configuration does not make it fail.
func runHealthcheck(ctx context.Context, fset *pflag.FlagSet, stderr io.Writer) int {
	target, _ := fset.GetString("url")
	timeout, _ := fset.GetDuration("timeout")
	if target == "" {
		cfg, _, err := loadConfig(fset, defaultConfigFile)
		if err != nil {
			fmt.Fprintf(stderr, "healthcheck: %v\n", err)
			return exitFail
		}
		target, err = healthURL(cfg.Listen)
		if err != nil {
			fmt.Fprintf(stderr, "healthcheck: %v\n", err)
			return exitFail
		}
	}

	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		fmt.Fprintf(stderr, "healthcheck: %v\n", err)
		return exitFail
	}
	// No proxy from the environment: the target is this container.
	client := &http.Client{Transport: &http.Transport{Proxy: nil}}
	resp, err := client.Do(req)
	if err != nil {
		fmt.Fprintf(stderr, "healthcheck: %v\n", err)
		return exitFail
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		fmt.Fprintf(stderr, "healthcheck: %s answered %d\n", target, resp.StatusCode)
		return exitFail
	}
	return exitOK
}

// healthURL turns a listen address into the URL of its /healthz; an empty
// or unspecified host (":8081", "0.0.0.0:8081", "[::]:8081") means loopback.
func healthURL(listen string) (string, error) {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return "", fmt.Errorf("listen %q: %w", listen, err)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port) + "/healthz", nil
}
