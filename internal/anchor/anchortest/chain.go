// Package anchortest computes digest chains from nothing, the reference
// the proxy's incremental chains (the chain memo, the parse cache) and the
// planner's tests are checked against. For tests and benchmarks only.
package anchortest

import (
	"fmt"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// Chain returns the digest chain of a view whose messages hash to msgs:
// d[0] = seed, d[i+1] = anchor.Link(d[i], msgs[i]), len(msgs)+1 digests.
func Chain(seed anchor.Digest, msgs []anchor.Digest) []anchor.Digest {
	out := make([]anchor.Digest, len(msgs)+1)
	out[0] = seed
	for i := range msgs {
		out[i+1] = anchor.Link(out[i], msgs[i])
	}
	return out
}

// ViewChain computes what anchor.EstimateView needs for a view: its
// digest chain under seed and the local token estimate of each message
// (est; nil means anchor.NewLocalEstimator). A message whose HasDigest is
// set is not hashed again; the others are hashed from Raw and their Digest
// and HasDigest are filled in place. An invalid message is an error naming
// its index.
func ViewChain(seed anchor.Digest, msgs []chat.Message, est anchor.LocalEstimator) ([]anchor.Digest, []int, error) {
	if est == nil {
		est = anchor.NewLocalEstimator()
	}
	chain := make([]anchor.Digest, len(msgs)+1)
	local := make([]int, len(msgs))
	chain[0] = seed
	for i := range msgs {
		m := &msgs[i]
		if !m.HasDigest {
			d, err := anchor.MessageHash(m.Raw)
			if err != nil {
				return nil, nil, fmt.Errorf("anchor: message %d: %w", i, err)
			}
			m.Digest, m.HasDigest = d, true
		}
		chain[i+1] = anchor.Link(chain[i], m.Digest)
		local[i] = est.Tokens(m)
	}
	return chain, local, nil
}
