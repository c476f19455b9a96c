// Package anchor records provider-reported input usage against the exact
// prefix that produced it (a canonical digest chain) and estimates the
// context size of any view of a conversation from the longest anchored
// prefix plus a local estimate of what follows. Pure logic: standard library
// only (plus the sibling pure packages).
package anchor

// Digest is a 256-bit digest (SHA-256).
type Digest [32]byte
