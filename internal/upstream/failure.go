package upstream

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"syscall"
)

// Failure is what the proxy says about an upstream request that got no
// usable answer: a fixed text per class, never the Go error string (it
// quotes URLs with their userinfo and query, and internal addresses).
// CRAFT habit 17.
type Failure struct {
	Status int    // what the client gets
	Code   string // the error envelope's code, also the log's error_class
	Text   string // fixed text for the client body, /readyz and logs
}

// The failure classes.
var (
	FailUnreachable = Failure{http.StatusBadGateway, "upstream_unreachable", "upstream unreachable"}
	FailTLS         = Failure{http.StatusBadGateway, "upstream_tls_error", "upstream TLS error"}
	FailTimeout     = Failure{http.StatusGatewayTimeout, "upstream_timeout", "upstream timed out"}
	FailClosed      = Failure{http.StatusBadGateway, "upstream_connection_closed", "upstream closed the connection"}
	FailOther       = Failure{http.StatusBadGateway, "upstream_error", "upstream request failed"}
)

// Classify sorts a transport error into its class by wrapper type and
// sentinel, never by string matching.
func Classify(err error) Failure {
	var (
		de   DialError
		rh   tls.RecordHeaderError
		cve  *tls.CertificateVerificationError
		ae   tls.AlertError
		ua   x509.UnknownAuthorityError
		he   x509.HostnameError
		ci   x509.CertificateInvalidError
		nerr net.Error
	)
	switch {
	case errors.As(err, &de):
		return FailUnreachable
	case errors.As(err, &rh), errors.As(err, &cve), errors.As(err, &ae),
		errors.As(err, &ua), errors.As(err, &he), errors.As(err, &ci):
		return FailTLS
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &nerr) && nerr.Timeout():
		return FailTimeout
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.ECONNABORTED), errors.Is(err, syscall.EPIPE):
		return FailClosed
	}
	return FailOther
}

// Error is a send that got no usable answer: the class the client and the
// logs see, and the transport's error for errors.Is.
type Error struct {
	Failure Failure
	Err     error
}

// Error is the class's fixed text, never the transport's error string.
func (e *Error) Error() string { return e.Failure.Text }

// Unwrap returns the transport's error.
func (e *Error) Unwrap() error { return e.Err }

// Answer is the upstream's own error answer (status ≥ 400), read whole up
// to MaxErrorBody, relayed to the client as it came unless a recovery
// resends the request.
type Answer struct {
	Status int
	Header http.Header
	Body   []byte
	// Failure is the error envelope of a stream that failed before its
	// answer began (a Responses response.failed inside a 200): what
	// overflow recovery reads instead of Body.
	Failure []byte
}

// Error names the status only (the body may quote the request).
func (e *Answer) Error() string { return "upstream answered " + http.StatusText(e.Status) }

// Overflow is the status and body an overflow recognizer reads: the error
// envelope of a stream that failed early as a 400, else the answer.
func (e *Answer) Overflow() (int, []byte) {
	if e.Failure != nil {
		return http.StatusBadRequest, e.Failure
	}
	return e.Status, e.Body
}
