// Package identity derives which conversation a request belongs to: its
// tenant (from the client's credential), its opaque conversation id and
// tenant-bound state key, and the digest chains that key its lineages. It
// keeps the caches that make this cheap for an agent resending its whole
// history: the parse cache (a body parsed after the tenant's previous
// one) and the digest cache (message bytes already hashed). It takes plain
// values (headers, bodies, parsed requests) and serves no HTTP.
package identity

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
)

// Identifier derives conversations' identities for one upstream and keeps
// the parse and digest caches. Safe for concurrent use.
type Identifier struct {
	upstreamName string
	local        anchor.LocalEstimator
	digests      *digestCache
	parses       *parseCache
}

const (
	// digestCacheEntries bounds the message-digest cache (about 100
	// bytes an entry: ~20 MB at most).
	digestCacheEntries = 200000
	// ParseCacheBytes bounds the memory of the parse cache: about 48
	// agents at 1 MiB of history each, or thousands of small ones.
	ParseCacheBytes = 64 << 20
)

// New returns an Identifier for the upstream named upstreamName
// (upstream.name: two endpoints may serve one model name with different
// accounting), estimating with local, whose parse cache holds at most
// parseCacheBytes (0: no parse cache).
func New(upstreamName string, local anchor.LocalEstimator, parseCacheBytes int) *Identifier {
	return &Identifier{upstreamName: upstreamName, local: local,
		digests: newDigestCache(digestCacheEntries), parses: newParseCache(parseCacheBytes)}
}

// Parse is how a request's body was parsed: the tenant, its parse cache
// key, and the entry whose first reused messages it took (nil: none).
type Parse struct {
	// Tenant is the request's tenant (Tenant).
	Tenant string
	key    parseKey
	from   *parseEntry
	reused int
}

// ParseChat parses a chat-completions body of tenant after the tenant's
// most similar recent body when one shares leading messages with it:
// those are not scanned, hashed or chained again. header is the client's
// conversation header value ("" when none).
func (x *Identifier) ParseChat(tenant, header string, body []byte) (*chat.Request, Parse, error) {
	p := Parse{Tenant: tenant, key: x.parses.key(tenant, header, body)}
	p.from = x.parses.lookup(p.key, body)
	var snap *chat.Snapshot
	if p.from != nil {
		snap = p.from.snap
	}
	req, reused, err := chat.ParseAfter(body, snap)
	p.reused = reused
	if reused == 0 {
		p.from = nil
	}
	return req, p, err
}

// Reused is how many leading messages the body shares with the entry it
// was parsed after.
func (p Parse) Reused() int { return p.reused }

// PairingClean reports whether view is known to pass the pairing check: it
// is all, and only, the parsed messages of req, and those are the
// messages of the entry the body was parsed after, which passed it (the
// check is a function of the messages' bytes; an entry remembers only a
// clean verdict).
func (p Parse) PairingClean(req *chat.Request, view []chat.Message) bool {
	e := p.from
	return e != nil && e.pairingClean && p.reused == len(view) && e.snap.Len() == len(view) && SameView(view, req.Messages)
}

// conversationID returns the opaque id of the request's conversation: the
// first of compaction.conversation_headers the client sends (hashed: a
// header value never becomes a key), else the canonical digest of the
// model identity, the tools (idSeed) and the first user message — not the
// system prompt, which real agents rebuild per request with a date or an
// environment block (DESIGN § Compaction).
func conversationID(header string, idSeed anchor.Digest, msgs []chat.Message) string {
	if header != "" {
		return HeaderID(header)
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

// HeaderID is the opaque id of the conversation a client's
// conversation header value names (hashed: a header value never becomes
// a key).
func HeaderID(value string) string {
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
func (x *Identifier) idSeed(req *chat.Request, in *seedInput, seed anchor.Digest) anchor.Digest {
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
	return anchor.Seed(x.ModelIdentity(req.Model), fields)
}

// Header is the value of the first of headers the request
// carries, "" when none. The header names are distinct per match: the
// value "X-Compactproxy-Conversation: a" and "X-Session-Id: a" are the same
// conversation id on purpose (an agent that moves from one to the other
// keeps its state).
func Header(h http.Header, headers []string) string {
	for _, name := range headers {
		if v := h.Get(name); v != "" {
			return v
		}
		// Codex's session_id: a header map not built by a canonicalizing
		// reader keeps the spelling as written.
		if vs := h[name]; len(vs) > 0 && vs[0] != "" {
			return vs[0]
		}
	}
	return ""
}

// Key binds a conversation to its tenant: one tenant's state never
// applies to another's request.
func Key(tenant, id string) string { return tenant + "|" + id }

// ModelIdentity is upstream.name + the requested model: two endpoints may
// serve the same bare name with different accounting.
func (x *Identifier) ModelIdentity(model string) string {
	return x.upstreamName + "\x00" + model
}

// Seed computes d0 for a request (the start of its digest chain).
func (x *Identifier) Seed(req *chat.Request) anchor.Digest {
	fields := map[string][]byte{}
	for _, f := range req.Fields {
		for _, k := range anchor.PromptFields {
			if f.Key == k {
				fields[k] = f.Value
			}
		}
	}
	return anchor.Seed(x.ModelIdentity(req.Model), fields)
}

// recordSeed is the seed of the request's compaction records: seed itself
// unless the request sends a prompt field past anchor.HistoryFields
// (reasoning, text, include, thinking), which changes what the provider
// counts but not which history a summary or trim applies to.
func (x *Identifier) recordSeed(in *seedInput, seed anchor.Digest) anchor.Digest {
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
	return anchor.Seed(x.ModelIdentity(in.model), fields)
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
func (x *Identifier) seedFor(req *chat.Request, in *seedInput, e *parseEntry) anchor.Digest {
	if len(anchor.PromptFields) <= len(in.values) && e != nil && e.seedIn.equal(in) {
		return e.seed
	}
	return x.Seed(req)
}

// Estimator is the Estimate closure for the views of c: any view's
// digest chain, the conversation's anchors, the local estimate and the
// model's calibration fit.
func (c *Conversation) Estimator(anchors []anchor.Anchor, fit anchor.Fit) compaction.Estimator {
	memo := c.memo
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
	local anchor.LocalEstimator
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
// Messages without a digest get one, in place.
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
				out.local[i] = m.local.Tokens(msg)
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
		out.local[i] = m.local.Tokens(msg)
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

// Conversation is what one request knows about its conversation: its
// opaque id, the model identity, the state key (tenant-bound) and the
// chain memo that every view of this request shares.
type Conversation struct {
	// ID is the opaque conversation id (X-Compactproxy-Conversation-Id).
	ID string
	// Key is the conversation's state key, bound to its tenant.
	Key string
	// Identity is the model identity (ModelIdentity).
	Identity string
	memo     *chainMemo
	// recordSeed starts the records' chain (RecordChain); zero: memo's seed.
	recordSeed anchor.Digest
	seedIn     seedInput
}

// Open hashes view's messages (cached per tenant) and derives the
// conversation's id and state key for req, whose body was parsed as p;
// header is the client's conversation header value ("" when none). The
// error is a digest failure, for the caller to log: the conversation is
// usable all the same.
func (x *Identifier) Open(header string, req *chat.Request, p Parse, view []chat.Message) (*Conversation, error) {
	err := x.digests.hash(p.Tenant, view)
	in := seedInputOf(req)
	memo := &chainMemo{local: x.local, seed: x.seedFor(req, &in, p.from)}
	id := conversationID(header, x.idSeed(req, &in, memo.seed), view)
	// The messages the body shares with the tenant's earlier body keep
	// that body's chain when the seed (model and prompt fields) is the same.
	if e, n := p.from, p.reused; e != nil && e.seed == memo.seed && len(e.chain.chain) > n && n <= len(req.Messages) {
		memo.known = append(memo.known, e.chain.prefix(n, req.Messages))
	}
	return &Conversation{
		ID:         id,
		Key:        Key(p.Tenant, id),
		Identity:   x.ModelIdentity(req.Model),
		memo:       memo,
		recordSeed: x.recordSeed(&in, memo.seed),
		seedIn:     in,
	}, err
}

// Detached is c with a chain memo of its own that knows no view yet: for
// work that outlives the request (its views point into a pooled body).
func (c *Conversation) Detached() *Conversation {
	d := *c
	d.memo = &chainMemo{local: c.memo.local, seed: c.memo.seed}
	return &d
}

// Chain is view's digest chain (one longer than view) and its messages'
// local estimates.
func (c *Conversation) Chain(view []chat.Message) ([]anchor.Digest, []int, error) {
	return c.memo.chain(view)
}

// RecordChain is the planner's chain of view: its records and lineages
// are keyed after the leading system messages (compaction.RecordChain), so
// a system prompt that changes per request keeps them.
func (c *Conversation) RecordChain(view []chat.Message) ([]anchor.Digest, error) {
	k, err := c.memo.view(view)
	if err != nil {
		return nil, err
	}
	seed := c.recordSeed
	if seed == (anchor.Digest{}) {
		seed = c.memo.seed
	}
	return compaction.RecordChain(seed, k.digests, compaction.LeadingSystem(view)), nil
}

// Remember keeps req's parsed messages, digests and chain for the
// tenant's next request (the parse cache), unless the entry it was parsed
// after already holds exactly them. clean says the parsed messages passed
// the pairing check; client is the client's view after pairing: the
// chain is kept only when it is the parsed messages (repair changes it).
func (x *Identifier) Remember(c *Conversation, req *chat.Request, p Parse, clean bool, client []chat.Message) {
	if e := p.from; e != nil && p.reused == len(req.Messages) && e.snap.Len() == len(req.Messages) &&
		e.seed == c.memo.seed && e.seedIn.equal(&c.seedIn) && len(e.chain.chain) == len(req.Messages)+1 && e.pairingClean == clean {
		return // nothing new: the entry stays (lookup marked it used)
	}
	// A snapshot's messages carry their digests: the next request shares
	// them as they are and never writes them (chat.ParseAfter). In pairing
	// repair mode the view was a copy, so the parsed messages may still
	// lack theirs.
	if err := x.digests.hash(p.Tenant, req.Messages); err != nil {
		return
	}
	snap := req.Snapshot()
	if snap == nil {
		return
	}
	e := &parseEntry{key: p.key, snap: snap, seed: c.memo.seed, seedIn: c.seedIn.clone(), pairingClean: clean}
	if SameView(client, req.Messages) {
		if k, err := c.memo.view(req.Messages); err == nil {
			// Without the idents: they name this request's (pooled) body.
			e.chain = chainKnown{digests: k.digests, chain: k.chain, local: k.local}
		}
	}
	x.parses.store(e, p.from, req.Body)
}

// SameView reports whether two views are the same messages (same bytes).
func SameView(a, b []chat.Message) bool {
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
