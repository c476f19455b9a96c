package proxy

import (
	"context"
	"net/http"

	"github.com/compactproxy/compactproxy/internal/compaction"
)

func (s *Server) newSummarizer() compaction.Summarizer { return nil }

func (s *Server) summarizeContext(ctx context.Context, r *http.Request, model string) context.Context {
	return ctx
}
