package proxy

import (
	"context"
	"net/http"
	"strings"

	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/summarizer"
)

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
	dialect := s.cfg.Upstream.Dialect
	if c.URL != "" && !s.summarizerIsUpstream {
		dialect = "openai"
	}
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
