package compaction

import (
	"encoding/binary"
	"slices"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// MaxLineages is how many record lineages a conversation keeps; beyond it
// the least recently saved one is evicted.
const MaxLineages = 8

// Lineage is the compaction state of one history within a conversation.
// Two histories can share a conversation id (swarm workers started from one
// template: the derived id, made of the leading system messages and the
// first user message, cannot tell them apart). Each keeps its own records,
// latch and throttle, matched by the digest chain of the history they apply
// to, so neither overwrites the other's (DESIGN § Compaction).
//
// The planner sees one lineage's State (Input.State, Output.State); the
// proxy selects the lineage with SelectLineage and stores the result with
// SaveLineage. Anchors are kept per conversation, apart from lineages: they
// are matched by digest already, and the response path writes them while a
// summarize of the same conversation may be running.
type Lineage struct {
	// ID names the lineage (for the summarize lease): derived from the
	// client chain's last digest when the lineage was first saved.
	ID uint64
	// TipLen and Tip are the client chain's position and digest d[TipLen]
	// at the last save: a later request of the same history extends it.
	TipLen int
	Tip    anchor.Digest
	// Gen counts saves; a save computed from generation g applies only
	// while the lineage is still at g (see SaveLineage).
	Gen uint32
	// Used is the Unix time of the last save (the LRU order).
	Used int64
	// State is the lineage's records, latch and throttle; its Anchors are
	// unused (they live in the conversation).
	State State
}

// LineageID derives a lineage id from a client chain: its last digest.
func LineageID(chain []anchor.Digest) uint64 {
	if len(chain) == 0 {
		return 0
	}
	d := chain[len(chain)-1]
	return binary.BigEndian.Uint64(d[:8])
}

// covers reports whether the client chain passes through d at position n.
func covers(chain []anchor.Digest, n int, d anchor.Digest) bool {
	return n > 0 && n < len(chain) && chain[n] == d
}

// SelectLineage returns the index in ls of the lineage whose records apply
// to the request whose client chain is chain (d0..dn), or -1 for a new
// lineage. First choice: the lineage whose tip the chain extends (the
// deepest tip wins: the most specific history). Else, for a client that
// edited or rewound its history past the tip, the lineage with the deepest
// record (summary, drop, trim) the chain still matches. Ties go to the most
// recently used.
func SelectLineage(ls []Lineage, chain []anchor.Digest) int {
	best, bestDepth := -1, -1
	pick := func(i, depth int) {
		if depth > bestDepth || (depth == bestDepth && ls[i].Used > ls[best].Used) {
			best, bestDepth = i, depth
		}
	}
	for i := range ls {
		if covers(chain, ls[i].TipLen, ls[i].Tip) {
			pick(i, ls[i].TipLen)
		}
	}
	if best >= 0 {
		return best
	}
	for i := range ls {
		st := &ls[i].State
		if s := st.Summary; s != nil && covers(chain, s.Cut, s.Head) {
			pick(i, s.Cut)
		}
		for _, d := range st.Drops {
			if covers(chain, d.To, d.Prefix) {
				pick(i, d.To)
			}
		}
		for _, t := range st.Trims {
			if covers(chain, t.covers()+1, t.Prefix) {
				pick(i, t.covers()+1)
			}
		}
	}
	return best
}

// MergeBackground returns ls with a background run's outcome merged into
// the lineage of l.ID as it is stored now: its Pending summary and its
// summarize bookkeeping (latch, throttle), whatever the requests that ran
// meanwhile saved (their trims, drops and summary stay). A background
// summary takes seconds; replacing the lineage only when nothing was saved
// since would discard it whenever the conversation went on meanwhile, and
// the request that crosses the trigger would pay for a summary of its own.
// A lineage not stored yet is added as l.
func MergeBackground(ls []Lineage, l Lineage) []Lineage {
	i := slices.IndexFunc(ls, func(x Lineage) bool { return x.ID == l.ID })
	if i < 0 {
		out, _ := SaveLineage(ls, l, 0, true)
		return out
	}
	cur := ls[i]
	st := cur.State.clone()
	if p := l.State.Pending; p != nil {
		v := *p
		st.Pending = &v
	}
	st.Latched, st.LatchCount = l.State.Latched, l.State.LatchCount
	if l.State.LastAttempt.After(st.LastAttempt) {
		st.LastAttempt, st.LastAttemptCount = l.State.LastAttempt, l.State.LastAttemptCount
	}
	cur.State = st
	cur.Used = max(cur.Used, l.Used)
	out, _ := SaveLineage(ls, cur, cur.Gen, true)
	return out
}

// SaveLineage returns ls with l stored in it (ls itself is not modified).
// l replaces the lineage of the same ID only while that one is still at
// generation base, the one l was computed from, unless force is set (a
// summarize result supersedes what others stored meanwhile: it cost a
// model call, and the next request re-applies it). Otherwise l is stale and
// ls is returned unchanged with ok false. A new ID is added; beyond
// MaxLineages the least recently used lineage is evicted. The stored
// lineage is at generation base+1 (or one past the replaced one's).
func SaveLineage(ls []Lineage, l Lineage, base uint32, force bool) (out []Lineage, ok bool) {
	l.State.Anchors = nil
	l.State = l.State.clone()
	i := slices.IndexFunc(ls, func(x Lineage) bool { return x.ID == l.ID })
	if i >= 0 {
		if ls[i].Gen != base && !force {
			return ls, false
		}
		l.Gen = ls[i].Gen + 1
		out = slices.Clone(ls)
		out[i] = l
		return out, true
	}
	l.Gen = base + 1
	out = append(slices.Clone(ls), l)
	for len(out) > MaxLineages {
		old := 0
		for j := range out {
			if out[j].Used < out[old].Used {
				old = j
			}
		}
		out = slices.Delete(out, old, old+1)
	}
	return out, true
}

// WithAnchors returns the lineage's State with the conversation's anchors:
// the Input.State the planner is given.
func (l Lineage) WithAnchors(anchors []anchor.Anchor) State {
	st := l.State
	st.Anchors = anchors
	return st
}

// MergeAnchor returns anchors with a added to them (State.AddAnchor's rule: most
// recent first, at most MaxAnchors, the same prefix replaced); anchors
// itself is not modified.
func MergeAnchor(anchors []anchor.Anchor, a anchor.Anchor) []anchor.Anchor {
	st := State{Anchors: anchors}
	st.AddAnchor(a)
	return st.Anchors
}

// recordDomain separates record chains from anchor chains of the same
// seed (a view without system messages would otherwise chain alike).
var recordDomain = anchor.Digest{'c', 'o', 'm', 'p', 'a', 'c', 't', 'i', 'o', 'n', '/', 'r', 'e', 'c', 'o', 'r', 'd', 's'}

// RecordChain is the chain the planner's records, latch, throttle and
// lineages are keyed by (Input.Chain): the seed (model identity and the
// prompt fields: tools, ...), then the client's messages after the lead
// leading system/developer messages. The system prompt is the fixed part,
// never summarized or dropped, and real agents rebuild it per request (a
// date, a clock, a git status): keyed after it, a conversation keeps its
// records while it changes (DESIGN § Compaction). digests are the view's
// message digests; the result has one more entry, indexed like the view's
// anchor chain (rc[i] for i ≤ lead is the start of the record chain).
// Anchors keep the full chain: the system prompt changes the count.
func RecordChain(seed anchor.Digest, digests []anchor.Digest, lead int) []anchor.Digest {
	out := make([]anchor.Digest, len(digests)+1)
	start := anchor.Link(seed, recordDomain)
	lead = min(max(lead, 0), len(digests))
	for i := 0; i <= lead; i++ {
		out[i] = start
	}
	for i := lead; i < len(digests); i++ {
		out[i+1] = anchor.Link(out[i], digests[i])
	}
	return out
}

// LeadingSystem is the number of leading system/developer messages of a
// view: the fixed part's messages.
func LeadingSystem(view []chat.Message) int {
	n := 0
	for n < len(view) && isSystemRole(view[n].Role) {
		n++
	}
	return n
}
