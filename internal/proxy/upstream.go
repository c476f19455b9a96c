package proxy

import (
	"context"
	"errors"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/compactproxy/compactproxy/internal/metrics"
)

// DialError marks an error that happened while connecting to the upstream:
// the request never reached it, so it is always safe to retry. Errors are
// classified by wrapper type, never by string matching (Caddy's habit).
type DialError struct{ error }

func (e DialError) Unwrap() error { return e.error }

// newTransport clones http.DefaultTransport (proxy settings, HTTP/2, idle
// pools) and wraps dial errors in DialError. No ResponseHeaderTimeout: a long
// prefill on a local model can take minutes before the first byte.
func newTransport() *http.Transport {
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

// upstreamURLs holds the base URL (with its version path) and the root
// (the base with a trailing /v1 removed, for llama.cpp's root endpoints).
type upstreamURLs struct {
	base *url.URL
	root *url.URL
}

func parseUpstream(raw string) (upstreamURLs, error) {
	u, err := url.Parse(strings.TrimRight(raw, "/"))
	if err != nil {
		return upstreamURLs{}, err
	}
	root := *u
	root.Path = strings.TrimSuffix(u.Path, "/v1")
	root.RawPath = ""
	return upstreamURLs{base: u, root: &root}, nil
}

// join appends a path to a base URL.
func join(base *url.URL, p string) *url.URL {
	u := *base
	u.Path = strings.TrimRight(base.Path, "/") + "/" + strings.TrimLeft(p, "/")
	u.RawPath = ""
	return &u
}

// retrier sends upstream requests under DESIGN's retry policy: connect
// errors, 429, 502, 503 (llama.cpp "Loading model") and 504 are retried with
// jittered exponential backoff, honouring Retry-After and retry-after-ms, at
// most Attempts tries and MaxElapsed overall. Timeouts are not retried (a
// slow prefill would be paid twice); other 4xx never are.
//
// Requests go through the transport's RoundTrip, never an http.Client: a
// client follows redirects (a 301 turns the POST into a GET to another
// path) and wraps errors in *url.Error, which quotes the URL (CRAFT 14).
type retrier struct {
	policy  config.Retry
	rt      http.RoundTripper
	metrics *metrics.Metrics
	sleep   func(ctx context.Context, d time.Duration) error // nil = real sleep
}

// retryReason tells whether a result may be retried and why ("" = no).
func retryReason(resp *http.Response, err error) string {
	if err != nil {
		var de DialError
		if errors.As(err, &de) {
			return "connect"
		}
		return ""
	}
	switch resp.StatusCode {
	case http.StatusTooManyRequests:
		return "status_429"
	case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return "status_5xx"
	}
	return ""
}

// neverRetry is the wait reported for a Retry-After that is malformed or
// larger than any budget: it compares beyond every max_elapsed.
const neverRetry = time.Duration(math.MaxInt64)

// retryAfter reads retry-after-ms or Retry-After (seconds or an HTTP date).
// ok reports that the upstream sent one. Values are compared before they
// are converted, so 1e20 seconds cannot overflow time.Duration into a
// negative wait; a malformed, negative or huge value is neverRetry: the
// upstream's answer goes to the client at once (DESIGN § retries).
func retryAfter(h http.Header, now time.Time) (time.Duration, bool) {
	if v := h.Get("Retry-After-Ms"); v != "" {
		return fromUnits(v, float64(time.Millisecond)), true
	}
	if v := h.Get("Retry-After"); v != "" {
		if t, err := http.ParseTime(v); err == nil {
			return max(t.Sub(now), 0), true
		}
		return fromUnits(v, float64(time.Second)), true
	}
	return 0, false
}

// fromUnits converts a non-negative decimal count of units (nanoseconds
// each) to a Duration, or neverRetry when it is not one or does not fit.
func fromUnits(v string, unit float64) time.Duration {
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || !(f >= 0) || f >= float64(math.MaxInt64)/unit {
		return neverRetry
	}
	return time.Duration(f * unit)
}

func (r *retrier) backoff(n int) time.Duration {
	d := r.policy.Backoff
	for i := 1; i < n && d < r.policy.MaxBackoff; i++ {
		d *= 2
	}
	if r.policy.MaxBackoff > 0 && d > r.policy.MaxBackoff {
		d = r.policy.MaxBackoff
	}
	if d <= 0 {
		return 0
	}
	// Equal jitter: half fixed, half random, so synchronized clients spread.
	return d/2 + rand.N(d/2+1)
}

func (r *retrier) wait(ctx context.Context, d time.Duration) error {
	if r.sleep != nil {
		return r.sleep(ctx, d)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// do sends the request mk builds (called once per try, so bodies are fresh)
// and returns the final response or error. The caller closes the body.
func (r *retrier) do(ctx context.Context, op string, mk func() (*http.Request, error)) (*http.Response, error) {
	start := time.Now()
	attempts := max(r.policy.Attempts, 1)
	for n := 1; ; n++ {
		req, err := mk()
		if err != nil {
			return nil, err
		}
		resp, err := r.rt.RoundTrip(req.WithContext(ctx))
		reason := retryReason(resp, err)
		if reason == "" || n >= attempts || ctx.Err() != nil {
			return resp, err
		}
		delay := r.backoff(n)
		if resp != nil {
			if d, ok := retryAfter(resp.Header, time.Now()); ok {
				delay = d
			}
		}
		// Compared as a difference: time.Since(start)+neverRetry overflows.
		if delay == neverRetry || (r.policy.MaxElapsed > 0 && delay > r.policy.MaxElapsed-time.Since(start)) {
			// A Retry-After beyond the budget: the client gets the answer.
			return resp, err
		}
		if resp != nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
			resp.Body.Close()
		}
		r.metrics.UpstreamRetries.WithLabelValues(op, reason).Inc()
		if err := r.wait(ctx, delay); err != nil {
			return nil, err
		}
	}
}

// retryTransport is an http.RoundTripper applying the retry policy, for
// clients (the summarizer) that build plain http.Requests. The request body
// must be replayable (GetBody), as http.NewRequest makes it for bytes.
type retryTransport struct {
	r  *retrier
	op string
}

func (t retryTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	first := true
	return t.r.do(req.Context(), t.op, func() (*http.Request, error) {
		if first {
			first = false
			return req, nil
		}
		c := req.Clone(req.Context())
		if req.GetBody != nil {
			b, err := req.GetBody()
			if err != nil {
				return nil, err
			}
			c.Body = b
		}
		return c, nil
	})
}
