package upstream

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
)

// scripted is a RoundTripper that answers from a script, one entry per
// try, recording the bodies it was sent.
type scripted struct {
	answers []func() (*http.Response, error)
	bodies  []string
}

func (s *scripted) RoundTrip(req *http.Request) (*http.Response, error) {
	b, _ := io.ReadAll(req.Body)
	s.bodies = append(s.bodies, string(b))
	next := s.answers[0]
	if len(s.answers) > 1 {
		s.answers = s.answers[1:]
	}
	return next()
}

func status(code int, h ...string) func() (*http.Response, error) {
	return func() (*http.Response, error) {
		r := &http.Response{StatusCode: code, Header: http.Header{}, Body: io.NopCloser(strings.NewReader(`{"error":{"message":"x"}}`))}
		for i := 0; i+1 < len(h); i += 2 {
			r.Header.Set(h[i], h[i+1])
		}
		return r, nil
	}
}

func dialFails() (*http.Response, error) {
	return nil, DialError{&net.OpError{Op: "dial", Err: errors.New("refused")}}
}

// The retry policy of DESIGN § Upstream calls, one send at a time: which
// answers are retried, how often, what comes back, and that every try
// sends the attempt's whole body.
func TestSendRetryPolicy(t *testing.T) {
	cases := []struct {
		name    string
		answers []func() (*http.Response, error)
		tries   int
		want    string // "ok", "answer NNN", or a failure code
		retries []string
	}{
		{"503 then ok", []func() (*http.Response, error){status(503), status(200)}, 2, "ok", []string{"status_5xx"}},
		{"connect error then ok", []func() (*http.Response, error){dialFails, status(200)}, 2, "ok", []string{"connect"}},
		{"429 every time: the last answer", []func() (*http.Response, error){status(429)}, 3, "answer 429", []string{"status_429", "status_429"}},
		{"400 is never retried", []func() (*http.Response, error){status(400), status(200)}, 1, "answer 400", nil},
		{"Retry-After beyond max_elapsed: at once", []func() (*http.Response, error){status(503, "Retry-After", "3600"), status(200)}, 1, "answer 503", nil},
		{"a malformed Retry-After: at once", []func() (*http.Response, error){status(429, "Retry-After", "soon"), status(200)}, 1, "answer 429", nil},
		{"connect errors every time", []func() (*http.Response, error){dialFails}, 3, FailUnreachable.Code, []string{"connect", "connect"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rt := &scripted{answers: tc.answers}
			var retries []string
			r := &Retrier{Policy: config.Retry{Attempts: 3, Backoff: time.Millisecond, MaxBackoff: time.Millisecond, MaxElapsed: time.Minute},
				RT: rt, OnRetry: func(op, reason string) {
					if op != "chat" {
						t.Errorf("retry counted under op %q", op)
					}
					retries = append(retries, reason)
				},
				Sleep: func(context.Context, time.Duration) error { return nil }}
			body := []byte(`{"model":"m"}`)
			resp, err := r.Send(context.Background(), Attempt{Op: "chat", URL: "http://upstream.invalid/v1/chat/completions",
				Header: http.Header{}, Body: func() io.ReadCloser { return io.NopCloser(bytes.NewReader(body)) }, Length: int64(len(body))})
			var (
				got string
				ua  *Answer
				ue  *Error
			)
			switch {
			case err == nil:
				got = "ok"
				resp.Body.Close()
			case errors.As(err, &ua):
				got = "answer " + strconv.Itoa(ua.Status)
			case errors.As(err, &ue):
				got = ue.Failure.Code
			default:
				got = err.Error()
			}
			if got != tc.want {
				t.Errorf("got %s, want %s", got, tc.want)
			}
			if len(rt.bodies) != tc.tries {
				t.Errorf("%d tries, want %d", len(rt.bodies), tc.tries)
			}
			for i, b := range rt.bodies {
				if b != string(body) {
					t.Errorf("try %d sent %q, want the whole body", i+1, b)
				}
			}
			if strings.Join(retries, ",") != strings.Join(tc.retries, ",") {
				t.Errorf("retries counted %v, want %v", retries, tc.retries)
			}
		})
	}
}
