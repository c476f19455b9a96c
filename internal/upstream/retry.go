package upstream

import (
	"context"
	"errors"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
)

// Retrier sends upstream requests under DESIGN's retry policy: connect
// errors, 429, 502, 503 (llama.cpp "Loading model") and 504 are retried with
// jittered exponential backoff, honouring Retry-After and retry-after-ms, at
// most Attempts tries and MaxElapsed overall. Timeouts are not retried (a
// slow prefill would be paid twice); other 4xx never are.
//
// Requests go through the transport's RoundTrip, never an http.Client: a
// client follows redirects (a 301 turns the POST into a GET to another
// path) and wraps errors in *url.Error, which quotes the URL (CRAFT 14).
type Retrier struct {
	Policy config.Retry
	RT     http.RoundTripper
	// OnRetry, when set, counts a retry of op for reason ("connect",
	// "status_429", "status_5xx").
	OnRetry func(op, reason string)
	// Sleep waits d or until ctx ends; nil: a real timer.
	Sleep func(ctx context.Context, d time.Duration) error
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

func (r *Retrier) backoff(n int) time.Duration {
	d := r.Policy.Backoff
	for i := 1; i < n && d < r.Policy.MaxBackoff; i++ {
		d *= 2
	}
	if r.Policy.MaxBackoff > 0 && d > r.Policy.MaxBackoff {
		d = r.Policy.MaxBackoff
	}
	if d <= 0 {
		return 0
	}
	// Equal jitter: half fixed, half random, so synchronized clients spread.
	return d/2 + rand.N(d/2+1)
}

func (r *Retrier) wait(ctx context.Context, d time.Duration) error {
	if r.Sleep != nil {
		return r.Sleep(ctx, d)
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

// Do sends the request mk builds (called once per try, so bodies are
// fresh) and returns the final response or error. The caller closes the
// body.
func (r *Retrier) Do(ctx context.Context, op string, mk func() (*http.Request, error)) (*http.Response, error) {
	start := time.Now()
	attempts := max(r.Policy.Attempts, 1)
	for n := 1; ; n++ {
		req, err := mk()
		if err != nil {
			return nil, err
		}
		resp, err := r.RT.RoundTrip(req.WithContext(ctx))
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
		if delay == neverRetry || (r.Policy.MaxElapsed > 0 && delay > r.Policy.MaxElapsed-time.Since(start)) {
			// A Retry-After beyond the budget: the client gets the answer.
			return resp, err
		}
		if resp != nil {
			drain(resp.Body, 1<<20)
		}
		if r.OnRetry != nil {
			r.OnRetry(op, reason)
		}
		if err := r.wait(ctx, delay); err != nil {
			return nil, err
		}
	}
}

// Transport is an http.RoundTripper applying the retry policy under op,
// for clients (the summarizer) that build plain http.Requests. The request
// body must be replayable (GetBody), as http.NewRequest makes it for bytes.
func (r *Retrier) Transport(op string) http.RoundTripper { return retryTransport{r: r, op: op} }

type retryTransport struct {
	r  *Retrier
	op string
}

// RoundTrip sends req under the policy, replaying its body (GetBody) on
// each retry.
func (t retryTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	first := true
	return t.r.Do(req.Context(), t.op, func() (*http.Request, error) {
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

// MaxErrorBody bounds how much of an upstream error answer is read to
// classify it (stream_options rejection, context overflow).
const MaxErrorBody = 1 << 20

// Attempt is one send of a request upstream, built whole by the caller for
// each send that differs (the first, the stream_options resend, overflow
// recovery's resend): what changes between sends is in this value, never
// in state the sender keeps.
type Attempt struct {
	// Op labels the retries: the route served (chat, responses,
	// messages) or summarize.
	Op     string
	URL    string
	Header http.Header
	// Body returns a fresh reader of the body for each try.
	Body   func() io.ReadCloser
	Length int64
}

// Send sends a POST under the retry policy. A status ≥ 400 comes back as
// *Answer (its body read up to MaxErrorBody); no usable answer as *Error
// (unless ctx ended: its error then). A successful response's body is the
// caller's to read and close.
func (r *Retrier) Send(ctx context.Context, a Attempt) (*http.Response, error) {
	resp, err := r.Do(ctx, a.Op, func() (*http.Request, error) {
		req, err := http.NewRequest(http.MethodPost, a.URL, a.Body())
		if err != nil {
			return nil, err
		}
		req.Header = a.Header.Clone()
		req.Header.Set("Content-Type", "application/json")
		req.ContentLength = a.Length
		return req, nil
	})
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, &Error{Failure: Classify(err), Err: err}
	}
	if resp.StatusCode >= 400 {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, MaxErrorBody))
		resp.Body.Close()
		return nil, &Answer{Status: resp.StatusCode, Header: resp.Header, Body: body}
	}
	return resp, nil
}
