package driver

import (
	"context"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"testing"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/anchor/anchortest"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// benchConversation is a ≈1 MiB agent conversation: 100 steps with 10 KiB
// results.
func benchConversation(b *testing.B) ([]chat.Message, []anchor.Digest) {
	msgs := parse(b, agentSteps(100, 10*1024))
	size := 0
	for i := range msgs {
		size += len(msgs[i].Raw)
	}
	if size < 1<<20 {
		b.Fatalf("conversation is %d bytes", size)
	}
	// The proxy has hashed the client's messages before compaction.
	chain, _, err := anchortest.ViewChain(testSeed, msgs, nil)
	if err != nil {
		b.Fatal(err)
	}
	return msgs, chain
}

// anchorEstimate is the proxy's estimator closure without anchors: the
// view's chain (client messages already hashed) and the local estimate.
func anchorEstimate(view []chat.Message) anchor.Estimate {
	chain, local, err := anchortest.ViewChain(testSeed, view, nil)
	if err != nil {
		panic(err)
	}
	return anchor.EstimateView(chain, local, nil, anchor.Fit{})
}

var benchEstimators = []struct {
	name string
	est  compaction.Estimator
}{{"fake", fakeEstimate}, {"anchor", anchorEstimate}}

// BenchmarkCompactTrimPath: a 1 MiB conversation over the trigger that
// trim alone brings below the target, from an empty state (the first
// request over the trigger: every decision is made).
func BenchmarkCompactTrimPath(b *testing.B) {
	msgs, chain := benchConversation(b)
	for _, be := range benchEstimators {
		b.Run(be.name, func(b *testing.B) {
			e := newDriver(baseConfig(), okSummarizer(), newClock())
			// budget 300k tokens (trigger 240k, target 180k); the view is ≈ 262k (fake).
			in := compaction.Input{Messages: msgs, Chain: chain, Window: 300000, Estimate: be.est}
			out := e.Compact(context.Background(), in)
			if out.Action != compaction.ActionTrimmed || out.Forwarded >= out.Target {
				b.Fatalf("action %q forwarded %d target %d context %d", out.Action, out.Forwarded, out.Target, out.Context.Tokens)
			}
			b.ReportAllocs()
			b.SetBytes(1 << 20)
			b.ResetTimer()
			for b.Loop() {
				e.Compact(context.Background(), in)
			}
		})
	}
}

// BenchmarkCompactReapplied: the next request of the same conversation:
// the stored trims are re-applied, the view is below the trigger.
func BenchmarkCompactReapplied(b *testing.B) {
	msgs, chain := benchConversation(b)
	for _, be := range benchEstimators {
		b.Run(be.name, func(b *testing.B) {
			e := newDriver(baseConfig(), okSummarizer(), newClock())
			in := compaction.Input{Messages: msgs, Chain: chain, Window: 300000, Estimate: be.est}
			in.State = e.Compact(context.Background(), in).State
			if out := e.Compact(context.Background(), in); out.Action != compaction.ActionTrimmed || len(out.Events.NewActions) != 0 {
				b.Fatalf("action %q new %v", out.Action, out.Events.NewActions)
			}
			b.ReportAllocs()
			b.SetBytes(1 << 20)
			b.ResetTimer()
			for b.Loop() {
				e.Compact(context.Background(), in)
			}
		})
	}
}

// BenchmarkCompactBelowTrigger: the same conversation with a window large
// enough that nothing is done (the common path).
func BenchmarkCompactBelowTrigger(b *testing.B) {
	msgs, chain := benchConversation(b)
	for _, be := range benchEstimators {
		b.Run(be.name, func(b *testing.B) {
			e := newDriver(baseConfig(), okSummarizer(), newClock())
			in := compaction.Input{Messages: msgs, Chain: chain, Window: 2000000, Estimate: be.est}
			if out := e.Compact(context.Background(), in); out.Action != compaction.ActionNone {
				b.Fatalf("action %q", out.Action)
			}
			b.ReportAllocs()
			b.SetBytes(1 << 20)
			b.ResetTimer()
			for b.Loop() {
				e.Compact(context.Background(), in)
			}
		})
	}
}

// BenchmarkCompactMaskPath: the trim path's conversation with step 0 on:
// the first request over the trigger (every call decoded, every result
// digested, masks chosen), then the next one re-applying the masks.
func BenchmarkCompactMaskPath(b *testing.B) {
	msgs, chain := benchConversation(b)
	cfg := baseConfig()
	cfg.Dedupe, cfg.Mask = true, true
	e := newDriver(cfg, okSummarizer(), newClock())
	in := compaction.Input{Messages: msgs, Chain: chain, Window: 300000, Estimate: fakeEstimate}
	first := e.Compact(context.Background(), in)
	if first.Action != compaction.ActionMasked || first.Forwarded >= first.Target {
		b.Fatalf("action %q forwarded %d target %d", first.Action, first.Forwarded, first.Target)
	}
	b.Run("decide", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(1 << 20)
		for b.Loop() {
			e.Compact(context.Background(), in)
		}
	})
	again := in
	again.State = first.State
	b.Run("reapplied", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(1 << 20)
		for b.Loop() {
			e.Compact(context.Background(), again)
		}
	})
}
