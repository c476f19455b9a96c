package compaction

import (
	"slices"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
)

// MaxAnchors is how many anchors a conversation keeps (most recent first):
// shared by its lineages (anchors are matched by digest), so two histories
// alternating in one conversation each keep their recent ones.
const MaxAnchors = 4

// State is one conversation lineage's stored state (see Lineage) plus the
// conversation's anchors. The proxy loads it, passes it in Input.State and
// saves Output.State when Output.StateChanged. It holds no
// message copies: records are keyed by digests of the client's chain and
// name client positions; the only texts are the summary and nothing else
// (trim excerpts are recomputed from the client's message, identically,
// because they are a pure function of the message and Trim.Keep).
//
// Positions are indexes into Input.Messages (the provider-visible view,
// UI-only messages removed), not chat.Message.Index.
//
// Size without the summary text and trim records, as the bolt and redis
// backends encode it (internal/store codec): 4 anchors (≤ 52 B each), and per
// lineage its tip and bookkeeping (56 B), the summary's metadata (46 B),
// one drop record (41 B), latch and throttle (22 B): 8 full lineages and 4
// anchors are about 1.6 KiB, under DESIGN's 2 KiB (measured in
// internal/store's size tests).
type State struct {
	// Anchors are provider measurements of forwarded views, most recent
	// first, at most MaxAnchors; maintained by the proxy through AddAnchor.
	Anchors []anchor.Anchor

	// Summary is the stored summary, nil when none.
	Summary *Summary
	// Pending is a summary made in the background (PassBackground)
	// and not applied yet: the request that crosses the trigger applies it
	// instead of calling the summarizer, when its head still matches.
	Pending *Summary
	// Trims are the tool results that are forwarded as excerpts, in index
	// order.
	Trims []Trim
	// Drops are the ranges of messages that are not forwarded, ascending
	// and disjoint (a drop keeps the task and the latest instruction, so it
	// may be split around them).
	Drops []Drop

	// Latched is true after a failed summarize: until the provider-visible
	// message count reaches LatchCount + Config.LatchGrowth, the planner stays
	// on the trim-only path. A successful summarize releases it.
	Latched    bool
	LatchCount int
	// LastAttempt and LastAttemptCount are the time and the provider-visible
	// message count of the last summarize attempt (the throttle).
	LastAttempt      time.Time
	LastAttemptCount int
}

// Summary is a summary that replaced the client's messages [Lead, Cut).
type Summary struct {
	// Cut is the first client message kept after the summary (the start of
	// the verbatim tail when it was made); Head is the client chain's d[Cut]
	// at that time, so the summary applies to every later request whose
	// first Cut messages are the same (same model identity and tools too,
	// since the chain's seed carries them).
	Cut  int
	Head anchor.Digest
	// Lead is the number of leading system/developer messages kept before
	// the summary.
	Lead int
	// Text is the summarizer's answer (what the next summarize folds).
	Text string
	// Tokens bounds Text in the upstream's tokens: the limit its
	// summarize call was given when the summarizer is the upstream's model
	// (Input.SummaryInUpstreamTokens); 0 when unknown.
	Tokens int `json:",omitempty"`
	// Ack is true when an assistant acknowledgement follows the summary
	// message (the next message is a user message).
	Ack bool
	// Ask is the client position of the most recent user message when it
	// lies in the summarized head, re-inserted verbatim after the summary
	// (and the acknowledgement); -1 when none. AskInline (no longer made;
	// kept so summaries stored by earlier versions render as they did): the
	// ask is quoted at the end of the summary message instead.
	Ask       int
	AskInline bool
}

// Trim is the record of one tool result forwarded reduced: as a head/tail
// excerpt (Keep > 0), or by step 0 (no model call) as a placeholder naming
// its call (Keep == 0, a mask) or a pointer to the later result that
// repeats it (Keep < 0, a dedupe: the later result is at Index − Keep).
// Masks and pointers are stored as trims so every backend keeps them and
// they are re-applied byte-for-byte like excerpts.
type Trim struct {
	// Index is the client position of the tool message; Prefix is the
	// client chain's d[Index+1], which covers the message and everything
	// before it (for a pointer d[Index−Keep+1]: it covers the later result
	// too).
	Index  int
	Prefix anchor.Digest
	// Keep is the number of text bytes the excerpt keeps (two thirds from
	// the head, one third from the tail); 0 for a mask; minus the distance
	// to the later result for a pointer.
	Keep int
}

// Masked tells whether the record is a mask: the result is forwarded as a
// placeholder naming its call.
func (t Trim) Masked() bool { return t.Keep == keepMask }

// PointsTo returns the client position of the later result a dedupe
// record points to; ok is false for an excerpt or a mask.
func (t Trim) PointsTo() (later int, ok bool) {
	if t.Keep < 0 {
		return t.Index - t.Keep, true
	}
	return 0, false
}

// covers is the last client position the record depends on: the message,
// or for a pointer the later result it names.
func (t Trim) covers() int {
	if t.Keep < 0 {
		return t.Index - t.Keep
	}
	return t.Index
}

// Drop is the record of a range of client messages [From, To) that is not
// forwarded.
// Prefix is the client chain's d[To].
type Drop struct {
	From, To int
	Prefix   anchor.Digest
}

// AddAnchor adds a measurement: most recent first, at most MaxAnchors,
// and an earlier anchor of the same prefix (PrefixLen and Prefix) is
// replaced.
func (s *State) AddAnchor(a anchor.Anchor) {
	out := make([]anchor.Anchor, 0, MaxAnchors)
	out = append(out, a)
	for _, b := range s.Anchors {
		if len(out) == MaxAnchors {
			break
		}
		if b.PrefixLen == a.PrefixLen && b.Prefix == a.Prefix {
			continue
		}
		out = append(out, b)
	}
	s.Anchors = out
}

// clone returns a copy of s that shares no mutable memory with it.
func (s State) clone() State {
	c := s
	c.Anchors = slices.Clone(s.Anchors)
	c.Trims = slices.Clone(s.Trims)
	if s.Summary != nil {
		v := *s.Summary
		c.Summary = &v
	}
	c.Drops = slices.Clone(s.Drops)
	if s.Pending != nil {
		v := *s.Pending
		c.Pending = &v
	}
	return c
}
