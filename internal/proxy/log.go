package proxy

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/compactproxy/compactproxy/internal/metrics"
	"go.uber.org/zap"
)

// statusWriter records the status and bytes written. It keeps Flush and
// Unwrap so streaming survives the wrapping (promhttp's habit).
type statusWriter struct {
	http.ResponseWriter
	status int
	bytes  int64
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	n, err := w.ResponseWriter.Write(p)
	w.bytes += int64(n)
	return n, err
}

func (w *statusWriter) Flush() {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// reqInfo collects what the access log reports about one request; handlers
// fill it through the request's context.
type reqInfo struct {
	id       string
	route    string
	status   int // overrides the written status (499 for a client that left)
	upstream time.Duration
	api      *apiInfo // set on the compacted routes
	// aborted: the response was broken off (http.ErrAbortHandler) after the
	// upstream broke off its stream; the status written is not the end.
	aborted bool
	// bodyTimedOut: a pass-through request body did not arrive within
	// limits.body_read_timeout (set by the body's reader, which the
	// transport runs on its own goroutine).
	bodyTimedOut atomic.Bool
}

// apiInfo is the access log's part for a compacted route (chat,
// responses, messages). Never content.
type apiInfo struct {
	model           string
	stream          bool
	messages        int
	action          string
	contextTokens   int
	contextSource   string
	forwardedTokens int
	conversation    string
	pairing         string
}

type ctxKey struct{}

func infoFrom(ctx context.Context) *reqInfo {
	if ri, ok := ctx.Value(ctxKey{}).(*reqInfo); ok {
		return ri
	}
	return &reqInfo{}
}

func newRequestID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// validRequestID accepts a client's X-Request-Id only when it is short and
// printable, so it cannot inject into logs or headers.
func validRequestID(s string) bool {
	if s == "" || len(s) > 128 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x21 || c > 0x7e {
			return false
		}
	}
	return true
}

// observe wraps a route: request id, access log, http_requests_total.
func observe(route string, log *zap.Logger, m *metrics.Metrics, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		id := r.Header.Get("X-Request-Id")
		if !validRequestID(id) {
			id = newRequestID()
		}
		w.Header().Set("X-Request-Id", id)
		ri := &reqInfo{id: id, route: route}
		sw := &statusWriter{ResponseWriter: w}
		// A handler that aborts (http.ErrAbortHandler: a broken upstream
		// stream, chat or pass-through) is still logged and counted; the
		// panic then goes on to net/http, which drops the connection.
		defer func() {
			v := recover()
			if v == nil {
				return
			}
			if v == http.ErrAbortHandler && r.Context().Err() == nil {
				if !ri.aborted && route == "passthrough" {
					m.StreamAborts.Inc()
				}
				ri.aborted = true
			}
			logRequest(log, m, route, r, sw, ri, start)
			panic(v)
		}()
		next.ServeHTTP(sw, r.WithContext(context.WithValue(r.Context(), ctxKey{}, ri)))
		logRequest(log, m, route, r, sw, ri, start)
	})
}

// logRequest writes the access log line and counts http_requests_total.
func logRequest(log *zap.Logger, m *metrics.Metrics, route string, r *http.Request, sw *statusWriter, ri *reqInfo, start time.Time) {
	id := ri.id
	status := sw.status
	if status == 0 {
		status = http.StatusOK
	}
	if ri.status != 0 {
		status = ri.status
	} else if r.Context().Err() != nil && status < 400 && route != "health" {
		status = 499
	}
	m.HTTPRequests.WithLabelValues(route, metrics.Code(status)).Inc()
	if route == "health" || route == "metrics" {
		if ce := log.Check(zap.DebugLevel, "request"); ce != nil {
			ce.Write(zap.String("request_id", id), zap.String("route", route), zap.Int("status", status))
		}
		return
	}
	fields := []zap.Field{
		zap.String("request_id", id),
		zap.String("route", route),
		zap.String("method", r.Method),
		zap.String("path", r.URL.Path),
		zap.Int("status", status),
		zap.Int64("bytes", sw.bytes),
		zap.Duration("duration", time.Since(start)),
	}
	if ri.aborted {
		fields = append(fields, zap.Bool("aborted", true))
	}
	if ri.upstream > 0 {
		fields = append(fields, zap.Duration("upstream_duration", ri.upstream))
	}
	if c := ri.api; c != nil {
		fields = append(fields,
			zap.String("model", c.model),
			zap.Bool("stream", c.stream),
			zap.Int("messages", c.messages),
			zap.String("compaction", c.action),
			zap.Int("context_tokens", c.contextTokens),
			zap.String("context_source", c.contextSource),
			zap.Int("forwarded_tokens", c.forwardedTokens),
		)
		if c.conversation != "" {
			fields = append(fields, zap.String("conversation_id", c.conversation))
		}
		if c.pairing != "" {
			fields = append(fields, zap.String("pairing", c.pairing))
		}
	}
	log.Info("request", fields...)
}
