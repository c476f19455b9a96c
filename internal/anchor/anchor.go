// Package anchor records provider-reported input usage against the exact
// prefix that produced it (a canonical digest chain) and estimates the
// context size of any view of a conversation from the longest anchored
// prefix plus a local estimate of what follows. Pure logic: standard library
// only (plus the sibling pure packages).
//
// Files: canonical.go (canonical JSON and message hashes), chain.go (seed
// and digest chain), usage.go (provider usage normalization), estimate.go
// (local estimator, calibration, anchors and EstimateView).
package anchor
