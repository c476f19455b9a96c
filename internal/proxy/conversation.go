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
	"sync"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/summarizer"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"go.uber.org/zap"
)

// conversationID returns the opaque id of the request's conversation: the
// first of compaction.conversation_headers the client sends (hashed: a
// header value never becomes a key), else the canonical digest of the
// model identity, the tools (idSeed) and the first user message — not the
// system prompt, which real agents rebuild per request with a date or an
// environment block (DESIGN § Compaction).
func conversationID(r *http.Request, headers []string, idSeed anchor.Digest, msgs []chat.Message) string {
	if c := conversationHeader(r, headers); c != "" {
		return headerConversationID(c)
	}
	h := sha256.New()
	h.Write([]byte("derived/v2\x00"))
	h.Write(idSeed[:])
	for i := range msgs {
		m := &msgs[i]
		if isSystemRole(m.Role) {
			continue
		}
		// The first user message; with none in the opening block,
		// the first message after the system messages.
		if !m.HasDigest {
			if d, err := anchor.MessageHash(m.Raw); err == nil {
				m.Digest, m.HasDigest = d, true
			}
		}
		h.Write(m.Digest[:])
		break
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// headerConversationID is the opaque id of the conversation a client's
// conversation header value names (hashed: a header value never becomes
// a key).
func headerConversationID(value string) string {
	h := sha256.New()
	h.Write([]byte("header\x00"))
	h.Write([]byte(value))
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// isSystemRole tells whether a message belongs to the leading instructions.
func isSystemRole(role string) bool { return role == "system" || role == "developer" }

// idSeed is what a derived conversation id is keyed by besides the first
// user message: the model identity and the tools (not tool_choice or the
// output format, which an agent may change between steps). It is the
// request's seed when the request sends no other prompt field.
func (s *Server) idSeed(req *chat.Request, in *seedInput, seed anchor.Digest) anchor.Digest {
	fields := map[string][]byte{}
	other := false
	for j, k := range anchor.PromptFields[:min(len(anchor.PromptFields), len(in.values))] {
		switch {
		case in.values[j] == nil:
		case k == "tools" || k == "functions":
			fields[k] = in.values[j]
		default:
			other = true
		}
	}
	if !other && len(anchor.PromptFields) <= len(in.values) {
		return seed
	}
	return anchor.Seed(s.modelIdentity(req.Model), fields)
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
		// Codex's session_id: a header map not built by a canonicalizing
		// reader keeps the spelling as written.
		if vs := r.Header[name]; len(vs) > 0 && vs[0] != "" {
			return vs[0]
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

// recordSeed is the seed of the request's compaction records: seed itself
// unless the request sends a prompt field past anchor.HistoryFields
// (reasoning, text, include, thinking), which changes what the provider
// counts but not which history a summary or trim applies to.
func (s *Server) recordSeed(in *seedInput, seed anchor.Digest) anchor.Digest {
	var fields map[string][]byte
	for j := anchor.HistoryFields; j < min(len(anchor.PromptFields), len(in.values)); j++ {
		if in.values[j] != nil {
			fields = map[string][]byte{}
			break
		}
	}
	if fields == nil {
		return seed
	}
	for j, k := range anchor.PromptFields[:anchor.HistoryFields] {
		if in.values[j] != nil {
			fields[k] = in.values[j]
		}
	}
	return anchor.Seed(s.modelIdentity(in.model), fields)
}

// seedInput is what a request's seed is computed from: the model and the
// raw values of anchor.PromptFields (the last occurrence of each, nil when
// absent), as seed reads them.
type seedInput struct {
	model  string
	values [12][]byte
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
// the proxy and by the planner, candidate compacted views, the forwarded
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
	// recordSeed starts the records' chain (recordChain); zero: memo's seed.
	recordSeed anchor.Digest
}

// openConversation hashes the view's messages (cached per tenant) and
// derives the conversation's id and state key.
func (s *Server) openConversation(r *http.Request, cr *chatRequest) *conversation {
	if err := s.digests.hash(cr.tenant, cr.forward); err != nil {
		s.log.Warn("message digest failed", zap.String("request_id", infoFrom(r.Context()).id), zap.Error(err))
	}
	cr.seedIn = seedInputOf(cr.req)
	memo := &chainMemo{s: s, seed: s.seedFor(cr.req, &cr.seedIn, cr.parsed.from)}
	id := conversationID(r, s.cfg.Compaction.ConversationHeaders, s.idSeed(cr.req, &cr.seedIn, memo.seed), cr.forward)
	// The messages the body shares with the tenant's earlier body keep
	// that body's chain when the seed (model and prompt fields) is the same.
	if e, n := cr.parsed.from, cr.parsed.reused; e != nil && e.seed == memo.seed && len(e.chain.chain) > n && n <= len(cr.req.Messages) {
		memo.known = append(memo.known, e.chain.prefix(n, cr.req.Messages))
	}
	return &conversation{
		id:         id,
		key:        storeKey(cr.tenant, id),
		identity:   s.modelIdentity(cr.req.Model),
		memo:       memo,
		recordSeed: s.recordSeed(&cr.seedIn, memo.seed),
	}
}

// recordChain is the planner's chain of view: its records and lineages
// are keyed after the leading system messages (compaction.RecordChain), so
// a system prompt that changes per request keeps them.
func (cv *conversation) recordChain(view []chat.Message) ([]anchor.Digest, error) {
	k, err := cv.memo.view(view)
	if err != nil {
		return nil, err
	}
	seed := cv.recordSeed
	if seed == (anchor.Digest{}) {
		seed = cv.memo.seed
	}
	return compaction.RecordChain(seed, k.digests, compaction.LeadingSystem(view)), nil
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
// now is reported by the planner).
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

// countCompaction turns the planner's events into metrics and one log line:
// the conversation, the action, the cut and the estimated sizes before
// (context_tokens) and after (forwarded_tokens), never content.
func (s *Server) countCompaction(reqID, conversation string, out compaction.Output) {
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
		fields := []zap.Field{zap.String("request_id", reqID), zap.String("conversation", conversation),
			zap.String("action", string(out.Action)), zap.Int("cut", stateCut(out.State)), zap.Int("trims", len(out.State.Trims)),
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
	var de upstream.DialError
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
