package proxy

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/store"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"go.uber.org/zap"
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

// compactChat is the compact stage: the planner's decision for the
// client's view (a summary it asks for is made once per lineage, detached
// from this request, and waited for); forward becomes the decided view.
func (s *Server) compactChat(ctx context.Context, r *http.Request, cr *chatRequest, cv *conversation, pass compaction.Pass) {
	out, spent := s.compact(ctx, r, cr, cv, compactOptions{pass: pass, enabled: cr.compact, summarize: true, commit: true})
	cr.spent += spent
	cr.decision, cr.decisionSpent = out, spent
	if !sameView(out.Messages, cr.forward) {
		cr.forward = out.Messages
		cr.unchanged = false
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
		action = viewAction(cr.client, out.Messages)
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
	if !ok || !cr.compact || s.planner == nil {
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
	if cr.compact && s.nearTrigger(cr.decision, u) {
		s.presummarize(ctx, r, cr, cv)
	}
}

// compactOptions selects what one compaction may do.
type compactOptions struct {
	pass      compaction.Pass
	enabled   bool // compaction applies to this request at all
	summarize bool // obtain a summary the decision asks for (false: a preview's dry run)
	commit    bool // save the new state and count the events
}

// compact decides for the client's view (cr.client): load → select the
// lineage → plan → (obtain the summary the plan asks for) → save. Without
// a known window, or when compaction does not apply, it only estimates;
// when the state could not be read (the store is down: fail open) it
// neither summarizes nor saves. It returns the decision and the time spent
// summarizing or waiting for a summary (excluded from overhead).
func (s *Server) compact(ctx context.Context, r *http.Request, cr *chatRequest, cv *conversation, o compactOptions) (compaction.Output, time.Duration) {
	reqID := cr.reqID
	view, model, maxTokens := cr.client, cr.req.Model, cr.req.MaxTokens
	window := s.windows.GetFor(cr.windowScope())
	conv, loaded := s.loadConversation(ctx, reqID, cv.key)
	estimateOnly := func() compaction.Output {
		e := s.estimator(cv.memo, conv.Anchors, cv.identity)(view)
		out := compaction.Output{Messages: view, Action: compaction.ActionNone, Context: e, Forwarded: e.Tokens}
		out.Budget = compaction.Budget(window, s.cfg.Compaction.ReserveTokens, maxTokens)
		return out
	}
	if !o.enabled || s.planner == nil || window == 0 {
		return estimateOnly(), 0
	}
	if cr.selfCompaction && o.pass == compaction.PassForward {
		// The agent asks to summarize its history itself: it gets all of
		// it while the whole request fits the window (DESIGN § Other
		// APIs), else the compacted view like any request.
		if out := estimateOnly(); out.Forwarded <= out.Budget {
			return out, 0
		}
	}
	chain, err := cv.recordChain(view)
	if err != nil {
		s.metrics.CompactionErrors.Inc()
		return estimateOnly(), 0
	}
	run := planRun{cv: cv, view: view, chain: chain, window: window, maxTokens: maxTokens, model: model, o: o}
	if !loaded {
		// The state could not be read (the store is down or slow): no
		// summary (it could be neither coordinated nor kept) and nothing
		// stored, but the no-model-call steps (trim, and drop past the
		// budget) still apply, so a conversation that outgrew the window
		// is still answered instead of overflowing upstream.
		out := s.planner.Plan(s.planInput(&run, store.Conversation{}, -1))
		if o.commit {
			s.countCompaction(reqID, cv.id, out)
		}
		return out, 0
	}
	li := compaction.SelectLineage(conv.Lineages, chain)
	out := s.planner.Plan(s.planInput(&run, conv, li))
	if !o.summarize || out.Need == nil {
		if o.commit {
			s.commitRun(ctx, reqID, &run, conv, li, out, false)
		}
		return out, 0
	}
	// A summary is due: made once per lineage (in this process and, with a
	// shared store, across replicas), not under this client's context.
	start := time.Now()
	made, ok := s.summarizeShared(ctx, s.newSummaryJob(r, cr, &run), conv, li)
	if !ok {
		// Another request or replica holds the lineage's summarize, the
		// store could not lease it, or this client left: forward the view
		// without the summary now, and store nothing (the summary's save
		// supersedes it).
		if o.commit {
			s.countCompaction(reqID, cv.id, out)
		}
		return out, time.Since(start)
	}
	return made, time.Since(start)
}

// planRun is what one decision is made on, besides the state.
type planRun struct {
	cv        *conversation
	view      []chat.Message
	chain     []anchor.Digest
	window    int
	maxTokens int
	model     string
	o         compactOptions
}

// planInput is the planner's input for run on lineage li of conv (-1: a
// new lineage), at the time of the call.
func (s *Server) planInput(run *planRun, conv store.Conversation, li int) compaction.Input {
	var l compaction.Lineage
	if li >= 0 {
		l = conv.Lineages[li]
	}
	return compaction.Input{
		Messages:  run.view,
		Chain:     run.chain,
		State:     l.WithAnchors(conv.Anchors),
		Window:    run.window,
		MaxTokens: run.maxTokens,
		Estimate:  s.estimator(run.cv.memo, conv.Anchors, run.cv.identity),
		Now:       time.Now(),
		Pass:      run.o.pass,

		SummaryInUpstreamTokens: s.summaryInUpstreamTokens(run.model),
	}
}

// commitRun counts the decision's events and, when its state changed,
// stores it as lineage li of conv (a new lineage when li is -1) through the
// store's update: the lineage replaces the stored one only while that is
// still the generation this decision started from, unless force (a
// summarize result); other lineages and the anchors are untouched.
func (s *Server) commitRun(ctx context.Context, reqID string, run *planRun, conv store.Conversation, li int, out compaction.Output, force bool) {
	s.countCompaction(reqID, run.cv.id, out)
	if !out.StateChanged {
		return
	}
	n := len(run.chain) - 1
	l := compaction.Lineage{ID: compaction.LineageID(run.chain), TipLen: n, Tip: run.chain[n], Used: time.Now().Unix(), State: out.State}
	var base uint32
	if li >= 0 {
		l.ID, base = conv.Lineages[li].ID, conv.Lineages[li].Gen
	}
	err := s.store.UpdateLineages(ctx, run.cv.key, func(ls []compaction.Lineage) ([]compaction.Lineage, bool) {
		if run.o.pass == compaction.PassBackground {
			// A background summary merges into what requests saved
			// meanwhile (it took seconds; the conversation went on).
			return compaction.MergeBackground(ls, l), true
		}
		return compaction.SaveLineage(ls, l, base, force)
	})
	s.storeResult(reqID, "save", err)
}
