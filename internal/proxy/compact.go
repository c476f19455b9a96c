package proxy

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/driver"
	"github.com/compactproxy/compactproxy/internal/metrics"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// identify is the identify stage: the request's conversation (its opaque
// id, tenant-bound state key and the chain memo every view of this request
// shares), whether compaction applies to it, and the parse kept for the
// tenant's next body.
func (s *Server) identify(r *http.Request, cr *chatRequest) *conversation {
	cr.client = cr.forward
	cv := s.openConversation(r, cr)
	cr.info.conversation = cv.id
	cr.respHeaders.Set("X-Compactproxy-Conversation-Id", cv.id)
	bypass := strings.EqualFold(r.Header.Get("X-Compactproxy-Bypass"), "true")
	cr.compact = s.cfg.Compaction.Enabled && !bypass && !cr.opaque
	cr.selfCompaction = selfCompaction(cr.client)
	s.rememberParse(cr, cv)
	return cv
}

// compactChat is the compact stage: the driver's decision for the
// client's view (a summary it asks for is made once per lineage, detached
// from this request, and waited for); forward becomes the decided view.
func (s *Server) compactChat(ctx context.Context, r *http.Request, cr *chatRequest, cv *conversation, pass compaction.Pass) {
	out, spent := s.driver.Decide(ctx, s.driverRequest(r, cr, cv, pass), driver.Mode{Enabled: cr.compact, Summarize: true, Commit: true})
	cr.spent += spent
	cr.decision, cr.decisionSpent = out, spent
	if !sameView(out.Messages, cr.forward) {
		cr.forward = out.Messages
		cr.unchanged = false
	}
}

// driverRequest is what the driver decides on for the client's view of
// cv: the state key, the view's record chain and estimator, the model's
// window, and, for a summary that outlives the request, copies that own
// their bytes (the request's body buffer is pooled and reused once the
// handler returns) and the summarize call.
func (s *Server) driverRequest(r *http.Request, cr *chatRequest, cv *conversation, pass compaction.Pass) driver.Request {
	view, req := cr.client, cr.req
	return driver.Request{
		ID:           cr.reqID,
		Conversation: cv.id,
		Key:          cv.key,
		View:         view,
		Chain: func() ([]anchor.Digest, error) {
			return cv.recordChain(view)
		},
		Estimate: func(anchors []anchor.Anchor) compaction.Estimator {
			return s.estimator(cv.memo, anchors, cv.identity)
		},
		Window:                  s.windows.GetFor(cr.windowScope()),
		MaxTokens:               req.MaxTokens,
		Pass:                    pass,
		SummaryInUpstreamTokens: s.summaryInUpstreamTokens(req.Model),
		SelfCompaction:          cr.selfCompaction,
		Detach: func() driver.Detached {
			memo := &chainMemo{s: s, seed: cv.memo.seed}
			return driver.Detached{
				View: detachMessages(view, req),
				Estimate: func(anchors []anchor.Anchor) compaction.Estimator {
					return s.estimator(memo, anchors, cv.identity)
				},
				Call: s.summaryCall(r.Header, req),
			}
		},
	}
}

// report is the report stage: the decision in response headers, the
// access log and metrics (once per request: a recovery's second decision
// updates the headers only).
func (s *Server) report(cr *chatRequest, cv *conversation, pass compaction.Pass) {
	out, ci := cr.decision, cr.info
	if out.Events.SummarizeCalled {
		s.metrics.ObserveSummarize(out.Events.SummarizeOK, cr.decisionSpent)
	}
	first := pass != compaction.PassRecover
	if out.Events.Impossible && first {
		// The window cannot hold the request: the fixed part alone is over
		// the budget, or what compaction may never remove (the fixed part,
		// the task, the latest instruction, the final turn excerpted) is
		// over the window. Counted per request, logged once per
		// conversation.
		s.metrics.CompactionImpossible.Inc()
		if s.impossible.once(cv.key) {
			msg := "request over the window after every compaction step; forwarding the smallest view"
			if out.Fixed >= out.Budget {
				// No summary has room; stored compaction is re-applied and a
				// view over the window is still brought under it.
				msg = "fixed part over the budget; no room for a summary"
			}
			s.log.Warn(msg, zap.String("request_id", cr.reqID), zap.String("conversation", cv.id),
				zap.Int("fixed_tokens", out.Fixed), zap.Int("forwarded_tokens", out.Forwarded),
				zap.Int("budget", out.Budget), zap.Int("window", s.windows.GetFor(cr.windowScope())))
		}
	}
	action := string(out.Action)
	if action == string(compaction.ActionSummarizePending) && s.cfg.Compaction.Mode != "shadow" {
		// Forwarded without the summary that is due (it is being made
		// elsewhere, or the state is unreadable): say what the view
		// carries instead.
		action = viewAction(cr.client, out.Messages, out.State.Trims)
	}
	if action == "" || s.cfg.Compaction.Mode == "shadow" {
		action = "none"
	}
	ci.action = action
	ci.contextTokens = out.Context.Tokens
	ci.contextSource = out.Context.Source
	ci.forwardedTokens = out.Forwarded
	cr.respHeaders.Set("X-Compactproxy-Compaction", action)
	cr.respHeaders.Set("X-Compactproxy-Context-Tokens", strconv.Itoa(out.Context.Tokens))
	cr.respHeaders.Set("X-Compactproxy-Context-Source", out.Context.Source)
	cr.respHeaders.Set("X-Compactproxy-Forwarded-Tokens", strconv.Itoa(out.Forwarded))
	// Every forwarded decision, an overflow retry's included (not a
	// preview's): what each step removed and whether it reset the cache.
	s.countReduction(out)
	if !first {
		return // the overflow retry: counted once, on the first pass
	}
	if s.windows.GetFor(cr.windowScope()) == 0 {
		s.metrics.UnknownWindow.Inc()
		if s.windows.WarnOnce(cr.req.Model) {
			s.log.Warn("context window unknown for model; not compacting", zap.String("model", cr.req.Model))
		}
	}
	if out.Context.Source == anchor.SourceAnchor {
		s.metrics.AnchorLookups.WithLabelValues("hit").Inc()
	} else {
		s.metrics.AnchorLookups.WithLabelValues("miss").Inc()
	}
	s.metrics.ContextTokens.Observe(float64(out.Context.Tokens))
	s.metrics.ForwardedTokens.Observe(float64(out.Forwarded))
}

// excerpts counts the trims that are excerpts (not step 0's placeholders
// and pointers).
func excerpts(trims []compaction.Trim) int {
	n := 0
	for _, t := range trims {
		if _, pointer := t.PointsTo(); !t.Masked() && !pointer {
			n++
		}
	}
	return n
}

// countReduction adds a forwarded decision's reductions by step to
// reduced_tokens_total and its cache reset to cache_resets_total.
func (s *Server) countReduction(out compaction.Output) {
	r := out.Reduced
	for i, n := range []int{r.Dedupe, r.Mask, r.Trim, r.Summarize, r.Drop} {
		if n > 0 {
			s.metrics.ReducedTokens.WithLabelValues(metrics.ReducedSteps[i]).Add(float64(n))
		}
	}
	if out.CacheReset {
		s.metrics.CacheResets.Inc()
	}
}

// reduction logs what a decision removed by step (the steps that removed
// something), as reduced_tokens_total names them.
type reduction compaction.Reduction

// MarshalLogObject writes the steps that removed something.
func (r reduction) MarshalLogObject(enc zapcore.ObjectEncoder) error {
	for i, n := range []int{r.Dedupe, r.Mask, r.Trim, r.Summarize, r.Drop} {
		if n > 0 {
			enc.AddInt(metrics.ReducedSteps[i], n)
		}
	}
	return nil
}

// recoverOnce is the recovery stage (DESIGN step 5): when err is the
// upstream's context-overflow answer, received before any byte reached
// the client, it records the reported size as a measurement of the view
// that was sent, learns n_ctx, and compacts again (throttle ignored, latch
// honoured). True when the request is to be sent once more: only with a
// view that differs from the refused one (by digest: an equal view would
// be refused again) and is estimated to fit. DESIGN asks for "under the
// new target"; we accept the budget: at a small window the final turn
// alone can leave the view between target and budget, and a view
// estimated (with the overflow's own measurement) to fit is a better
// answer than the upstream's 400.
func (s *Server) recoverOnce(ctx context.Context, r *http.Request, cr *chatRequest, cv *conversation, err error) bool {
	var ua *upstream.Answer
	if !errors.As(err, &ua) {
		return false
	}
	status, body := ua.Overflow()
	info, ok := s.up.LearnOverflow(cr.reqID, cr.windowScope(), status, body)
	if !ok || !cr.compact {
		return false
	}
	if info.Prompt > 0 {
		s.recordAnchor(ctx, cr.reqID, cv, cr.forward, anchor.Usage{Input: info.Prompt, Uncached: info.Prompt, HasInput: true})
	}
	before, _, err := cv.memo.chain(cr.forward)
	if err != nil {
		return false
	}
	refused := before[len(before)-1]
	s.compactChat(ctx, r, cr, cv, compaction.PassRecover)
	s.report(cr, cv, compaction.PassRecover)
	after, _, err := cv.memo.chain(cr.forward)
	if err != nil || after[len(after)-1] == refused {
		return false
	}
	if out := cr.decision; out.Budget <= 0 || out.Forwarded > out.Budget {
		return false
	}
	s.metrics.UpstreamRetries.WithLabelValues(cr.api.Dialect.String(), "context_overflow").Inc()
	return true
}

// record is the record stage, called as the response's usage arrives and
// before its last byte is written: the usage counted, the provider's
// measurement of exactly the messages forwarded stored as an anchor, and a
// background summary when the next request would pass
// compaction.presummarize_ratio.
func (s *Server) record(ctx context.Context, r *http.Request, cr *chatRequest, cv *conversation, u anchor.Usage) {
	if !u.HasInput || cr.opaque {
		return
	}
	// A prompt the upstream accepted: no learned window goes below it.
	s.up.Accept(cr.windowScope(), u.Input)
	s.metrics.UsageInputTokens.WithLabelValues("uncached").Add(float64(u.Uncached))
	s.metrics.UsageInputTokens.WithLabelValues("cache_read").Add(float64(u.CacheRead))
	s.metrics.UsageInputTokens.WithLabelValues("cache_write").Add(float64(u.CacheWrite))
	s.recordAnchor(context.WithoutCancel(ctx), cr.reqID, cv, cr.forward, u)
	if cr.compact {
		s.driver.Background(ctx, s.driverRequest(r, cr, cv, compaction.PassBackground), cr.decision, u)
	}
}
