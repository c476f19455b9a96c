package compaction

import (
	"github.com/compactproxy/compactproxy/internal/chat"
)

// plan is a set of compactions applied to the client's messages.
type plan struct {
	sum   *Summary
	trims map[int]int // client position → Trim.Keep
	drops []Drop      // ascending, disjoint
}

// headStart is the first client position after the leading system
// messages (lead) that the plan forwards verbatim: the summary's cut when
// one applies.
func (p plan) headStart(lead int) int {
	if p.sum != nil {
		return p.sum.Cut
	}
	return lead
}

func (p plan) empty() bool { return p.sum == nil && len(p.trims) == 0 && len(p.drops) == 0 }

func (p plan) withTrims(idx []int, keep int) plan {
	q := p
	q.trims = make(map[int]int, len(p.trims)+len(idx))
	for k, v := range p.trims {
		q.trims[k] = v
	}
	for _, i := range idx {
		q.trims[i] = keep
	}
	return q
}

// dropped tells whether client position i lies in one of the plan's drops.
func (p plan) dropped(i int) bool {
	for _, d := range p.drops {
		if i >= d.From && i < d.To {
			return true
		}
	}
	return false
}

// reapply returns the stored compactions that still match the client's
// chain: the summary whose head digest matches at its cut, trims whose
// message (and everything before it) is unchanged, the drops likewise.
func (r *run) reapply() plan {
	p := plan{trims: map[int]int{}}
	if !r.chain {
		return p
	}
	ch := r.in.Chain
	if s := r.st.Summary; s != nil && s.Lead == r.lead && s.Cut > s.Lead && s.Cut < r.n && ch[s.Cut] == s.Head {
		p.sum = r.rejoined(*s)
	}
	for _, t := range r.st.Trims {
		if t.Index < 0 || t.Index >= r.n-1 || t.covers() >= r.n || ch[t.covers()+1] != t.Prefix {
			continue // the final message is never trimmed
		}
		if p.sum != nil && t.Index < p.sum.Cut {
			continue
		}
		if _, ok := r.trimmed(t.Index, t.Keep); ok {
			p.trims[t.Index] = t.Keep
		}
	}
	lo := p.headStart(r.lead)
	for _, d := range r.st.Drops {
		if d.From < lo || d.From >= d.To || d.To >= r.n || ch[d.To] != d.Prefix {
			continue
		}
		p.drops = append(p.drops, d)
		lo = d.To
	}
	return p
}

// view builds the messages a plan forwards.
func (r *run) view(p plan) []chat.Message {
	return r.render(make([]chat.Message, 0, r.n+3), p, 0, r.n)
}

// render appends to out what client positions [from, to) forward under p:
// the summary block in place of the messages it replaces, nothing for
// dropped messages, excerpts for trimmed ones, the client's own message
// otherwise. Linear in to − from (the drops are ascending and disjoint).
func (r *run) render(out []chat.Message, p plan, from, to int) []chat.Message {
	di := 0
	for i := from; i < to; i++ {
		if p.sum != nil && i >= p.sum.Lead && i < p.sum.Cut {
			if i == p.sum.Lead {
				out = append(out, r.block(p.sum)...)
			}
			i = p.sum.Cut - 1
			continue
		}
		for di < len(p.drops) && p.drops[di].To <= i {
			di++
		}
		if di < len(p.drops) && i >= p.drops[di].From {
			i = p.drops[di].To - 1
			continue
		}
		if keep, ok := p.trims[i]; ok {
			m, _ := r.trimmed(i, keep)
			out = append(out, m)
			continue
		}
		out = append(out, r.msgs[i])
	}
	return out
}

func (r *run) block(s *Summary) []chat.Message {
	b, ok := r.blocks[s]
	if !ok {
		b = summaryBlock(s, r.msgs)
		r.blocks[s] = b
	}
	return b
}

// trimmed returns message i as a Trim record of keep renders it: the
// excerpt, or step 0's placeholder or pointer when keep ≤ 0 (cached for
// this call).
func (r *run) trimmed(i, keep int) (chat.Message, bool) {
	k := [2]int{i, keep}
	if m, ok := r.excerpts[k]; ok {
		return m, true
	}
	var m chat.Message
	var ok bool
	if keep <= keepMask {
		m, ok = r.reduced(i, keep)
	} else {
		m, ok = trimmed(r.msgs[i], keep)
	}
	if ok {
		r.excerpts[k] = m
	}
	return m, ok
}

// headView is the head [from, cut) as it is forwarded under p: trimmed
// results as excerpts, dropped messages left out (a summarize call never
// sends a message again that an earlier compaction removed).
func (r *run) headView(p plan, from, cut int) []chat.Message {
	return r.render(make([]chat.Message, 0, cut-from), p, from, cut)
}

// prefixView is the view p forwards, up to client position cut. A drop
// that reaches past the cut is not applied before it (its messages are
// the head's, not yet removed).
func (r *run) prefixView(p plan, cut int) []chat.Message {
	q := p
	q.drops = nil
	for _, d := range p.drops {
		if d.To <= cut {
			q.drops = append(q.drops, d)
		}
	}
	return r.render(make([]chat.Message, 0, cut+3), q, 0, cut)
}

// withSummary replaces the head of base by s under the trims after the
// cut; the drops after the cut are kept, those in the head are covered by
// it.
func withSummary(base plan, s *Summary) plan {
	q := plan{sum: s, trims: map[int]int{}}
	for i, k := range base.trims {
		if i >= s.Cut {
			q.trims[i] = k
		}
	}
	for _, d := range base.drops {
		if d.From >= s.Cut {
			q.drops = append(q.drops, d)
		}
	}
	return q
}
