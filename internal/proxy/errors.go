package proxy

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"syscall"
)

// apiError is OpenAI's error envelope body.
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// writeError answers status with OpenAI's JSON error envelope. param and code
// may be "" (encoded as null, as OpenAI does).
func writeError(w http.ResponseWriter, status int, typ, code, param, msg string) {
	e := apiError{Message: msg, Type: typ}
	if param != "" {
		e.Param = &param
	}
	if code != "" {
		e.Code = &code
	}
	body, _ := json.Marshal(struct {
		Error apiError `json:"error"`
	}{e})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Del("Content-Length")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

func writeInvalid(w http.ResponseWriter, param, msg string) {
	writeError(w, http.StatusBadRequest, "invalid_request_error", "", param, msg)
}

// upstreamFailure is what the proxy says about an upstream request that got
// no usable answer: a fixed text per class, never the Go error string (it
// quotes URLs with their userinfo and query, and internal addresses).
// CRAFT habit 17.
type upstreamFailure struct {
	status int    // what the client gets
	code   string // OpenAI envelope code, also the log's error_class
	text   string // fixed text for the client body, /readyz and logs
}

var (
	failUnreachable = upstreamFailure{http.StatusBadGateway, "upstream_unreachable", "upstream unreachable"}
	failTLS         = upstreamFailure{http.StatusBadGateway, "upstream_tls_error", "upstream TLS error"}
	failTimeout     = upstreamFailure{http.StatusGatewayTimeout, "upstream_timeout", "upstream timed out"}
	failClosed      = upstreamFailure{http.StatusBadGateway, "upstream_connection_closed", "upstream closed the connection"}
	failOther       = upstreamFailure{http.StatusBadGateway, "upstream_error", "upstream request failed"}
)

// classifyUpstream sorts a transport error into its class by wrapper type
// and sentinel, never by string matching.
func classifyUpstream(err error) upstreamFailure {
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
		return failUnreachable
	case errors.As(err, &rh), errors.As(err, &cve), errors.As(err, &ae),
		errors.As(err, &ua), errors.As(err, &he), errors.As(err, &ci):
		return failTLS
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &nerr) && nerr.Timeout():
		return failTimeout
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.ECONNABORTED), errors.Is(err, syscall.EPIPE):
		return failClosed
	}
	return failOther
}

// writeUpstreamFailure answers the client for an upstream failure class.
func writeUpstreamFailure(w http.ResponseWriter, f upstreamFailure) {
	writeError(w, f.status, "upstream_error", f.code, "", "compactproxy: "+f.text)
}

// logURL is how an upstream URL appears in logs: scheme, host and path
// only (no userinfo, no query string, no fragment).
func logURL(u *url.URL) string {
	if u == nil {
		return ""
	}
	return (&url.URL{Scheme: u.Scheme, Host: u.Host, Path: u.Path}).String()
}
