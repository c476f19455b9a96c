package proxy

import (
	"context"
	"errors"
	"strconv"
	"sync"

	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/summarizer"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"go.uber.org/zap"
)

// countCompaction turns the planner's events into metrics and one log line:
// the conversation, the action, the cut and the estimated sizes before
// (context_tokens) and after (forwarded_tokens), never content.
func (s *Server) countCompaction(reqID, conversation string, out compaction.Output) {
	ev := out.Events
	for _, a := range ev.NewActions {
		s.metrics.Compactions.WithLabelValues(string(a)).Inc()
	}
	if ev.SummarizeCalled {
		if ev.SummarizeOK {
			s.metrics.Summarize.WithLabelValues("success").Inc()
		} else {
			s.metrics.Summarize.WithLabelValues("failure").Inc()
		}
	}
	if ev.Suppressed != "" {
		s.metrics.SummarizeSuppressed.WithLabelValues(ev.Suppressed).Inc()
	}
	if ev.LatchEngaged {
		s.metrics.LatchEngaged.Inc()
	}
	if ev.InvariantFailure {
		s.metrics.InvariantFailures.Inc()
	}
	if len(ev.NewActions) > 0 || ev.SummarizeCalled || ev.InvariantFailure {
		fields := []zap.Field{zap.String("request_id", reqID), zap.String("conversation", conversation),
			zap.String("action", string(out.Action)), zap.Int("cut", stateCut(out.State)), zap.Int("trims", excerpts(out.State.Trims)),
			zap.Int("context_tokens", out.Context.Tokens), zap.Int("forwarded_tokens", out.Forwarded),
			zap.Int("budget", out.Budget)}
		if len(ev.NewActions) > 0 {
			acts := make([]string, len(ev.NewActions))
			for i, a := range ev.NewActions {
				acts[i] = string(a)
			}
			fields = append(fields, zap.Strings("new_actions", acts))
		}
		if ev.SummaryError != nil {
			fields = append(fields, zap.String("summarize_error", summarizeErrorKind(ev.SummaryError)))
		}
		fields = append(fields, zap.Object("reduced_tokens", reduction(out.Reduced)), zap.Bool("cache_reset", out.CacheReset))
		if out.CacheReset {
			fields = append(fields, zap.Int("reset_tokens", out.ResetTokens))
		}
		s.log.Info("compaction", fields...)
	}
}

// summarizeErrorKind names why a summarize failed without quoting the
// summarizer's answer: an error body may echo conversation content, and
// logs never carry content.
func summarizeErrorKind(err error) string {
	var se *summarizer.StatusError
	var de upstream.DialError
	switch {
	case errors.As(err, &se):
		return "status " + strconv.Itoa(se.StatusCode)
	case errors.As(err, &de):
		return "connect"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, summarizer.ErrEmptySummary), errors.Is(err, compaction.ErrEmptySummary):
		return "empty summary"
	case errors.Is(err, compaction.ErrSummaryNotSmaller):
		return "summary not smaller"
	case errors.Is(err, summarizer.ErrBadResponse):
		return "bad response"
	case errors.Is(err, summarizer.ErrNoModel):
		return "no model"
	case errors.Is(err, summarizer.ErrWindowTooSmall):
		return "window too small"
	}
	return "error"
}

// onceSet remembers keys so that a warning is logged once per key (a
// conversation); bounded, it forgets everything when full.
type onceSet struct {
	mu sync.Mutex
	m  map[string]struct{}
}

// once reports whether key was not seen before.
func (o *onceSet) once(key string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, ok := o.m[key]; ok {
		return false
	}
	if o.m == nil || len(o.m) >= 4096 {
		o.m = map[string]struct{}{}
	}
	o.m[key] = struct{}{}
	return true
}
