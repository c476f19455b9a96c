package proxy

import (
	"context"
	"net/http"
	"strings"

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
	}
}

// boundedSummarizer caps concurrent summarize calls in the whole process.
type boundedSummarizer struct {
	sum compaction.Summarizer
	sem chan struct{}
}

func (b boundedSummarizer) Summarize(ctx context.Context, head []chat.Message, previous string) (string, error) {
	select {
	case b.sem <- struct{}{}:
	case <-ctx.Done():
		return "", ctx.Err()
	}
	defer func() { <-b.sem }()
	return b.sum.Summarize(ctx, head, previous)
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
	client := &http.Client{Transport: retryTransport{r: s.retrier, op: "summarize"}}
	sum := summarizer.New(client, summarizer.Options{
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
// requested model, and the client's credentials only when the summarizer is
// the chat upstream itself and the proxy holds no key of its own.
func (s *Server) summarizeContext(ctx context.Context, r *http.Request, model string) context.Context {
	ctx = summarizer.WithModel(ctx, model)
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
