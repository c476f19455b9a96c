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
//
// It also adds what withSummarizeRequest derives from the client's request
// when prepareChat left it on ctx (summarizeSource). It runs only when a
// summarize is about to start, while the request's body is still valid:
// the copies that summarize needs are made then, not on every request.
func (s *Server) summarizeContext(ctx context.Context, r *http.Request, model string) context.Context {
	if req := sourceOf(ctx); req != nil {
		ctx = s.withSummarizeRequest(ctx, req)
	}
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

// summarizeSource is the context key of the client's request, from which
// summarizeContext derives the summarize request's shape.
type summarizeSource struct{}

// withSummarizeSource leaves req on ctx for summarizeContext: cheap, since
// most requests never summarize.
func withSummarizeSource(ctx context.Context, req *chat.Request) context.Context {
	return context.WithValue(ctx, summarizeSource{}, req)
}

// sourceOf is the client's request withSummarizeSource left on ctx, nil
// when none.
func sourceOf(ctx context.Context) *chat.Request {
	req, _ := ctx.Value(summarizeSource{}).(*chat.Request)
	return req
}

// summaryInUpstreamTokens tells whether summaries for model are made by
// the upstream's own model (the summarizer is the chat upstream, with no
// other model configured): a summarize call's limit then bounds the
// summary in the tokens the window counts.
func (s *Server) summaryInUpstreamTokens(model string) bool {
	sumModel := s.cfg.Compaction.Summarizer.Model
	return s.summarizerIsUpstream && (sumModel == "" || sumModel == model)
}

// withSummarizeRequest adds to ctx what a summarize call may take from the
// client's request when the summarizer is the chat upstream and model: a
// Builder that writes the summarize request as a continuation of this very
// request (same model, tools and other top-level fields as the client sent
// them, so the forwarded prefix and the upstream's prompt cache are
// shared), with tool_choice "none", no streaming, no output options that
// would shape the summary (OpenAI's, and llama-server's and vLLM's own
// length and format fields), and the summary's own token limit. It also
// counts every summarize answer's reported usage.
func (s *Server) withSummarizeRequest(ctx context.Context, req *chat.Request) context.Context {
	ctx = summarizer.WithUsageHook(ctx, func(u anchor.Usage) {
		s.metrics.SummarizeInputTokens.WithLabelValues("uncached").Add(float64(u.Uncached))
		s.metrics.SummarizeInputTokens.WithLabelValues("cache_read").Add(float64(u.CacheRead))
		s.metrics.SummarizeInputTokens.WithLabelValues("cache_write").Add(float64(u.CacheWrite))
	})
	if !s.summaryInUpstreamTokens(req.Model) {
		return ctx
	}
	// The summarize runs detached from the request and may outlive its
	// handler, whose body buffer is pooled: the builder keeps its own copy
	// of the top-level fields (the messages array is replaced anyway).
	own := &chat.Request{Fields: make([]chat.Field, 0, len(req.Fields))}
	hasTools := false
	for _, f := range req.Fields {
		hasTools = hasTools || f.Key == "tools"
		c := chat.Field{Key: strings.Clone(f.Key)}
		if f.Key != "messages" {
			c.Value = bytes.Clone(f.Value)
		}
		own.Fields = append(own.Fields, c)
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
			{Key: "parallel_tool_calls"},
			// Servers' own length and format options win over max_tokens
			// (llama-server reads n_predict first): a client's
			// n_predict: 16 for its answers would cut the summary to 16
			// tokens, a grammar would force its format on it.
			{Key: "n_predict"}, {Key: "ignore_eos"}, {Key: "min_tokens"},
			{Key: "grammar"}, {Key: "json_schema"},
			{Key: "guided_json"}, {Key: "guided_regex"}, {Key: "guided_choice"}, {Key: "guided_grammar"},
			{Key: "tool_choice"},
		}
		if hasTools {
			set[len(set)-1].Value = []byte(`"none"`)
		}
		return own.Build(msgs, set)
	})
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

// summarizeShared makes the summary that is due for run's lineage, once:
// in this process by a flight per lease name, across replicas by the
// store's lease. The summarize runs detached from the request (its own
// context, bounded by compaction.summarizer.timeout), so a client that
// leaves or times out does not cancel it, and its retry finds it in
// progress or made. The request waits, giving up when its own client
// leaves. ok false: no summary for this request (held elsewhere, the store
// failed, the client left, or the wait found nothing new); the caller
// forwards the dry run's view.
func (s *Server) summarizeShared(ctx context.Context, r *http.Request, reqID string, run *engineRun, conv store.Conversation, li int, model string) (compaction.Output, bool) {
	// A request that waited on another request's (or a background)
	// summary of its lineage and still needs one (that summary covered an
	// older head) leads a summarize of its own once: falling back to the
	// trim-only view would drop while the summarizer works.
	for attempt := 0; ; attempt++ {
		name := leaseName(run.cv.key, conv.Lineages, li)
		fl, leader := s.flights.join(name)
		if leader {
			// Everything the detached run reads is its own: the request's
			// body buffer is pooled and reused once the handler returns.
			sctx := s.summarizeContext(context.WithoutCancel(ctx), r, model)
			own := *run
			own.view = detachMessages(run.view, sourceOf(ctx))
			own.chain = slices.Clone(run.chain)
			own.cv = &conversation{id: run.cv.id, key: run.cv.key, identity: run.cv.identity,
				memo: &chainMemo{s: s, seed: run.cv.memo.seed}}
			go s.summarizeFlight(sctx, reqID, name, fl, &own)
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
		conv, loaded = s.loadConversation(ctx, reqID, run.cv.key)
		if !loaded {
			return compaction.Output{}, false
		}
		li = compaction.SelectLineage(conv.Lineages, run.chain)
		out := s.runEngine(ctx, run, conv, li, false)
		if out.Action == compaction.ActionSummarizePending {
			if attempt == 0 {
				continue
			}
			return compaction.Output{}, false
		}
		if run.o.commit {
			s.commitRun(ctx, reqID, run, conv, li, out, false)
		}
		return out, true
	}
}

// summarizeFlight is the detached summarize: lease, re-read (another
// replica may have just saved it), run the engine with the summarizer,
// save (the result supersedes what others recorded meanwhile), release.
func (s *Server) summarizeFlight(ctx context.Context, reqID, name string, fl *flight, run *engineRun) {
	defer s.flights.finish(name, fl)
	timeout := s.cfg.Compaction.Summarizer.Timeout
	if timeout <= 0 {
		timeout = 60 * time.Second
	}
	release, ok, err := s.store.Lease(ctx, name, timeout+leaseMargin)
	s.storeResult(reqID, "lock", err)
	if err != nil || !ok {
		return
	}
	defer release()
	conv, loaded := s.loadConversation(ctx, reqID, run.cv.key)
	if !loaded {
		return
	}
	li := compaction.SelectLineage(conv.Lineages, run.chain)
	ctx, cancel := context.WithTimeout(ctx, timeout+leaseMargin/2)
	defer cancel()
	out := s.runEngine(ctx, run, conv, li, true)
	if run.o.commit {
		s.commitRun(ctx, reqID, run, conv, li, out, out.Events.SummarizeCalled)
	}
	fl.out, fl.ok = out, true
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
	if ratio <= 0 || s.engine == nil || out.Budget <= 0 || out.Fixed >= out.Budget || !u.HasInput ||
		out.Action == compaction.ActionSummarized || s.cfg.Compaction.Mode == "shadow" {
		return false
	}
	next := u.Input + u.Output
	return next >= out.Fixed+int(ratio*float64(out.Budget-out.Fixed)) && next < out.Trigger
}

// presummarize summarizes the conversation's head in the background after
// a response (DESIGN step 2, "Background pre-summarization") and stores
// the summary without applying it: the request that crosses the trigger
// re-applies it instead of waiting for a model call. It runs like a
// summarize due on a request (one flight per lineage, the store's lease,
// max_concurrent, latch and throttle), detached from the client, on its
// own copy of the messages (the request's body buffer is pooled).
func (s *Server) presummarize(ctx context.Context, r *http.Request, reqID string, cv *conversation, view []chat.Message, model string, maxTokens int) {
	window := s.windows.get(model)
	if window == 0 {
		return
	}
	own := detachMessages(view, sourceOf(ctx))
	ocv := &conversation{id: cv.id, key: cv.key, identity: cv.identity, memo: &chainMemo{s: s, seed: cv.memo.seed}}
	chain, _, err := ocv.memo.chain(own)
	if err != nil {
		return
	}
	chain = slices.Clone(chain)
	sctx := s.summarizeContext(context.WithoutCancel(ctx), r, model)
	s.flights.bg.Add(1)
	go func() {
		defer s.flights.bg.Done()
		run := engineRun{cv: ocv, view: own, chain: chain, window: window, maxTokens: maxTokens, model: model,
			o: compactOptions{enabled: true, summarize: true, commit: true}}
		conv, loaded := s.loadConversation(sctx, reqID, ocv.key)
		if !loaded {
			return
		}
		name := leaseName(ocv.key, conv.Lineages, compaction.SelectLineage(conv.Lineages, chain))
		fl, leader := s.flights.join(name)
		if !leader {
			return // a summarize of this lineage is running already
		}
		defer s.flights.finish(name, fl)
		timeout := s.cfg.Compaction.Summarizer.Timeout
		if timeout <= 0 {
			timeout = 60 * time.Second
		}
		release, ok, err := s.store.Lease(sctx, name, timeout+leaseMargin)
		s.storeResult(reqID, "lock", err)
		if err != nil || !ok {
			return
		}
		defer release()
		if conv, loaded = s.loadConversation(sctx, reqID, ocv.key); !loaded {
			return
		}
		li := compaction.SelectLineage(conv.Lineages, chain)
		var l compaction.Lineage
		if li >= 0 {
			l = conv.Lineages[li]
		}
		rctx, cancel := context.WithTimeout(sctx, timeout+leaseMargin/2)
		defer cancel()
		out := s.engine.Compact(rctx, compaction.Input{
			Messages: run.view, Chain: run.chain, State: l.WithAnchors(conv.Anchors),
			Window: window, MaxTokens: maxTokens,
			Estimate:  s.estimator(ocv.memo, conv.Anchors, ocv.identity),
			Summarize: true, Presummarize: true,

			SummaryInUpstreamTokens: s.summaryInUpstreamTokens(model),
		})
		if out.Events.SummarizeCalled {
			if out.Events.SummarizeOK {
				s.metrics.Presummarize.WithLabelValues("success").Inc()
			} else {
				s.metrics.Presummarize.WithLabelValues("failure").Inc()
			}
		}
		s.commitRun(rctx, reqID, &run, conv, li, out, false)
		// Requests that joined this flight re-read the stored state.
		fl.ok = true
	}()
}

// waitBackground waits until no background summary runs (tests; a
// drain).
func (f *flights) waitBackground() { f.bg.Wait() }
