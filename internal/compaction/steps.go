package compaction

// step names a thing one Plan did that a later step or finish reads: the
// run's log of what it took, in place of a flag per step.
type step uint16

const (
	// stepTrimmed: the forwarded plan carries trims not re-applied from
	// the state (finish notes it).
	stepTrimmed step = 1 << iota
	// stepSummarized: a summary was made now (accepted from the answer).
	stepSummarized
	// stepDropped: turns were dropped now.
	stepDropped
	// stepShrunk: the last resort excerpted the summary in the view.
	stepShrunk
	// stepPendingTaken: the ready background summary was applied.
	stepPendingTaken
	// stepGuarded: the progress guard withheld a summary (the view is
	// within the budget: the verbatim tail stays verbatim).
	stepGuarded
	// stepPassedGuard: the guard let this compaction through before the
	// trims (trims do not take that back).
	stepPassedGuard
	// stepDue: a summary is due and the view does not carry it
	// (ActionSummarizePending): the need asks for it, or shadow mode only
	// reports it.
	stepDue
	// stepDiscarded: the produced view failed the invariant; the client's
	// view is forwarded and nothing new is stored.
	stepDiscarded
	// stepDeduped: the forwarded plan carries pointers (dedupe) not
	// re-applied from the state (finish notes it, as for trims).
	stepDeduped
	// stepMasked: likewise for placeholders (mask).
	stepMasked
)

// steps is the log of the steps a run took.
type steps step

func (s *steps) add(x step)    { *s |= steps(x) }
func (s *steps) forget(x step) { *s &^= steps(x) }

// has tells whether the run took x (any of them, when x names several).
func (s steps) has(x step) bool { return s&steps(x) != 0 }
