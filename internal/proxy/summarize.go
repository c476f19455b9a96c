package proxy

import (
	"bytes"
	"context"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/store"
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
	}
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

// summaryInUpstreamTokens tells whether summaries for model are made by
// the upstream's own model (the summarizer is the chat upstream, with no
// other model configured): a summarize call's limit then bounds the
// summary in the tokens the window counts.
func (s *Server) summaryInUpstreamTokens(model string) bool {
	sumModel := s.cfg.Compaction.Summarizer.Model
	return s.summarizerIsUpstream && (sumModel == "" || sumModel == model)
}

// flights are the summarizes running in this process, by lease name: a
// request of the same lineage (a concurrent one, or an SDK's retry of a
// request whose client timed out) waits for the running one instead of
// starting its own.
type flights struct {
	mu sync.Mutex
	m  map[string]*flight
	// bg counts background summaries (presummarize) not finished yet.
	bg sync.WaitGroup
}

// flight is one detached summarize; done closes when its state is saved.
type flight struct {
	done chan struct{}
	out  compaction.Output
	ok   bool // out is a summarize run's result (not: lease held elsewhere)
}

// join returns the running flight of name, or starts one (leader true).
func (f *flights) join(name string) (fl *flight, leader bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if fl := f.m[name]; fl != nil {
		return fl, false
	}
	if f.m == nil {
		f.m = map[string]*flight{}
	}
	fl = &flight{done: make(chan struct{})}
	f.m[name] = fl
	return fl, true
}

func (f *flights) finish(name string, fl *flight) {
	f.mu.Lock()
	delete(f.m, name)
	f.mu.Unlock()
	close(fl.done)
}

// leaseMargin is added to the summarizer's timeout for the lease's life: a
// holder that dies frees the lineage after that much time at most.
const leaseMargin = 10 * time.Second

// leaseName names the summarize of lineage li of the conversation (key is
// tenant-bound and opaque). A lineage not stored yet has no id, and two
// requests of it may differ in length: new lineages of a conversation
// share one name, so at worst one of them waits a step for its own.
func leaseName(key string, ls []compaction.Lineage, li int) string {
	if li < 0 {
		return key + "|new"
	}
	return key + "|" + strconv.FormatUint(ls[li].ID, 16)
}

// detachMessages deep-copies the bytes of msgs (Raw and Content alias the
// request body, whose buffer is pooled), except those of the leading
// messages that req (nil: none) shares with a parse cache snapshot: their
// bytes are the snapshot's, never reused, so an agent's step in the
// presummarize band copies its new messages only, not its whole history.
func detachMessages(msgs []chat.Message, req *chat.Request) []chat.Message {
	out := make([]chat.Message, len(msgs))
	shared := 0
	if req != nil {
		shared = min(req.Shared(), len(req.Messages), len(msgs))
	}
	for i, m := range msgs {
		if i < shared && sameView(msgs[i:i+1], req.Messages[i:i+1]) {
			out[i] = m
			continue
		}
		m.Raw = bytes.Clone(m.Raw)
		m.Content = bytes.Clone(m.Content)
		m.ToolCalls = slices.Clone(m.ToolCalls)
		out[i] = m
	}
	return out
}

// nearTrigger tells whether the request after this response would be over
// compaction.presummarize_ratio of the room but still under the trigger:
// its input will be at least this one's plus this answer.
func (s *Server) nearTrigger(out compaction.Output, u anchor.Usage) bool {
	ratio := s.cfg.Compaction.PresummarizeRatio
	if ratio <= 0 || s.planner == nil || out.Budget <= 0 || out.Fixed >= out.Budget || !u.HasInput ||
		out.Action == compaction.ActionSummarized || s.cfg.Compaction.Mode == "shadow" {
		return false
	}
	next := u.Input + u.Output
	return next >= out.Fixed+int(ratio*float64(out.Budget-out.Fixed)) && next < out.Trigger
}

// waitBackground waits until no background summary runs (tests; a
// drain).
func (f *flights) waitBackground() { f.bg.Wait() }

// newSummarizer builds the HTTP summarizer with the same retry policy as
// chat, counted under op="summarize"; nil when the summarizer is off.
// Calls are bounded process-wide by compaction.summarizer.max_concurrent
// (summarize).
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
	s.sumSem = make(chan struct{}, max(c.MaxConcurrent, 1))
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
		call.Window = s.windows.GetFor(upstream.Scope{Tenant: tenantOf(s.tenantSecret, h), Model: sumModel, Shape: upstream.WindowShape(h)})
		fit := s.calibration.Fit(s.modelIdentity(sumModel))
		call.Count = func(text string) int { return textTokens(fit, len(text)) }
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
		call.Build = s.requestBuilder(req)
	}
	return call
}

// requestBuilder writes the summarize request as a continuation of the
// client's very request when the summarizer is the chat upstream and
// model: same model, tools and other top-level fields as the client sent
// them, so the forwarded prefix and the upstream's prompt cache are shared,
// with the fields the request's API sets or removes for a summary
// (*wire.API.SummaryFields: no tool call, no streaming, no option that
// would shape or cut it, the summary's own token limit). A chat request's
// top-level fields are copied (the messages array is replaced anyway; the
// body is pooled); a Responses or Messages request's items are its own, so
// the builder may run after the request is over.
func (s *Server) requestBuilder(req *chat.Request) summarizer.Builder {
	api := wire.For(req.Dialect())
	own := req
	if req.Dialect() == chat.DialectChat { // only a chat body is pooled (readChat)
		own = &chat.Request{Fields: make([]chat.Field, 0, len(req.Fields))}
		for _, f := range req.Fields {
			c := chat.Field{Key: strings.Clone(f.Key)}
			if f.Key != "messages" {
				c.Value = bytes.Clone(f.Value)
			}
			own.Fields = append(own.Fields, c)
		}
	}
	dialect := s.cfg.Upstream.Dialect
	return func(msgs []chat.Message, maxTokens int) []byte {
		return own.Build(msgs, api.SummaryFields(own, maxTokens, dialect))
	}
}

// summarize obtains the summary need asks for, at most
// compaction.summarizer.max_concurrent at a time in the process, with the
// completion tokens the summarizer reported for it (0 = not reported).
func (s *Server) summarize(ctx context.Context, call summarizer.Call, need *compaction.SummaryRequest) (string, int, error) {
	select {
	case s.sumSem <- struct{}{}:
	case <-ctx.Done():
		return "", 0, ctx.Err()
	}
	defer func() { <-s.sumSem }()
	call.Request = *need
	tokens := 0
	count := call.OnUsage
	call.OnUsage = func(u anchor.Usage) {
		if count != nil {
			count(u)
		}
		// The last answer is the summary (a chunked transcript folds).
		tokens = 0
		if u.HasOutput {
			tokens = u.Output
		}
	}
	text, err := s.sum.Summarize(ctx, call)
	return text, tokens, err
}

// summaryJob is a summary to make for one lineage, detached from the
// request that needs it: its own copies of the view and chain, and what
// the summarize call takes from the request.
type summaryJob struct {
	reqID string
	run   planRun
	call  summarizer.Call
}

// newSummaryJob detaches run: everything the job reads is its own (the
// request's body buffer is pooled and reused once the handler returns).
func (s *Server) newSummaryJob(r *http.Request, cr *chatRequest, run *planRun) *summaryJob {
	own := *run
	own.view = detachMessages(run.view, cr.req)
	own.chain = slices.Clone(run.chain)
	own.cv = &conversation{id: run.cv.id, key: run.cv.key, identity: run.cv.identity,
		memo: &chainMemo{s: s, seed: run.cv.memo.seed}, recordSeed: run.cv.recordSeed}
	return &summaryJob{reqID: cr.reqID, run: own, call: s.summaryCall(r.Header, cr.req)}
}

// summarizeShared makes the summary that is due for job's lineage (li of
// conv), once: in this process by a flight per lease name, across replicas
// by the store's lease. The summarize runs detached from the request
// (makeSummary), so a client that leaves or times out does not cancel it,
// and its retry finds it in progress or made. The request waits, giving up
// when its own client leaves. ok false: no summary for this request (held
// elsewhere, the store failed, the client left, or the wait found nothing
// new); the caller forwards the view without it.
func (s *Server) summarizeShared(ctx context.Context, job *summaryJob, conv store.Conversation, li int) (compaction.Output, bool) {
	run := &job.run
	// A request that waited on another request's (or a background)
	// summary of its lineage and still needs one (that summary covered an
	// older head) leads a summarize of its own once: falling back to the
	// view without it would drop while the summarizer works.
	for attempt := 0; ; attempt++ {
		name := leaseName(run.cv.key, conv.Lineages, li)
		fl, leader := s.flights.join(name)
		if leader {
			go s.makeSummary(context.WithoutCancel(ctx), name, fl, job)
		}
		select {
		case <-fl.done:
		case <-ctx.Done():
			return compaction.Output{}, false
		}
		if leader {
			return fl.out, fl.ok
		}
		if !fl.ok {
			return compaction.Output{}, false
		}
		// Another request's summary of this lineage: re-read the state and
		// re-apply it to this request's own view (no summarize call).
		var loaded bool
		conv, loaded = s.loadConversation(ctx, job.reqID, run.cv.key)
		if !loaded {
			return compaction.Output{}, false
		}
		li = compaction.SelectLineage(conv.Lineages, run.chain)
		out := s.planner.Plan(s.planInput(run, conv, li))
		if out.Need != nil {
			if attempt == 0 {
				continue
			}
			return compaction.Output{}, false
		}
		if run.o.commit {
			s.commitRun(ctx, job.reqID, run, conv, li, out, false)
		}
		return out, true
	}
}

// makeSummary is the detached summarize of one lineage, for the request
// path and background summaries alike: lease, re-read the state (another
// replica may have just saved it), plan, obtain the summary the plan asks
// for, plan again with it, save (a request's summary supersedes what
// others recorded meanwhile: it cost a model call), release. fl reports
// the decision to the requests waiting on it.
func (s *Server) makeSummary(ctx context.Context, name string, fl *flight, job *summaryJob) {
	defer s.flights.finish(name, fl)
	run := &job.run
	timeout := s.cfg.Compaction.Summarizer.Timeout
	if timeout <= 0 {
		timeout = 60 * time.Second
	}
	release, ok, err := s.store.Lease(ctx, name, timeout+leaseMargin)
	s.storeResult(job.reqID, "lock", err)
	if err != nil || !ok {
		return
	}
	defer release()
	conv, loaded := s.loadConversation(ctx, job.reqID, run.cv.key)
	if !loaded {
		return
	}
	li := compaction.SelectLineage(conv.Lineages, run.chain)
	ctx, cancel := context.WithTimeout(ctx, timeout+leaseMargin/2)
	defer cancel()
	in := s.planInput(run, conv, li)
	out := s.planner.Plan(in)
	if need := out.Need; need != nil {
		text, tokens, err := s.summarize(ctx, job.call, need)
		in.Summary = compaction.ResultFor(need, text, tokens, err, ctx.Err() != nil)
		out = s.planner.Plan(in)
	}
	background := run.o.pass == compaction.PassBackground
	if background && out.Events.SummarizeCalled {
		if out.Events.SummarizeOK {
			s.metrics.Presummarize.WithLabelValues("success").Inc()
		} else {
			s.metrics.Presummarize.WithLabelValues("failure").Inc()
		}
	}
	s.commitRun(ctx, job.reqID, run, conv, li, out, out.Events.SummarizeCalled && !background)
	fl.out, fl.ok = out, true
}

// presummarize summarizes the conversation's head in the background after
// a response (DESIGN step 2, "Background pre-summarization") and stores
// the summary without applying it: the request that crosses the trigger
// re-applies it instead of waiting for a model call. It runs like a
// summarize due on a request (one flight per lineage, the store's lease,
// max_concurrent, latch and throttle), detached from the client, on its
// own copy of the messages; when a summarize of the lineage is running
// already, nothing more is done.
func (s *Server) presummarize(ctx context.Context, r *http.Request, cr *chatRequest, cv *conversation) {
	window := s.windows.GetFor(cr.windowScope())
	if window == 0 || s.planner == nil {
		return
	}
	chain, err := cv.recordChain(cr.client)
	if err != nil {
		return
	}
	run := &planRun{cv: cv, view: cr.client, chain: chain, window: window, maxTokens: cr.req.MaxTokens, model: cr.req.Model,
		o: compactOptions{pass: compaction.PassBackground, enabled: true, summarize: true, commit: true}}
	job := s.newSummaryJob(r, cr, run)
	s.flights.bg.Add(1)
	go func() {
		defer s.flights.bg.Done()
		ctx := context.WithoutCancel(ctx)
		conv, loaded := s.loadConversation(ctx, job.reqID, cv.key)
		if !loaded {
			return
		}
		name := leaseName(cv.key, conv.Lineages, compaction.SelectLineage(conv.Lineages, job.run.chain))
		fl, leader := s.flights.join(name)
		if !leader {
			return // a summarize of this lineage is running already
		}
		s.makeSummary(ctx, name, fl, job)
	}()
}
