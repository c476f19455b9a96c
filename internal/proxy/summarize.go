package proxy

import (
	"context"

	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
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
