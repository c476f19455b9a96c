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
	units := r.dropUnits(p.headStart(r.lead))
	if len(units) == 0 {
		return cur
	}
	ds := r.dropSets(*p, units)
	if ds.head > 0 {
		if q, e := r.pickDrop(*p, ds, ds.head, target-1); e < cur {
			*p, cur = q, e
			r.done.add(stepDropped)
			if cur <= budget {
				return cur
			}
		}
	}
	if len(ds.sets) > ds.head {
		if q, e := r.pickDrop(*p, ds, len(ds.sets), budget); e < cur {
			*p, cur = q, e
			r.done.add(stepDropped)
		}
	}
	return cur
}

// dropUnits lists the turns from client position start up to the final
// message's turn that may be dropped, oldest first: not the task, not the
// most recent user message.
func (r *run) dropUnits(start int) []dropUnit {
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
	for i := start; i < final; {
		j := i + 1
		for j < final && isToolRole(r.msgs[j].Role) {
			j++
		}
		if i != task && i != last && !isToolRole(r.msgs[i].Role) {
			units = append(units, dropUnit{i, j})
		}
		i = j
	}
	return units
}

// dropSet is the drop of the first units that dropSets kept: the first n
// drops, the last of them ending at lastTo.
type dropSet struct{ n, lastTo int }

// dropSets are the candidate drops, each one unit more than the one
// before: drops in their longest form, and sets[k] the one that drops k+1
// units; the first head of them lie within the head (before the tail).
type dropSets struct {
	drops []Drop
	sets  []dropSet
	head  int
}

// dropSets builds the drop sets, oldest units first: each adds the next
// unit unless that would bring two user or two assistant messages
// together (the unit is kept then, and later ones may still go). Only the
// drop a unit extends or opens can become invalid (the others and their
// neighbours are unchanged), so each unit costs O(1): drops grows in place
// and a set is its length and its last drop's end (linear in the number
// of turns; a 32 MiB body of tiny turns must not pin a core).
func (r *run) dropSets(p plan, units []dropUnit) dropSets {
	var ds dropSets
	lastBefore := "" // the role before the last drop's start
	for _, u := range units {
		after := r.msgs[u.to].Role
		merge := len(ds.drops) > 0 && ds.drops[len(ds.drops)-1].To == u.from
		before := lastBefore
		if !merge {
			before = r.roleBefore(p, u.from)
		}
		if (before == "user" || before == "assistant") && before == after {
			continue
		}
		if merge {
			ds.drops[len(ds.drops)-1].To = u.to
		} else {
			ds.drops = append(ds.drops, Drop{From: u.from, To: u.to})
			lastBefore = before
		}
		ds.sets = append(ds.sets, dropSet{len(ds.drops), u.to})
		if u.to <= r.tail {
			ds.head = len(ds.sets)
		}
	}
	return ds
}

// dropPlan is p with set k of ds dropped.
func (r *run) dropPlan(p plan, ds dropSets, k int) plan {
	q := p
	q.drops = slices.Clone(ds.drops[:ds.sets[k].n])
	q.drops[len(q.drops)-1].To = ds.sets[k].lastTo
	if r.chain {
		for i := range q.drops {
			q.drops[i].Prefix = r.in.Chain[q.drops[i].To]
		}
	}
	return q
}

// pickDrop returns the first of ds.sets[:limit] whose view is at goal or
// below, else the last (the estimate falls as more units go), with its
// estimate.
func (r *run) pickDrop(p plan, ds dropSets, limit, goal int) (plan, int) {
	lo, hi := 0, limit-1
	for lo < hi {
		mid := (lo + hi) / 2
		if r.est(r.view(r.dropPlan(p, ds, mid))) <= goal {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	q := r.dropPlan(p, ds, lo)
	return q, r.est(r.view(q))
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
