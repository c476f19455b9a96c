package proxy

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/driver"
	"github.com/compactproxy/compactproxy/internal/identity"
	"github.com/compactproxy/compactproxy/internal/metrics"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// identify is the identify stage: the request's conversation (its opaque
// id, tenant-bound state key and the chain memo every view of this request
// shares) for the checked view, whether compaction applies to it, and the
// parse kept for the tenant's next body.
func (s *Server) identify(r *http.Request, ar *apiRequest, view checked) *identified {
	conversation, err := s.ids.Open(identity.Header(r.Header, s.cfg.Compaction.ConversationHeaders), ar.req, ar.parse, view.msgs)
	if err != nil {
		s.log.Warn("message digest failed", zap.String("request_id", ar.reqID), zap.Error(err))
	}
	ar.info.conversation = conversation.ID
	ar.respHeaders.Set("X-Compactproxy-Conversation-Id", conversation.ID)
	bypass := strings.EqualFold(r.Header.Get("X-Compactproxy-Bypass"), "true")
	s.ids.Remember(conversation, ar.req, ar.parse, view.clean, view.msgs)
	return &identified{
		Conversation:   conversation,
		view:           view,
		compacting:     s.cfg.Compaction.Enabled && !bypass && !ar.opaque,
		selfCompaction: selfCompaction(view.msgs),
	}
}

// compact is the compact stage: the driver's decision for the client's
// view (a summary it asks for is made once per lineage, detached from
// this request, and waited for).
func (s *Server) compact(ctx context.Context, r *http.Request, ar *apiRequest, ident *identified, pass compaction.Pass) decision {
	out, spent := s.driver.Decide(ctx, s.driverRequest(r, ar, ident, pass), driver.Mode{Enabled: ident.compacting, Summarize: true, Commit: true})
	dec := decision{out: out, forward: ident.view.msgs, unchanged: ident.view.unchanged, spent: spent}
	if !identity.SameView(out.Messages, dec.forward) {
		dec.forward, dec.unchanged = out.Messages, false
	}
	return dec
}

// driverRequest is what the driver decides on for the client's view of
// ident: the state key, the view's record chain and estimator, the model's
// window, and, for a summary that outlives the request, copies that own
// their bytes (the request's body buffer is pooled and reused once the
// handler returns) and the summarize call.
func (s *Server) driverRequest(r *http.Request, ar *apiRequest, ident *identified, pass compaction.Pass) driver.Request {
	view, req := ident.view.msgs, ar.req
	return driver.Request{
		ID:           ar.reqID,
		Conversation: ident.ID,
		Key:          ident.Key,
		View:         view,
		Chain: func() ([]anchor.Digest, error) {
			return ident.RecordChain(view)
		},
		Estimate: func(anchors []anchor.Anchor) compaction.Estimator {
			return ident.Estimator(anchors, s.calibration.Fit(ident.Identity))
		},
		Window:                  s.windows.GetFor(ar.windowScope()),
		MaxTokens:               req.MaxTokens,
		Pass:                    pass,
		SummaryInUpstreamTokens: s.summaryInUpstreamTokens(req.Model),
		SelfCompaction:          ident.selfCompaction,
		Detach: func() driver.Detached {
			own := ident.Conversation.Detached()
			return driver.Detached{
				View: identity.Detach(view, req),
				Estimate: func(anchors []anchor.Anchor) compaction.Estimator {
					return own.Estimator(anchors, s.calibration.Fit(own.Identity))
				},
				Call: s.summaryCall(r.Header, req),
			}
		},
	}
}

// report is the report stage: the decision in response headers, the
// access log and metrics (once per request: a recovery's second decision
// updates the headers only).
func (s *Server) report(ar *apiRequest, ident *identified, dec decision, pass compaction.Pass) {
	out, ci := dec.out, ar.info
	if out.Events.SummarizeCalled {
		s.metrics.ObserveSummarize(out.Events.SummarizeOK, dec.spent)
	}
	first := pass != compaction.PassRecover
	if out.Events.Impossible && first {
		// The window cannot hold the request: the fixed part alone is over
		// the budget, or what compaction may never remove (the fixed part,
		// the task, the latest instruction, the final turn excerpted) is
		// over the window. Counted per request, logged once per
		// conversation.
		s.metrics.CompactionImpossible.Inc()
		if s.impossible.once(ident.Key) {
			msg := "request over the window after every compaction step; forwarding the smallest view"
			if out.Fixed >= out.Budget {
				// No summary has room; stored compaction is re-applied and a
				// view over the window is still brought under it.
				msg = "fixed part over the budget; no room for a summary"
			}
			s.log.Warn(msg, zap.String("request_id", ar.reqID), zap.String("conversation", ident.ID),
				zap.Int("fixed_tokens", out.Fixed), zap.Int("forwarded_tokens", out.Forwarded),
				zap.Int("budget", out.Budget), zap.Int("window", s.windows.GetFor(ar.windowScope())))
		}
	}
	action := string(out.Action)
	if action == string(compaction.ActionSummarizePending) && s.cfg.Compaction.Mode != "shadow" {
		// Forwarded without the summary that is due (it is being made
		// elsewhere, or the state is unreadable): say what the view
		// carries instead.
		action = viewAction(ident.view.msgs, out.Messages, out.State.Trims)
	}
	if action == "" || s.cfg.Compaction.Mode == "shadow" {
		action = "none"
	}
	ci.action = action
	ci.contextTokens = out.Context.Tokens
	ci.contextSource = out.Context.Source
	ci.forwardedTokens = out.Forwarded
	ar.respHeaders.Set("X-Compactproxy-Compaction", action)
	ar.respHeaders.Set("X-Compactproxy-Context-Tokens", strconv.Itoa(out.Context.Tokens))
	ar.respHeaders.Set("X-Compactproxy-Context-Source", out.Context.Source)
	ar.respHeaders.Set("X-Compactproxy-Forwarded-Tokens", strconv.Itoa(out.Forwarded))
	// Every forwarded decision, an overflow retry's included (not a
	// preview's): what each step removed and whether it reset the cache.
	s.countReduction(out)
	if !first {
		return // the overflow retry: counted once, on the first pass
	}
	if s.windows.GetFor(ar.windowScope()) == 0 {
		s.metrics.UnknownWindow.Inc()
		if s.windows.WarnOnce(ar.req.Model) {
			s.log.Warn("context window unknown for model; not compacting", zap.String("model", ar.req.Model))
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
// upstream's context-overflow answer to at, received before any byte
// reached the client, it records the reported size as a measurement of the
// view that was sent, learns n_ctx, and compacts again (throttle ignored,
// latch honoured). It returns the decision to send once more, only with a
// view that differs from the refused one (by digest: an equal view would
// be refused again) and is estimated to fit. DESIGN asks for "under the
// new target"; we accept the budget: at a small window the final turn
// alone can leave the view between target and budget, and a view
// estimated (with the overflow's own measurement) to fit is a better
// answer than the upstream's 400.
func (s *Server) recoverOnce(ctx context.Context, r *http.Request, ar *apiRequest, ident *identified, at attempt, err error) (decision, bool) {
	var ua *upstream.Answer
	if !errors.As(err, &ua) {
		return decision{}, false
	}
	status, body := ua.Overflow()
	info, ok := s.up.LearnOverflow(ar.reqID, ar.windowScope(), status, body)
	if !ok || !ident.compacting {
		return decision{}, false
	}
	if info.Prompt > 0 {
		s.storeAnchor(ctx, ar.reqID, ident.Conversation, at.dec.forward, anchor.Usage{Input: info.Prompt, Uncached: info.Prompt, HasInput: true})
	}
	before, _, err := ident.Chain(at.dec.forward)
	if err != nil {
		return decision{}, false
	}
	refused := before[len(before)-1]
	dec := s.compact(ctx, r, ar, ident, compaction.PassRecover)
	s.report(ar, ident, dec, compaction.PassRecover)
	after, _, err := ident.Chain(dec.forward)
	if err != nil || after[len(after)-1] == refused {
		return decision{}, false
	}
	if out := dec.out; out.Budget <= 0 || out.Forwarded > out.Budget {
		return decision{}, false
	}
	s.metrics.UpstreamRetries.WithLabelValues(ar.api.Dialect.String(), "context_overflow").Inc()
	return dec, true
}

// recordUsage is the record stage, called as the response's usage
// arrives and before its last byte is written: the usage counted, the
// provider's measurement of exactly the messages forwarded (dec's) stored
// as an anchor, and a background summary when the next request would pass
// compaction.presummarize_ratio.
func (s *Server) recordUsage(ctx context.Context, r *http.Request, ar *apiRequest, ident *identified, dec decision, u anchor.Usage) {
	if !u.HasInput || ar.opaque {
		return
	}
	// A prompt the upstream accepted: no learned window goes below it.
	s.up.Accept(ar.windowScope(), u.Input)
	s.metrics.UsageInputTokens.WithLabelValues("uncached").Add(float64(u.Uncached))
	s.metrics.UsageInputTokens.WithLabelValues("cache_read").Add(float64(u.CacheRead))
	s.metrics.UsageInputTokens.WithLabelValues("cache_write").Add(float64(u.CacheWrite))
	s.storeAnchor(context.WithoutCancel(ctx), ar.reqID, ident.Conversation, dec.forward, u)
	if ident.compacting {
		s.driver.Background(ctx, s.driverRequest(r, ar, ident, compaction.PassBackground), dec.out, u)
	}
}

// storeAnchor stores the provider's measurement of exactly the messages
// forwarded (one of the request's two writes) and feeds the calibration.
func (s *Server) storeAnchor(ctx context.Context, reqID string, conversation *identity.Conversation, view []chat.Message, u anchor.Usage) {
	if !u.HasInput {
		return
	}
	model, key := conversation.Identity, conversation.Key
	chain, local, err := conversation.Chain(view)
	if err != nil {
		return
	}
	total := 0
	for _, t := range local {
		total += t
	}
	a, ok := anchor.NewAnchor(chain, u, time.Now().Unix(), total)
	if !ok {
		return
	}
	fit := s.calibration.Fit(model)
	calibrated := false
	err = s.store.UpdateAnchors(ctx, key, func(anchors []anchor.Anchor) ([]anchor.Anchor, bool) {
		// Calibrate on what this view's estimate was, against the
		// provider's answer: an anchored estimate teaches only about the
		// messages after its anchor. (Once: the update may run again.)
		if !calibrated {
			calibrated = true
			s.calibration.ObserveEstimate(model, anchor.EstimateView(chain, local, anchors, fit), u.Input)
		}
		if len(anchors) > 0 && sameMeasurement(anchors[0], a) {
			return anchors, false // already the newest: no write (a retried or repeated request)
		}
		next := a
		if len(anchors) > 0 {
			next = anchor.Extend(anchors[0], a, chain)
		}
		return compaction.MergeAnchor(anchors, next), true
	})
	s.storeResult(reqID, "save", err)
}

// viewAction names the strongest compaction a forwarded view carries
// compared with the client's, in the header's order (a summary message,
// one the proxy synthesized, is a re-applied summary here: a summary made
// now is reported by the planner); trims are the lineage's records, which
// tell placeholders and pointers from excerpts.
func viewAction(client, forwarded []chat.Message, trims []compaction.Trim) string {
	if identity.SameView(client, forwarded) {
		return "none"
	}
	for i := range forwarded {
		if forwarded[i].Index < 0 {
			return string(compaction.ActionReused)
		}
	}
	if len(forwarded) < len(client) {
		return string(compaction.ActionDropped)
	}
	if stepZeroOnly(client, forwarded, trims) {
		return string(compaction.ActionMasked)
	}
	return string(compaction.ActionTrimmed)
}

// stepZeroOnly tells whether every message forwarded changed (same
// positions, no drop) is one that trims names as a placeholder or a
// pointer (step 0), not an excerpt.
func stepZeroOnly(client, forwarded []chat.Message, trims []compaction.Trim) bool {
	zero := map[int]bool{}
	for _, t := range trims {
		_, pointer := t.PointsTo()
		zero[t.Index] = t.Masked() || pointer
	}
	for i := range forwarded {
		if i < len(client) && !bytes.Equal(client[i].Raw, forwarded[i].Raw) && !zero[i] {
			return false
		}
	}
	return true
}

// sameMeasurement reports whether two anchors measure the same prefix with
// the same result (their times aside).
func sameMeasurement(a, b anchor.Anchor) bool {
	return a.PrefixLen == b.PrefixLen && a.Prefix == b.Prefix && a.Input == b.Input && a.Output == b.Output
}
