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
	// unit is kept then, and later ones may still go). Only the drop a unit
	// extends or opens can become invalid (the others and their
	// neighbours are unchanged), so each unit costs O(1): drops grows in
	// place and a set is its length and its last drop's end (linear in the
	// number of turns; a 32 MiB body of tiny turns must not pin a core).
	type dropSet struct{ n, lastTo int }
	var drops []Drop
	var sets []dropSet // sets[k] drops k+1 units
	headSets := 0
	lastBefore := "" // the role before the last drop's start
	for _, u := range units {
		after := r.msgs[u.to].Role
		merge := len(drops) > 0 && drops[len(drops)-1].To == u.from
		before := lastBefore
		if !merge {
			before = r.roleBefore(*p, u.from)
		}
		if (before == "user" || before == "assistant") && before == after {
			continue
		}
		if merge {
			drops[len(drops)-1].To = u.to
		} else {
			drops = append(drops, Drop{From: u.from, To: u.to})
			lastBefore = before
		}
		sets = append(sets, dropSet{len(drops), u.to})
		if u.to <= r.tail {
			headSets = len(sets)
		}
	}
	// planOf is the plan that drops set k's units.
	planOf := func(k int) plan {
		q := *p
		q.drops = slices.Clone(drops[:sets[k].n])
		q.drops[len(q.drops)-1].To = sets[k].lastTo
		if r.chain {
			for i := range q.drops {
				q.drops[i].Prefix = r.in.Chain[q.drops[i].To]
			}
		}
		return q
	}
	// pick returns the first of sets[:limit] whose view is at goal or
	// below, else the last (the estimate falls as more units go).
	pick := func(limit, goal int) (plan, int) {
		lo, hi := 0, limit-1
		for lo < hi {
			mid := (lo + hi) / 2
			if r.est(r.view(planOf(mid))) <= goal {
				hi = mid
			} else {
				lo = mid + 1
			}
		}
		q := planOf(lo)
		return q, r.est(r.view(q))
	}
	if headSets > 0 {
		if q, e := pick(headSets, target-1); e < cur {
			*p, cur = q, e
			r.done.add(stepDropped)
			if cur <= budget {
				return cur
			}
		}
	}
	if len(sets) > headSets {
		if q, e := pick(len(sets), budget); e < cur {
			*p, cur = q, e
			r.done.add(stepDropped)
		}
	}
	return cur
}

// roleBefore is the role of the forwarded message just before client
// position i when nothing before i is dropped: the summary block's last
// message when i is the summary's cut, else the client's message ("" at
// the start).
func (r *run) roleBefore(q plan, i int) string {
	j := i - 1
	if j < 0 {
		return ""
	}
	if q.sum != nil && j < q.sum.Cut && j >= q.sum.Lead {
		b := r.block(q.sum)
		return b[len(b)-1].Role
	}
	return r.msgs[j].Role
}
