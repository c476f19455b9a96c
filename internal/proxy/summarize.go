package proxy

import (
	"net/http"
	"strings"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/identity"
	"github.com/compactproxy/compactproxy/internal/summarizer"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"github.com/compactproxy/compactproxy/internal/wire"
)

func (s *Server) compactionConfig() compaction.Config {
	c := s.cfg.Compaction
	return compaction.Config{
		TriggerRatio:         c.TriggerRatio,
		TargetRatio:          c.TargetRatio,
		ReserveTokens:        c.ReserveTokens,
		KeepTail:             c.KeepTail,
		LatchGrowth:          c.LatchGrowth,
		TrimToolResultTokens: c.Trim.ToolResultTokens,
		MinInterval:          c.MinInterval,
		SummarizerEnabled:    c.Summarizer.Enabled,
		Shadow:               c.Mode == "shadow",
		SummaryTokens:        c.Summarizer.MaxTokens,
		SummaryMinTokens:     c.SummaryMinTokens,
		TailRatio:            c.TailRatio,
		Dedupe:               c.Dedupe,
		Mask:                 c.Mask,
	}
}

// summaryInUpstreamTokens tells whether summaries for model are made by
// the upstream's own model (the summarizer is the chat upstream, with no
// other model configured): a summarize call's limit then bounds the
// summary in the tokens the window counts.
func (s *Server) summaryInUpstreamTokens(model string) bool {
	sumModel := s.cfg.Compaction.Summarizer.Model
	return s.summarizerIsUpstream && (sumModel == "" || sumModel == model)
}

// newSummarizer builds the HTTP summarizer with the same retry policy as
// chat, counted under op="summarize"; nil when the summarizer is off.
// Calls are bounded process-wide by compaction.summarizer.max_concurrent
// (the driver).
func (s *Server) newSummarizer() *summarizer.Client {
	c := s.cfg.Compaction.Summarizer
	if !c.Enabled {
		return nil
	}
	url := c.URL
	if url == "" {
		url = s.cfg.Upstream.URL
	}
	s.summarizerIsUpstream = strings.TrimRight(url, "/") == strings.TrimRight(s.cfg.Upstream.URL, "/")
	key := c.APIKey.Reveal()
	if key == "" && s.summarizerIsUpstream {
		key = s.cfg.Upstream.APIKey.Reveal()
	}
	// DESIGN: max_completion_tokens for dialect openai, max_tokens
	// otherwise; the summarizer has no dialect key of its own.
	// An overflow answer is read in the upstream's dialect when the
	// summarizer is the upstream, else in any dialect compactproxy knows.
	overflow := "auto"
	if s.summarizerIsUpstream && s.cfg.Upstream.Dialect != "" {
		overflow = s.cfg.Upstream.Dialect
	}
	return summarizer.New(s.up.Retrier.Transport("summarize"), summarizer.Options{
		URL:             url,
		APIKey:          key,
		Model:           c.Model,
		MaxTokens:       c.MaxTokens,
		Dialect:         s.cfg.Upstream.Dialect,
		Timeout:         c.Timeout,
		OverflowDialect: overflow,
	})
}

// summaryCall is what a summarize call takes from the chat request it
// serves (everything but the planner's request, which summarize adds): the
// requested model; the summarizer model's window and calibrated token
// counter when it is known like any window (the chat upstream's models, or
// a model the models table names); the client's credentials only when the
// summarizer is the chat upstream itself and the proxy holds no key of its
// own; the prefix-shaped request builder when the summarizer is the chat
// upstream and model; the usage counter. It is built only when a summarize
// is about to start, while the request's body is still valid, and owns
// every byte it keeps (the summarize may outlive the handler, whose body
// buffer is pooled).
func (s *Server) summaryCall(h http.Header, req *chat.Request) summarizer.Call {
	call := summarizer.Call{
		Model: req.Model,
		OnUsage: func(u anchor.Usage) {
			s.metrics.SummarizeInputTokens.WithLabelValues("uncached").Add(float64(u.Uncached))
			s.metrics.SummarizeInputTokens.WithLabelValues("cache_read").Add(float64(u.CacheRead))
			s.metrics.SummarizeInputTokens.WithLabelValues("cache_write").Add(float64(u.CacheWrite))
		},
	}
	sumModel := s.cfg.Compaction.Summarizer.Model
	if sumModel == "" {
		sumModel = req.Model
	}
	if s.summarizerIsUpstream {
		// The window the client would get for that model (its tenant's
		// learned window included).
		call.Window = s.windows.GetFor(upstream.Scope{Tenant: identity.Tenant(s.tenantSecret, h), Model: sumModel, Shape: upstream.WindowShape(h)})
		fit := s.calibration.Fit(s.ids.ModelIdentity(sumModel))
		call.Count = func(text string) int { return anchor.TextTokens(fit, len(text)) }
	} else {
		call.Window = s.windows.Listed(sumModel)
	}
	if s.summarizerIsUpstream && s.cfg.Compaction.Summarizer.APIKey == "" && s.cfg.Upstream.APIKey == "" {
		call.Credentials = http.Header{}
		for _, k := range []string{"Authorization", "X-Api-Key", "Api-Key"} {
			if v := h.Get(k); v != "" {
				call.Credentials.Set(k, v)
			}
		}
	}
	if d := req.Dialect(); d != chat.DialectChat && s.summarizerIsUpstream {
		// The upstream speaks the client's dialect (it may speak no other:
		// Anthropic): the summarize call does too.
		call.Dialect = d.String()
		for _, k := range []string{"Anthropic-Version", "Anthropic-Beta"} {
			if v := h.Values(k); len(v) > 0 {
				if call.Headers == nil {
					call.Headers = http.Header{}
				}
				call.Headers[k] = append([]string(nil), v...)
			}
		}
	}
	if s.summaryInUpstreamTokens(req.Model) {
		call.Build = wire.SummaryBuilder(req, s.cfg.Upstream.Dialect)
	}
	return call
}
