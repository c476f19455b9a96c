package compaction

import (
	"slices"
)

// dropUnit is a whole turn: a message that is not a tool result and the
// tool results that directly follow it, client positions [from, to).
type dropUnit struct{ from, to int }

// dropTurns is step 4: it drops the oldest whole turns after the system
// messages (after the summary when one applies), first from the head down
// to the target; when that still leaves the view over the budget, from the
// tail too (never the final message's turn), down to the budget. Never
// dropped: the conversation's first user message (the task) and the most
// recent user message (the instruction being worked on). Every dropped
// range starts and ends at a message that is not a tool result
// (pairing-safe), and the messages it brings together never are two user
// or two assistant messages.
func (r *run) dropTurns(p *plan, cur, budget, target int) int {
	s := p.headStart(r.lead)
	final := r.n - 1
	for final > 0 && isToolRole(r.msgs[final].Role) {
		final--
	}
	task, last := -1, -1
	for i := r.lead; i < r.n; i++ {
		if r.msgs[i].Role == "user" {
			if task < 0 {
				task = i
			}
			last = i
		}
	}
	var units []dropUnit
	for i := s; i < final; {
		j := i + 1
		for j < final && isToolRole(r.msgs[j].Role) {
			j++
		}
		if i != task && i != last && !isToolRole(r.msgs[i].Role) {
			units = append(units, dropUnit{i, j})
		}
		i = j
	}
	if len(units) == 0 {
		return cur
	}
	// The drop sets, oldest units first: each adds the next unit unless
	// that would bring two user or two assistant messages together (the
	// unit is kept then, and later ones may still go).
	valid := func(q plan) bool {
		for _, d := range q.drops {
			before, after := r.roleBefore(q, d.From), r.msgs[d.To].Role
			if (before == "user" || before == "assistant") && before == after {
				return false
			}
		}
		return true
	}
	var sets []plan // sets[k] drops k+1 units
	headSets := 0
	var chosen []dropUnit
	for _, u := range units {
		try := append(slices.Clone(chosen), u)
		q := *p
		q.drops = nil
		for _, c := range try {
			if m := len(q.drops); m > 0 && q.drops[m-1].To == c.from {
				q.drops[m-1].To = c.to
				continue
			}
			q.drops = append(q.drops, Drop{From: c.from, To: c.to})
		}
		if !valid(q) {
			continue
		}
		if r.chain {
			for i := range q.drops {
				q.drops[i].Prefix = r.in.Chain[q.drops[i].To]
			}
		}
		chosen = try
		sets = append(sets, q)
		if u.to <= r.tail {
			headSets = len(sets)
		}
	}
	// pick returns the first of sets[:limit] whose view is at goal or
	// below, else the last (the estimate falls as more units go).
	pick := func(limit, goal int) (plan, int) {
		lo, hi := 0, limit-1
		for lo < hi {
			mid := (lo + hi) / 2
			if r.est(r.view(sets[mid])) <= goal {
				hi = mid
			} else {
				lo = mid + 1
			}
		}
		return sets[lo], r.est(r.view(sets[lo]))
	}
	if headSets > 0 {
		if q, e := pick(headSets, target-1); e < cur {
			*p, cur = q, e
			r.newDrop = true
			if cur <= budget {
				return cur
			}
		}
	}
	if len(sets) > headSets {
		if q, e := pick(len(sets), budget); e < cur {
			*p, cur = q, e
			r.newDrop = true
		}
	}
	return cur
}

// roleBefore is the role of the forwarded message just before client
// position i under q ("" at the start).
func (r *run) roleBefore(q plan, i int) string {
	for j := i - 1; j >= 0; j-- {
		if q.sum != nil && j < q.sum.Cut && j >= q.sum.Lead {
			b := r.block(q.sum)
			return b[len(b)-1].Role
		}
		if q.dropped(j) {
			continue
		}
		return r.msgs[j].Role
	}
	return ""
}
