// Package compaction decides, for one view of a conversation, whether and how
// to compact it so it fits the model's window: trim, summarize with a verbatim
// tail, reuse stored compactions, latch after failures, throttle, drop. It is
// pure logic: standard library and the sibling pure packages only; the model
// call and the clock come in through interfaces.
package compaction
