// Package upstream is compactproxy's client of its one upstream: the
// transport (Transport.RoundTrip, never an http.Client), the retry policy
// with backoff and Retry-After, the fixed text per failure class, the
// context window (configured, discovered from /props and /v1/models,
// learned from overflow answers) and the per-model stream_options switch.
//
// It knows nothing of the client's request: a send takes one Attempt, the
// outgoing request as a value built by the caller, anew for each send that
// changes it (httputil's outreq; Caddy's proxyLoopIteration).
package upstream

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// DialError marks an error that happened while connecting to the upstream:
// the request never reached it, so it is always safe to retry. Errors are
// classified by wrapper type, never by string matching (Caddy's habit).
type DialError struct{ error }

// Unwrap returns the dialer's error.
func (e DialError) Unwrap() error { return e.error }

// NewTransport clones http.DefaultTransport (proxy settings, HTTP/2, idle
// pools) and wraps dial errors in DialError. No ResponseHeaderTimeout: a
// long prefill on a local model can take minutes before the first byte.
func NewTransport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	d := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	t.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, DialError{err}
		}
		return c, nil
	}
	t.MaxIdleConns = 512
	t.MaxIdleConnsPerHost = 256
	t.IdleConnTimeout = 90 * time.Second
	return t
}

// Target is the upstream's address: Base with its version path, Root the
// base with a trailing /v1 removed (llama.cpp's root endpoints).
type Target struct {
	Base *url.URL
	Root *url.URL
}

// ParseTarget reads upstream.url.
func ParseTarget(raw string) (Target, error) {
	u, err := url.Parse(strings.TrimRight(raw, "/"))
	if err != nil {
		return Target{}, err
	}
	root := *u
	root.Path = strings.TrimSuffix(u.Path, "/v1")
	root.RawPath = ""
	return Target{Base: u, Root: &root}, nil
}

// Join appends a path to a base URL.
func Join(base *url.URL, p string) *url.URL {
	u := *base
	u.Path = strings.TrimRight(base.Path, "/") + "/" + strings.TrimLeft(p, "/")
	u.RawPath = ""
	return &u
}

// LogURL is how an upstream URL appears in logs: scheme, host and path
// only (no userinfo, no query string, no fragment).
func LogURL(u *url.URL) string {
	if u == nil {
		return ""
	}
	return (&url.URL{Scheme: u.Scheme, Host: u.Host, Path: u.Path}).String()
}

// SetKey puts the proxy's own upstream key (upstream.api_key) on h in
// place of any client credential: Anthropic's X-Api-Key for dialect
// anthropic, a bearer token otherwise. An empty key leaves h as it is.
func SetKey(h http.Header, key, dialect string) {
	if key == "" {
		return
	}
	h.Del("X-Api-Key")
	h.Del("Api-Key")
	h.Del("Authorization")
	if dialect == "anthropic" {
		h.Set("X-Api-Key", key) // Anthropic's own header
	} else {
		h.Set("Authorization", "Bearer "+key)
	}
}

// drain reads what is left of a body (bounded) and closes it, so the
// connection can be reused.
func drain(body io.ReadCloser, limit int64) {
	_, _ = io.Copy(io.Discard, io.LimitReader(body, limit))
	body.Close()
}
