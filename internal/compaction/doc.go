// Package compaction decides, for one view of a conversation, whether and how
// to compact it so it fits the model's window: trim, summarize with a verbatim
// tail, reuse stored compactions, latch after failures, throttle, drop. It is
// pure logic: standard library and the sibling pure packages only, no
// context, no clock, nothing that calls out. Planner.Plan is the one entry
// point (requests, overflow recovery, previews and background summaries are
// Passes of it); it decides and never acts: when a summary is needed its
// Output.Need says what to summarize, how large and in what shape, the
// caller obtains it and plans the same Input again with the answer in
// Input.Summary (etcd raft's Step/Ready: decide, then do).
//
// Files by concern: planner.go (the API and the order of the steps),
// sizing.go (budget, thresholds, the verbatim tail, estimates), plan.go (a
// set of compactions and the view it renders), trim.go, summary.go,
// drop.go, finish.go (the invariant check and the output), state.go and
// lineage.go (what is stored), view.go (excerpts and the summary block).
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
