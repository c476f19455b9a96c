// Package compaction decides, for one view of a conversation, whether and how
// to compact it so it fits the model's window, climbing a ladder from cheap
// to costly — dedupe, mask, trim, summarize with a verbatim tail, drop, last
// resort — reusing stored compactions, latching after failures, throttling. It is
// pure logic: standard library and the sibling pure packages only, no
// context, no clock, nothing that calls out. Planner.Plan is the one entry
// point (requests, overflow recovery, previews and background summaries are
// Passes of it); it decides and never acts: when a summary is needed its
// Output.Need says what to summarize, how large and in what shape, the
// caller obtains it and plans the same Input again with the answer in
// Input.Summary (etcd raft's Step/Ready: decide, then do).
//
// # The life cycle of a decision
//
// Every caller (a request, its overflow recovery, a preview, a background
// summary after a response) runs the same loop, once:
//
//	out := planner.Plan(in)                      // decide
//	if out.Need != nil {                          // a summary is due
//		text, tokens, err := summarize(*out.Need) // obtain it: the one model call
//		in.Summary = compaction.ResultFor(out.Need, text, tokens, err, canceled)
//		out = planner.Plan(in)                    // plan the same Input again
//	}
//	if out.StateChanged {
//		save(out.State)                           // commit: SaveLineage, then the store
//	}
//	forward(out.Messages)
//
// A dry run (a preview) stops after the first Plan; a caller that cannot
// obtain the summary now forwards the first Plan's Messages, which fit
// without it. internal/driver is this loop, written once, with what
// surrounds it (loading the state, selecting the lineage, one summary per
// lineage, the store's lease, storing the result): every caller, the
// planner's request-level tests included, goes through it.
//
// Inside one Plan the steps run in this order, each in its own function:
// re-apply what is stored (reapply), size the view and its thresholds
// (decision); a background pass goes to presummarize; over the trigger,
// extend the tail (extendTail), step 0 dedupe (dedupe, reductions), the
// progress guard (summaryWithheld), step 0 mask (mask), step 1 trim (trimCandidates, applyTrims), step 2 summarize (sizeSummary:
// the cut and its room, refoldCut; readyPending; guardHolds; gate: latch
// and throttle; then shadow's report, the request or accept), step 4
// excerpts, then the last resort (overBudget: tight excerpts, shrinking
// the summary, dropTurns, excerpts of the final turn); finish checks the
// invariant and reads the log of steps taken (steps.go) into the Output,
// with what each step removed and whether the change resets the
// provider's cache (accounting). The specification of each step is a
// script in testdata/*.txt (dedupe, mask, trim,
// summarize, refold, guard, drop, lastresort, recover, shadow, invariant,
// and the background, latch, throttle and lineage rules), run by
// TestScripts and rewritten from the planner's output with -update.
//
// # Glossary
//
// As the planner uses the words:
//
//   - view: the messages of one request as the provider sees them (UI-only
//     items removed); the client's view comes in, the forwarded view goes
//     out. Positions are indexes into the client's view.
//   - lead: the leading system/developer messages, never compacted.
//   - fixed part (F): the lead and the request's overhead (tools, template)
//     as estimated: what no compaction can shrink.
//   - budget: the window less the reserved output (Budget). room: budget − F,
//     the share compaction works in; trigger and target are F plus
//     trigger_ratio and target_ratio of the room.
//   - tail: the messages forwarded verbatim at the end, from the cut on.
//     Its floor is keep_tail messages (never opening on a tool result,
//     always holding the final message); tail_ratio extends it backward by
//     whole turns.
//   - cut: the client position where the tail begins; a summary replaces
//     the client's messages [lead, cut). headStart is the first position
//     after the lead that a plan forwards verbatim: the cut of the summary
//     in place, else the lead.
//   - head: what a new summary folds, [headStart, cut), as forwarded
//     (trims applied, drops left out), after the summary in place.
//   - ask, ack: the most recent user message, re-inserted verbatim after
//     the summary when it lies in the head; the assistant's
//     acknowledgement between them so roles alternate.
//   - record: a stored compaction (Summary, Trim, Drop), keyed by the
//     digest of the client's chain up to where it applies (RecordChain), so
//     it is re-applied only while those messages are unchanged.
//   - lineage: one history of a conversation with its own records, latch
//     and throttle (Lineage); a client that rewinds or forks starts
//     another. SelectLineage picks the one whose records the chain matches.
//   - pending: a summary made in the background after a response
//     (PassBackground), stored in State.Pending and applied without a model
//     call by the request that crosses the trigger.
//   - trim: a long tool result forwarded as a head/tail excerpt. drop:
//     whole turns not forwarded.
//   - step 0 (Config.Dedupe, Config.Mask; off at zero): dedupe, a tool
//     result that a later one repeats (its text without the tool's
//     envelope, or an older read of a file the same tool read again)
//     forwarded as a pointer naming the later call; mask, an old result
//     forwarded as a placeholder naming its call and the size elided. Both
//     are stored as Trim records (Keep 0: mask; Keep < 0: pointer).
//   - call: the tool name and arguments a result answers, read from the
//     assistant message's tool_calls (the Responses and Messages APIs'
//     calls reach the planner in the same chat shape).
//   - working set: the latest read of a file the agent re-read or edited,
//     the latest output of a command it re-ran, the latest of identical
//     results; with step 0 on it is never masked, deduplicated or excerpted
//     short of the last resort.
//   - cache reset: a decision that changes the forwarded bytes at a
//     position the previous request already held (Output.ResetAt,
//     Output.CacheReset): the provider re-reads from there uncached once.
//   - guard (the progress guard): a new summary is made only once it folds
//     max(summary_min_tokens, a quarter of the room) of history no summary
//     covered; until then a view within the budget goes as it is.
//   - latch: after a failed summarize, no attempt until the conversation
//     has grown by latch_growth messages. throttle: one attempt per
//     min_interval for the same message count.
//   - refold: when no cut leaves a new summary its least room, the summary
//     in place is folded again with what follows it, no larger than it is,
//     rather than dropping turns.
//   - last resort: what runs over the budget when nothing else brought the
//     view under it: tight excerpts, the summary shrunk, the drop, and
//     over the window the final turn's results excerpted.
//   - anchor: a measured step (the provider's usage for a prefix of the
//     view); an anchored estimate counts from the longest measured prefix
//     and adds the local count of what follows (package anchor, behind the
//     Estimator). The planner reads the anchors' append rate to estimate a
//     view whose head a new summary replaced (estimate).
//   - estimate: the Estimator's tokens for a view, scaled up when an
//     overflow measured the client's view larger (Input.Measured). est
//     estimates a list of messages; estimate a plan whose summary may be
//     new, its text counted by the bound the summarizer gave.
//   - need: the summary a decision asks for (Output.Need); the answer comes
//     back in Input.Summary.
//
// # Files
//
// planner.go (the API and the order of the steps), sizing.go (budget,
// thresholds, the verbatim tail, estimates), plan.go (a set of
// compactions and the view it renders), reduce.go (step 0: calls,
// duplicates, the working set, dedupe and mask), trim.go, summary.go (the
// summarize step, the background pass, the ask), cut.go (where a summary
// cuts and its room), gates.go (guard, latch, throttle), drop.go,
// finish.go (the invariant check and the output), steps.go (the log of
// steps taken), state.go and lineage.go (what is stored), view.go
// (excerpts and the summary block).
//
// The steps follow DESIGN.md § Compaction. Readings of the cases it leaves
// open:
//
//   - Positions in State are indexes into Input.Messages (provider-visible),
//     and every record is keyed by the client chain's digest covering it
//     (a trim by d[i+1], a summary by d[Cut], a drop by d[To]), so a record
//     applies only while the client's messages up to it are unchanged.
//   - Trim excerpts are not stored: an excerpt is a pure function of the
//     message and Trim.Keep, recomputed per request from the JSON literal
//     without decoding the elided middle. Tool results with image, audio or
//     file parts are never excerpted; an array of text parts becomes an array of
//     one text part holding the excerpt (the message keeps its shape).
//     "Long" is measured locally (text bytes / 4) per message; the view as a
//     whole is always measured with the Estimator.
//   - keep_tail 0 still keeps the client's final message (it must stay
//     final); the cut walks back over tool and function results.
//   - The ask (the most recent user message: text, or text with image or
//     audio parts) is re-inserted after the summary when it lies in the
//     head. A re-applied summary keeps its ask (a byte-stable prefix) and
//     decides its acknowledgement against the message at its cut now; a
//     client that rewound to the cut with a new instruction gets no ask
//     (the tail carries the latest instruction). Summaries stored with the
//     ask quoted inside them (AskInline, no longer made) render as before.
//   - "Replacing the head can reach the target" is tested with a placeholder
//     summary of Config.SummaryTokens and the tail as it stands; when it
//     cannot, step 4 runs without a summarize (and without a suppression).
//   - Step 4 excerpts long results anywhere after the summary (the head's
//     ones were already trimmed by step 1) except the final message. Drops
//     go first through the head, down to the target; only when dropping the
//     whole head still leaves the view over the budget do they reach into
//     the tail (never the final message's turn). A dropped range keeps the
//     opening user message when the next kept message is not a user one and
//     never makes two user or two assistant messages meet.
//   - Failures: the summarizer's error, ErrEmptySummary, ErrSummaryNotSmaller
//     (compared with the trimmed view before it). A call given up for its
//     requester's sake (SummaryResult.Canceled) does not engage the latch. LatchGrowth 0
//     disables the latch; the latch is checked before the throttle and also
//     in overflow recovery (PassRecover).
//   - A new summary clears the drop record and the trims it covers; trims in
//     the head that step 1 made before the summary are neither stored nor
//     reported.
//   - Shadow mode never asks for a summary (a summary that is not stored
//     would be asked for again at every step); it reports
//     ActionSummarizePending where one would be made, forwards the client's
//     view and returns the input State. A preview's dry run is a plan whose
//     Need the caller does not act on.
//   - Invariant: a produced view must pass pairing.Check; when the client's
//     own view does not (pairing off), it must add no violation. A failing
//     view is discarded; the stored records are forgotten when they alone
//     produce a failing view; the summarize bookkeeping (latch, throttle) is
//     kept, so a broken view never causes a summarize per step.
//   - Input.Measured scales every candidate's estimate by measured ÷
//     estimated when the estimator undercounted.
package compaction
