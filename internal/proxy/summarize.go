package proxy

import (
	"context"
	"math"
	"net/http"
	"strconv"
	"strings"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/summarizer"
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
	}
}

// boundedSummarizer caps concurrent summarize calls in the whole process.
type boundedSummarizer struct {
	sum compaction.Summarizer
	sem chan struct{}
}

func (b boundedSummarizer) Summarize(ctx context.Context, req compaction.SummaryRequest) (string, error) {
	select {
	case b.sem <- struct{}{}:
	case <-ctx.Done():
		return "", ctx.Err()
	}
	defer func() { <-b.sem }()
	return b.sum.Summarize(ctx, req)
}

// newSummarizer builds the HTTP summarizer with the same retry policy as
// chat, counted under op="summarize", bounded process-wide by
// compaction.summarizer.max_concurrent.
func (s *Server) newSummarizer() compaction.Summarizer {
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
	dialect := s.cfg.Upstream.Dialect
	sum := summarizer.New(retryTransport{r: s.retrier, op: "summarize"}, summarizer.Options{
		URL:       url,
		APIKey:    key,
		Model:     c.Model,
		MaxTokens: c.MaxTokens,
		Dialect:   dialect,
		Timeout:   c.Timeout,
	})
	s.sumSem = make(chan struct{}, max(c.MaxConcurrent, 1))
	return boundedSummarizer{sum: sum, sem: s.sumSem}
}

// summarizeContext carries what the summarizer may use of this request: the
// requested model, the summarizer model's window and calibrated token
// counter (when it is known like any window: the chat upstream's models,
// or a model the models table names), and the client's credentials only
// when the summarizer is the chat upstream itself and the proxy holds no
// key of its own.
func (s *Server) summarizeContext(ctx context.Context, r *http.Request, model string) context.Context {
	ctx = summarizer.WithModel(ctx, model)
	sumModel := s.cfg.Compaction.Summarizer.Model
	if sumModel == "" {
		sumModel = model
	}
	if s.summarizerIsUpstream {
		if w := s.windows.get(sumModel); w > 0 {
			ctx = summarizer.WithWindow(ctx, w)
		}
		fit := s.calibration.Fit(s.modelIdentity(sumModel))
		ctx = summarizer.WithCounter(ctx, func(text string) int {
			return textTokens(fit, len(text))
		})
	} else if w := s.windows.table[sumModel]; w > 0 {
		ctx = summarizer.WithWindow(ctx, w)
	}
	if s.summarizerIsUpstream && s.cfg.Compaction.Summarizer.APIKey == "" && s.cfg.Upstream.APIKey == "" {
		h := http.Header{}
		for _, k := range []string{"Authorization", "X-Api-Key", "Api-Key"} {
			if v := r.Header.Get(k); v != "" {
				h.Set(k, v)
			}
		}
		ctx = summarizer.WithCredentials(ctx, h)
	}
	return ctx
}

// textTokens is the calibrated estimate of n bytes of text sent as one
// message: the local estimator's count of such a message, scaled by the
// model's ratio (the request's fixed overhead is the summarizer's own
// allowance).
func textTokens(fit anchor.Fit, n int) int {
	local := anchor.MessageOverheadTokens + (n+3)/4
	r := fit.Ratio
	if !(r > 0) {
		r = 1
	}
	r = min(max(r, anchor.MinRatio), anchor.MaxRatio)
	return int(math.Ceil(float64(local) * r))
}

// withSummarizeRequest adds to ctx what a summarize call may take from the
// client's request when the summarizer is the chat upstream and model: a
// Builder that writes the summarize request as a continuation of this very
// request (same model, tools and other top-level fields as the client sent
// them, so the forwarded prefix and the upstream's prompt cache are
// shared), with tool_choice "none", no streaming, no output options that
// would shape the summary, and the summary's own token limit. It also
// counts every summarize answer's reported usage.
func (s *Server) withSummarizeRequest(ctx context.Context, req *chat.Request) context.Context {
	ctx = summarizer.WithUsageHook(ctx, func(u anchor.Usage) {
		s.metrics.SummarizeInputTokens.WithLabelValues("uncached").Add(float64(u.Uncached))
		s.metrics.SummarizeInputTokens.WithLabelValues("cache_read").Add(float64(u.CacheRead))
		s.metrics.SummarizeInputTokens.WithLabelValues("cache_write").Add(float64(u.CacheWrite))
	})
	sumModel := s.cfg.Compaction.Summarizer.Model
	if !s.summarizerIsUpstream || (sumModel != "" && sumModel != req.Model) {
		return ctx
	}
	hasTools := false
	for _, f := range req.Fields {
		hasTools = hasTools || f.Key == "tools"
	}
	return summarizer.WithBuilder(ctx, func(msgs []chat.Message, maxTokens int) []byte {
		limit := []byte(strconv.Itoa(maxTokens))
		maxKey, otherKey := "max_tokens", "max_completion_tokens"
		if s.cfg.Upstream.Dialect == "openai" {
			maxKey, otherKey = otherKey, maxKey
		}
		set := []chat.Field{
			{Key: "stream", Value: []byte("false")},
			{Key: maxKey, Value: limit},
			{Key: otherKey}, {Key: "stream_options"}, {Key: "n"}, {Key: "response_format"},
			{Key: "stop"}, {Key: "logprobs"}, {Key: "top_logprobs"}, {Key: "prediction"},
			{Key: "parallel_tool_calls"}, {Key: "tool_choice"},
		}
		if hasTools {
			set[len(set)-1].Value = []byte(`"none"`)
		}
		return req.Build(msgs, set)
	})
}
