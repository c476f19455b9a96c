package proxy

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/store"
	"github.com/compactproxy/compactproxy/internal/summarizer"
	"go.uber.org/zap"
)

// conversationID returns the opaque id of the request's conversation: the
// first of compaction.conversation_headers the client sends (hashed: a
// header value never becomes a key), else the canonical digest of the
// leading system messages and the first user message.
func conversationID(r *http.Request, headers []string, msgs []chat.Message) string {
	h := sha256.New()
	if c := conversationHeader(r, headers); c != "" {
		h.Write([]byte("header\x00"))
		h.Write([]byte(c))
	} else {
		h.Write([]byte("derived\x00"))
		for i := range msgs {
			m := &msgs[i]
			if !m.HasDigest {
				if d, err := anchor.MessageHash(m.Raw); err == nil {
					m.Digest, m.HasDigest = d, true
				}
			}
			h.Write(m.Digest[:])
			if m.Role == "user" {
				break
			}
			if m.Role != "system" && m.Role != "developer" {
				// No user message in the opening block: the first
				// non-system message identifies the conversation.
				break
			}
		}
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// conversationHeader is the value of the first of headers the request
// carries, "" when none. The header names are distinct per match: the
// value "X-Compactproxy-Conversation: a" and "X-Session-Id: a" are the same
// conversation id on purpose (an agent that moves from one to the other
// keeps its state).
func conversationHeader(r *http.Request, headers []string) string {
	for _, name := range headers {
		if v := r.Header.Get(name); v != "" {
			return v
		}
	}
	return ""
}

// storeKey binds a conversation to its tenant: one tenant's state never
// applies to another's request.
func storeKey(tenant, id string) string { return tenant + "|" + id }

// modelIdentity is upstream.name + the requested model: two endpoints may
// serve the same bare name with different accounting.
func (s *Server) modelIdentity(model string) string {
	return s.upstreamName + "\x00" + model
}

// seed computes d0 for a request.
func (s *Server) seed(req *chat.Request) anchor.Digest {
	fields := map[string][]byte{}
	for _, f := range req.Fields {
		for _, k := range anchor.PromptFields {
			if f.Key == k {
				fields[k] = f.Value
			}
		}
	}
	return anchor.Seed(s.modelIdentity(req.Model), fields)
}

// seedInput is what a request's seed is computed from: the model and the
// raw values of anchor.PromptFields (the last occurrence of each, nil when
// absent), as seed reads them.
type seedInput struct {
	model  string
	values [8][]byte
}

func seedInputOf(req *chat.Request) seedInput {
	in := seedInput{model: req.Model}
	for _, f := range req.Fields {
		for j, k := range anchor.PromptFields[:min(len(anchor.PromptFields), len(in.values))] {
			if f.Key == k {
				in.values[j] = f.Value
			}
		}
	}
	return in
}

// equal reports whether two inputs are the same bytes.
func (a *seedInput) equal(b *seedInput) bool {
	if a.model != b.model {
		return false
	}
	for j := range a.values {
		if (a.values[j] == nil) != (b.values[j] == nil) || !bytes.Equal(a.values[j], b.values[j]) {
			return false
		}
	}
	return true
}

// clone returns a copy that owns its bytes.
func (a seedInput) clone() seedInput {
	for j := range a.values {
		if a.values[j] != nil {
			a.values[j] = bytes.Clone(a.values[j])
		}
	}
	return a
}

// seedFor is seed(req), taken from the parse cache entry req was parsed
// after when it was computed from the same bytes (canonicalizing a tools
// array is a sizeable part of a small request's cost).
func (s *Server) seedFor(req *chat.Request, in *seedInput, e *parseEntry) anchor.Digest {
	if len(anchor.PromptFields) <= len(in.values) && e != nil && e.seedIn.equal(in) {
		return e.seed
	}
	return s.seed(req)
}

// estimator builds the Estimate closure for one request: any view's digest
// chain, the conversation's anchors, the local estimate and the model's
// calibration ratio.
func (s *Server) estimator(memo *chainMemo, anchors []anchor.Anchor, identity string) compaction.Estimator {
	fit := s.calibration.Fit(identity)
	return func(view []chat.Message) anchor.Estimate {
		chain, local, err := memo.chain(view)
		if err != nil {
			return anchor.Estimate{Source: anchor.SourceLocal}
		}
		return anchor.EstimateView(chain, local, anchors, fit)
	}
}

// chainMemo computes views' digest chains for one request. A request
// measures several views that share leading messages (the client's view by
// the proxy and by the engine, candidate compacted views, the forwarded
// view again when its usage is recorded), and a chain is a function of the
// seed and the messages' digests alone: a view whose first n digests are
// those of a view already chained shares its first n+1 links, and only the
// rest are hashed. A request whose body extends an earlier one of its
// tenant starts with that body's chain (parseCache), so an agent's step
// chains only its new messages.
type chainMemo struct {
	s     *Server
	seed  anchor.Digest
	known []chainKnown // most recent first, at most memoViews
}

// memoViews is how many chained views a request remembers.
const memoViews = 4

// chainKnown is one chained view: its messages' digests, its chain (one
// longer) and its messages' local estimates, with which bytes each estimate
// was made from (an estimate is reused for the same bytes only: two
// messages with the same digest may differ in escapes, and so in their
// estimate). Never written once made: requests and views share them.
type chainKnown struct {
	digests []anchor.Digest
	chain   []anchor.Digest
	local   []int
	ident   []rawIdent
	// base, when ident is nil, names the bytes instead: the first
	// len(digests) messages of the view that starts at base (the
	// request's parsed messages, which are never rewritten) are the known
	// ones, so that view is matched without a per-message comparison.
	base *chat.Message
}

// rawIdent identifies a message's bytes by address and length.
type rawIdent struct {
	p *byte
	n int
}

func identOf(m *chat.Message) rawIdent {
	if len(m.Raw) == 0 {
		return rawIdent{}
	}
	return rawIdent{&m.Raw[0], len(m.Raw)}
}

// prefix is the first n messages of k, as the request's parsed messages
// msgs (whose first n messages have k's bytes) know them.
func (k chainKnown) prefix(n int, msgs []chat.Message) chainKnown {
	out := chainKnown{digests: k.digests[:n], chain: k.chain[:n+1], local: k.local[:n]}
	if n > 0 {
		out.base = &msgs[0]
	}
	return out
}

// onBase reports whether view starts at k's base (see base).
func (k *chainKnown) onBase(view []chat.Message) bool {
	return k.ident == nil && k.base != nil && len(view) > 0 && &view[0] == k.base
}

// sameBytes reports whether message i of view (i < matching) has the
// bytes k's estimate of it was made from.
func (k *chainKnown) sameBytes(view []chat.Message, i int, onBase bool) bool {
	if k.ident == nil {
		return onBase
	}
	return identOf(&view[i]) == k.ident[i]
}

// matching is how many leading messages of view have k's digests.
func (k *chainKnown) matching(view []chat.Message) int {
	n := min(len(view), len(k.digests))
	if k.onBase(view) {
		return n
	}
	for i := range n {
		if !view[i].HasDigest || view[i].Digest != k.digests[i] {
			return i
		}
	}
	return n
}

func (m *chainMemo) chain(view []chat.Message) ([]anchor.Digest, []int, error) {
	k, err := m.view(view)
	return k.chain, k.local, err
}

// view returns view's chain, from what the memo knows where it can.
// Messages without a digest get one, in place (as anchor.ViewChain does).
func (m *chainMemo) view(view []chat.Message) (chainKnown, error) {
	best, bestN := -1, 0
	for i := range m.known {
		if n := m.known[i].matching(view); best < 0 || n > bestN {
			best, bestN = i, n
		}
	}
	var from *chainKnown
	onBase := false
	if best >= 0 {
		from = &m.known[best]
		onBase = from.onBase(view)
		if bestN == len(view) && len(from.digests) == len(view) && (onBase || from.ident != nil && sameIdents(from.ident, view)) {
			return *from, nil
		}
	}
	out := chainKnown{
		digests: make([]anchor.Digest, len(view)),
		chain:   make([]anchor.Digest, len(view)+1),
		local:   make([]int, len(view)),
		ident:   make([]rawIdent, len(view)),
	}
	out.chain[0] = m.seed
	if from != nil {
		copy(out.chain, from.chain[:bestN+1])
		copy(out.digests, from.digests[:bestN])
	}
	for i := range view {
		msg := &view[i]
		out.ident[i] = identOf(msg)
		if i < bestN {
			if from.sameBytes(view, i, onBase) {
				out.local[i] = from.local[i]
			} else {
				out.local[i] = m.s.local.Tokens(msg)
			}
			continue
		}
		if !msg.HasDigest {
			d, err := anchor.MessageHash(msg.Raw)
			if err != nil {
				return chainKnown{}, fmt.Errorf("anchor: message %d: %w", i, err)
			}
			msg.Digest, msg.HasDigest = d, true
		}
		out.digests[i] = msg.Digest
		out.chain[i+1] = anchor.Link(out.chain[i], msg.Digest)
		out.local[i] = m.s.local.Tokens(msg)
	}
	if len(m.known) < memoViews {
		m.known = append(m.known, chainKnown{})
	}
	copy(m.known[1:], m.known)
	m.known[0] = out
	return out, nil
}

// sameIdents reports whether view's messages are the bytes ident names.
func sameIdents(ident []rawIdent, view []chat.Message) bool {
	for i := range view {
		if identOf(&view[i]) != ident[i] {
			return false
		}
	}
	return true
}

// conversation is what one request knows about its conversation: the
// model identity, the state key (tenant-bound) and the chain memo that every
// view of this request shares.
type conversation struct {
	id, key, identity string
	memo              *chainMemo
}

// openConversation hashes the view's messages (cached per tenant) and
// derives the conversation's id and state key.
func (s *Server) openConversation(r *http.Request, cr *chatRequest) *conversation {
	if err := s.digests.hash(cr.tenant, cr.forward); err != nil {
		s.log.Warn("message digest failed", zap.String("request_id", infoFrom(r.Context()).id), zap.Error(err))
	}
	id := conversationID(r, s.cfg.Compaction.ConversationHeaders, cr.forward)
	cr.seedIn = seedInputOf(cr.req)
	memo := &chainMemo{s: s, seed: s.seedFor(cr.req, &cr.seedIn, cr.parsed.from)}
	// The messages the body shares with the tenant's earlier body keep
	// that body's chain when the seed (model and prompt fields) is the same.
	if e, n := cr.parsed.from, cr.parsed.reused; e != nil && e.seed == memo.seed && len(e.chain.chain) > n && n <= len(cr.req.Messages) {
		memo.known = append(memo.known, e.chain.prefix(n, cr.req.Messages))
	}
	return &conversation{
		id:       id,
		key:      storeKey(cr.tenant, id),
		identity: s.modelIdentity(cr.req.Model),
		memo:     memo,
	}
}

// rememberParse keeps this request's parsed messages, digests and chain
// for the tenant's next request (parseCache), unless the entry it was
// parsed after already holds exactly them. The chain is kept only when the
// client's view is the parsed messages (pairing repair changes the view).
func (s *Server) rememberParse(cr *chatRequest, cv *conversation) {
	req, ps := cr.req, cr.parsed
	if e := ps.from; e != nil && ps.reused == len(req.Messages) && e.snap.Len() == len(req.Messages) &&
		e.seed == cv.memo.seed && e.seedIn.equal(&cr.seedIn) && len(e.chain.chain) == len(req.Messages)+1 && e.pairingClean == cr.pairingClean {
		return // nothing new: the entry stays (lookup marked it used)
	}
	// A snapshot's messages carry their digests: the next request shares
	// them as they are and never writes them (chat.ParseAfter). In pairing
	// repair mode the view was a copy, so the parsed messages may still
	// lack theirs.
	if err := s.digests.hash(cr.tenant, req.Messages); err != nil {
		return
	}
	snap := req.Snapshot()
	if snap == nil {
		return
	}
	e := &parseEntry{key: ps.key, snap: snap, seed: cv.memo.seed, seedIn: cr.seedIn.clone(), pairingClean: cr.pairingClean}
	if sameView(cr.client, req.Messages) {
		if k, err := cv.memo.view(req.Messages); err == nil {
			// Without the idents: they name this request's (pooled) body.
			e.chain = chainKnown{digests: k.digests, chain: k.chain, local: k.local}
		}
	}
	s.parses.store(e, ps.from, req.Body)
}

// compactOptions selects what one run of the engine may do.
type compactOptions struct {
	enabled        bool // compaction applies to this request at all
	summarize      bool // false: dry run, never call the summarizer
	ignoreThrottle bool // overflow recovery
	commit         bool // save the new state and count the events
}

// compact runs the engine over view (the client's provider-visible view):
// load → select the lineage → decide → save. Without a known window, or
// when compaction does not apply, it only estimates; when the state could
// not be read (the store is down: fail open) it neither summarizes nor
// saves. A summary that is due is
// made by summarizeShared, detached from this request. It returns the
// decision and the time spent summarizing or waiting for a summary
// (excluded from overhead).
func (s *Server) compact(ctx context.Context, r *http.Request, cv *conversation, view []chat.Message, model string, maxTokens int, o compactOptions) (compaction.Output, time.Duration) {
	reqID := infoFrom(ctx).id
	window := s.windows.get(model)
	conv, loaded := s.loadConversation(ctx, reqID, cv.key)
	estimateOnly := func() compaction.Output {
		e := s.estimator(cv.memo, conv.Anchors, cv.identity)(view)
		out := compaction.Output{Messages: view, Action: compaction.ActionNone, Context: e, Forwarded: e.Tokens}
		out.Budget = compaction.Budget(window, s.cfg.Compaction.ReserveTokens, maxTokens)
		return out
	}
	if !o.enabled || s.engine == nil || window == 0 {
		return estimateOnly(), 0
	}
	chain, _, err := cv.memo.chain(view)
	if err != nil {
		s.metrics.CompactionErrors.Inc()
		return estimateOnly(), 0
	}
	run := engineRun{cv: cv, view: view, chain: chain, window: window, maxTokens: maxTokens, model: model, o: o}
	if !loaded {
		// The state could not be read (the store is down or slow): no
		// summary (it could be neither coordinated nor kept) and nothing
		// stored, but the no-model-call steps (trim, and drop past the
		// budget) still apply, so a conversation that outgrew the window
		// is still answered instead of overflowing upstream.
		out := s.runEngine(ctx, &run, store.Conversation{}, -1, false)
		if o.commit {
			s.countCompaction(reqID, out)
		}
		return out, 0
	}
	li := compaction.SelectLineage(conv.Lineages, chain)
	dry := s.runEngine(ctx, &run, conv, li, false)
	if !o.summarize || dry.Action != compaction.ActionSummarizePending {
		if o.commit {
			s.commitRun(ctx, reqID, &run, conv, li, dry, false)
		}
		return dry, 0
	}
	// A summary is due: made once per lineage (in this process and, with a
	// shared store, across replicas), not under this client's context.
	start := time.Now()
	out, ok := s.summarizeShared(ctx, r, reqID, &run, conv, li, model)
	if !ok {
		// Another request or replica holds the lineage's summarize, the
		// store could not lease it, or this client left: forward the
		// trim-only view now, and store nothing (the summary's save
		// supersedes it).
		if o.commit {
			s.countCompaction(reqID, dry)
		}
		return dry, time.Since(start)
	}
	return out, time.Since(start)
}

// engineRun is what one request hands the engine, besides the state.
type engineRun struct {
	cv        *conversation
	view      []chat.Message
	chain     []anchor.Digest
	window    int
	maxTokens int
	model     string
	o         compactOptions
}

// runEngine runs the engine on lineage li of conv (-1: a new lineage).
// summarize false is the dry pass: the summarizer is never called, and a
// summary that is due is reported as ActionSummarizePending.
func (s *Server) runEngine(ctx context.Context, run *engineRun, conv store.Conversation, li int, summarize bool) compaction.Output {
	var l compaction.Lineage
	if li >= 0 {
		l = conv.Lineages[li]
	}
	return s.engine.Compact(ctx, compaction.Input{
		Messages:       run.view,
		Chain:          run.chain,
		State:          l.WithAnchors(conv.Anchors),
		Window:         run.window,
		MaxTokens:      run.maxTokens,
		Estimate:       s.estimator(run.cv.memo, conv.Anchors, run.cv.identity),
		Summarize:      summarize,
		IgnoreThrottle: run.o.ignoreThrottle,

		SummaryInUpstreamTokens: s.summaryInUpstreamTokens(run.model),
	})
}

// commitRun counts the run's events and, when its state changed, stores
// it as lineage li of conv (a new lineage when li is -1) through the
// store's update: the lineage replaces the stored one only while that is
// still the generation this run started from, unless force (a summarize
// result); other lineages and the anchors are untouched.
func (s *Server) commitRun(ctx context.Context, reqID string, run *engineRun, conv store.Conversation, li int, out compaction.Output, force bool) {
	s.countCompaction(reqID, out)
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
		return compaction.SaveLineage(ls, l, base, force)
	})
	s.storeResult(reqID, "save", err)
}

// prepareChat is the request path between parsing and forwarding: pairing,
// conversation identity, stored compaction, estimate, compaction, headers
// and the usage hook that records the anchor.
func (s *Server) prepareChat(w http.ResponseWriter, r *http.Request, cr *chatRequest, ci *chatInfo) bool {
	if !s.checkPairing(w, r, cr, ci) {
		return true
	}
	ctx := r.Context()
	ri := infoFrom(ctx)
	req := cr.req
	cv := s.openConversation(r, cr)
	ci.conversation = cv.id
	cr.respHeaders.Set("X-Compactproxy-Conversation-Id", cv.id)
	if s.windows.get(req.Model) == 0 {
		s.metrics.UnknownWindow.Inc()
		if s.windows.warnOnce(req.Model) {
			s.log.Warn("context window unknown for model; not compacting", zap.String("model", req.Model))
		}
	}
	bypass := strings.EqualFold(r.Header.Get("X-Compactproxy-Bypass"), "true")
	opts := compactOptions{enabled: s.cfg.Compaction.Enabled && !bypass, summarize: true, commit: true}
	cr.client = cr.forward
	ctx = withSummarizeSource(ctx, req)
	var last compaction.Output
	run := func(ctx context.Context) {
		out, spent := s.compact(ctx, r, cv, cr.client, req.Model, req.MaxTokens, opts)
		last = out
		cr.spent += spent
		if out.Events.SummarizeCalled {
			s.metrics.ObserveSummarize(out.Events.SummarizeOK, spent)
		}
		if out.Events.Impossible && !opts.ignoreThrottle {
			s.metrics.CompactionImpossible.Inc()
			if s.impossible.once(cv.key) {
				s.log.Warn("fixed part over the budget; forwarding without compaction",
					zap.String("request_id", ri.id), zap.String("conversation", cv.id),
					zap.Int("fixed_tokens", out.Fixed), zap.Int("budget", out.Budget))
			}
		}
		if !sameView(out.Messages, cr.forward) {
			cr.forward = out.Messages
			cr.unchanged = false
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
		if opts.ignoreThrottle {
			return // the overflow retry: counted once, on the first pass
		}
		if out.Context.Source == anchor.SourceAnchor {
			s.metrics.AnchorLookups.WithLabelValues("hit").Inc()
		} else {
			s.metrics.AnchorLookups.WithLabelValues("miss").Inc()
		}
		s.metrics.ContextTokens.Observe(float64(out.Context.Tokens))
		s.metrics.ForwardedTokens.Observe(float64(out.Forwarded))
	}
	run(ctx)
	s.rememberParse(cr, cv)
	cr.recompact = func(ctx context.Context, info overflowInfo) bool {
		if !opts.enabled || s.engine == nil {
			return false
		}
		// The provider's count is a measurement of exactly what was sent.
		if info.prompt > 0 {
			s.recordAnchor(ctx, ri.id, cv, cr.forward, anchor.Usage{Input: info.prompt, Uncached: info.prompt, HasInput: true})
		}
		before, _, err := cv.memo.chain(cr.forward)
		if err != nil {
			return false
		}
		refused := before[len(before)-1]
		opts.ignoreThrottle = true
		run(ctx)
		// Retry only with a view that differs from the refused one (by
		// digest: an equal view would be refused again) and is estimated
		// to fit. DESIGN asks for "under the new target"; we accept the
		// budget: at a small window the final turn alone can leave the
		// view between target and budget, and a view estimated (with the
		// overflow's own measurement) to fit is a better answer than the
		// upstream's 400.
		after, _, err := cv.memo.chain(cr.forward)
		if err != nil || after[len(after)-1] == refused {
			return false
		}
		return last.Budget > 0 && last.Forwarded <= last.Budget
	}
	// The usage hook: record the provider's measurement for exactly the
	// messages forwarded, before the response's last byte is written.
	cr.onUsage = func(u anchor.Usage) {
		s.recordAnchor(context.WithoutCancel(ctx), ri.id, cv, cr.forward, u)
		if opts.enabled && s.nearTrigger(last, u) {
			s.presummarize(ctx, r, ri.id, cv, cr.client, req.Model, req.MaxTokens)
		}
	}
	return false
}

// recordAnchor stores the provider's measurement of exactly the messages
// forwarded (one of the request's two writes) and feeds the calibration.
func (s *Server) recordAnchor(ctx context.Context, reqID string, cv *conversation, view []chat.Message, u anchor.Usage) {
	if !u.HasInput {
		return
	}
	identity, key := cv.identity, cv.key
	chain, local, err := cv.memo.chain(view)
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
	fit := s.calibration.Fit(identity)
	calibrated := false
	err = s.store.UpdateAnchors(ctx, key, func(anchors []anchor.Anchor) ([]anchor.Anchor, bool) {
		// Calibrate on what this view's estimate was, against the
		// provider's answer: an anchored estimate teaches only about the
		// messages after its anchor. (Once: the update may run again.)
		if !calibrated {
			calibrated = true
			s.calibration.ObserveEstimate(identity, anchor.EstimateView(chain, local, anchors, fit), u.Input)
		}
		if len(anchors) > 0 && sameMeasurement(anchors[0], a) {
			return anchors, false // already the newest: no write (a retried or repeated request)
		}
		return compaction.MergeAnchor(anchors, a), true
	})
	s.storeResult(reqID, "save", err)
}

// viewAction names the strongest compaction a forwarded view carries
// compared with the client's, in the header's order (a summary message,
// one the proxy synthesized, is a re-applied summary here: a summary made
// now is reported by the engine).
func viewAction(client, forwarded []chat.Message) string {
	if sameView(client, forwarded) {
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
	return string(compaction.ActionTrimmed)
}

// sameMeasurement reports whether two anchors measure the same prefix with
// the same result (their times aside).
func sameMeasurement(a, b anchor.Anchor) bool {
	return a.PrefixLen == b.PrefixLen && a.Prefix == b.Prefix && a.Input == b.Input && a.Output == b.Output
}

// sameView reports whether two views are the same messages (same bytes).
func sameView(a, b []chat.Message) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if len(a[i].Raw) != len(b[i].Raw) || (len(a[i].Raw) > 0 && &a[i].Raw[0] != &b[i].Raw[0]) {
			return false
		}
	}
	return true
}

// countCompaction turns the engine's events into metrics and one log line.
func (s *Server) countCompaction(reqID string, out compaction.Output) {
	ev := out.Events
	for _, a := range ev.NewActions {
		s.metrics.Compactions.WithLabelValues(string(a)).Inc()
	}
	if ev.SummarizeCalled {
		if ev.SummarizeOK {
			s.metrics.Summarize.WithLabelValues("success").Inc()
		} else {
			s.metrics.Summarize.WithLabelValues("failure").Inc()
		}
	}
	if ev.Suppressed != "" {
		s.metrics.SummarizeSuppressed.WithLabelValues(ev.Suppressed).Inc()
	}
	if ev.LatchEngaged {
		s.metrics.LatchEngaged.Inc()
	}
	if ev.InvariantFailure {
		s.metrics.InvariantFailures.Inc()
	}
	if len(ev.NewActions) > 0 || ev.SummarizeCalled || ev.InvariantFailure {
		fields := []zap.Field{zap.String("request_id", reqID), zap.String("action", string(out.Action)),
			zap.Int("context_tokens", out.Context.Tokens), zap.Int("forwarded_tokens", out.Forwarded),
			zap.Int("budget", out.Budget)}
		if len(ev.NewActions) > 0 {
			acts := make([]string, len(ev.NewActions))
			for i, a := range ev.NewActions {
				acts[i] = string(a)
			}
			fields = append(fields, zap.Strings("new_actions", acts))
		}
		if ev.SummaryError != nil {
			fields = append(fields, zap.String("summarize_error", summarizeErrorKind(ev.SummaryError)))
		}
		s.log.Info("compaction", fields...)
	}
}

// summarizeErrorKind names why a summarize failed without quoting the
// summarizer's answer: an error body may echo conversation content, and
// logs never carry content.
func summarizeErrorKind(err error) string {
	var se *summarizer.StatusError
	var de DialError
	switch {
	case errors.As(err, &se):
		return "status " + strconv.Itoa(se.StatusCode)
	case errors.As(err, &de):
		return "connect"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, summarizer.ErrEmptySummary), errors.Is(err, compaction.ErrEmptySummary):
		return "empty summary"
	case errors.Is(err, compaction.ErrSummaryNotSmaller):
		return "summary not smaller"
	case errors.Is(err, summarizer.ErrBadResponse):
		return "bad response"
	case errors.Is(err, summarizer.ErrNoModel):
		return "no model"
	case errors.Is(err, summarizer.ErrWindowTooSmall):
		return "window too small"
	}
	return "error"
}

// onceSet remembers keys so that a warning is logged once per key (a
// conversation); bounded, it forgets everything when full.
type onceSet struct {
	mu sync.Mutex
	m  map[string]struct{}
}

// once reports whether key was not seen before.
func (o *onceSet) once(key string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, ok := o.m[key]; ok {
		return false
	}
	if o.m == nil || len(o.m) >= 4096 {
		o.m = map[string]struct{}{}
	}
	o.m[key] = struct{}{}
	return true
}
