package proxy

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"syscall"
	"time"

	"github.com/compactproxy/compactproxy/internal/bufpool"
)

// errBodyTooLarge is returned by readBody when limits.max_body_bytes is hit.
var errBodyTooLarge = errors.New("proxy: request body too large")

const (
	// maxUpfront is the most a declared Content-Length reserves before its
	// bytes arrive: a Content-Length is a claim, not memory to reserve
	// (eight connections that sent headers and one byte reserved 257 MiB;
	// CRAFT habit 20).
	maxUpfront = 1 << 20
	// firstRead is the buffer a body of unknown length starts with.
	firstRead = 64 << 10
)

// readBody reads the whole body under limit into a pooled buffer that grows
// with the bytes received (doubling, by pool size class, so a megabyte body
// costs a few copies at most). A declared Content-Length over the limit is
// refused before a byte is read. The caller releases the returned buffer.
func readBody(r *http.Request, limit int64) (*bufpool.Body, error) {
	declared := r.ContentLength
	if limit > 0 && declared > limit {
		return nil, errBodyTooLarge
	}
	size := firstRead
	if declared > 0 {
		size = int(min(declared, maxUpfront))
	}
	pb := bufpool.Get(size)
	n := 0
	for {
		if n == len(pb.Buf) {
			if declared > 0 && int64(n) >= declared {
				break // every declared byte arrived (net/http enforces the length)
			}
			if limit > 0 && int64(n) > limit {
				pb.Release()
				return nil, errBodyTooLarge
			}
			next := int64(2 * n)
			if declared > 0 {
				next = min(next, declared)
			}
			if limit > 0 {
				next = min(next, limit+1) // one byte past the limit proves it too large
			}
			pb = pb.Grow(int(next), n)
		}
		m, err := r.Body.Read(pb.Buf[n:])
		n += m
		if err == io.EOF {
			break
		}
		if err != nil {
			pb.Release()
			return nil, err
		}
	}
	if limit > 0 && int64(n) > limit {
		pb.Release()
		return nil, errBodyTooLarge
	}
	pb.Buf = pb.Buf[:n]
	return pb, nil
}

// readBodyWithin is readBody under limits.body_read_timeout: the
// connection's read deadline bounds the upload (a client that trickles its
// body gets 408), and is cleared afterwards so a long generation is not cut.
// Writers without deadlines (tests' recorders) read without one.
func readBodyWithin(w http.ResponseWriter, r *http.Request, limit int64, timeout time.Duration) (*bufpool.Body, error) {
	if timeout > 0 {
		rc := http.NewResponseController(w)
		if rc.SetReadDeadline(time.Now().Add(timeout)) == nil {
			defer func() { _ = rc.SetReadDeadline(time.Time{}) }()
		}
	}
	return readBody(r, limit)
}

// answerBodyError answers a body that could not be read: 413 over the
// limit, 408 too slow, 499 (nothing written) for a client that went away,
// and 400 for a body that is broken on its own (malformed chunked encoding),
// each in OpenAI's envelope.
func (s *Server) answerBodyError(w http.ResponseWriter, r *http.Request, err error) {
	// Whatever is left of the body must not be read (net/http would try to
	// drain it before answering, without a deadline) nor parsed as the
	// next request: this answer closes the connection.
	w.Header().Set("Connection", "close")
	writeError := func(w http.ResponseWriter, status int, typ, code, param, msg string) {
		writeErrorIn(apiOf(r), w, status, typ, code, param, msg)
	}
	switch {
	case errors.Is(err, errBodyTooLarge):
		writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large", "",
			fmt.Sprintf("request body exceeds the proxy's limit of %d bytes (limits.max_body_bytes)", s.cfg.Limits.MaxBodyBytes))
	case errors.Is(err, os.ErrDeadlineExceeded):
		writeError(w, http.StatusRequestTimeout, "invalid_request_error", "request_timeout", "",
			fmt.Sprintf("compactproxy: the request body was not received within %s (limits.body_read_timeout)", s.cfg.Limits.BodyReadTimeout))
	case r.Context().Err() != nil, errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE), errors.Is(err, net.ErrClosed):
		// The connection ended mid-upload: nobody is left to answer.
		infoFrom(r.Context()).status = 499
	default:
		writeError(w, http.StatusBadRequest, "invalid_request_error", "invalid_body", "",
			"compactproxy: the request body could not be read (malformed transfer encoding)")
	}
}
