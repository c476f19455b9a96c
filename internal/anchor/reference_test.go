package anchor

import (
	"fmt"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// The reference forms the tests check the production paths against:
// the canonical bytes MessageHash hashes, a chain over whole digests, and
// a view's chain and estimates computed from nothing.

// AppendCanonical appends the canonical form of the JSON value raw to
// dst (MessageHash describes it); invalid JSON returns dst unchanged and
// an error.
func AppendCanonical(dst, raw []byte) ([]byte, error) {
	c := canonPool.Get().(*canonicalizer)
	out, err := c.run(dst, raw, true)
	c.release()
	return out, err
}

// appendCanonicalValue is AppendCanonical without the removal of the
// proxy-only keys: for top-level request fields, which are not messages.
func appendCanonicalValue(dst, raw []byte) ([]byte, error) {
	c := canonPool.Get().(*canonicalizer)
	out, err := c.run(dst, raw, false)
	c.release()
	return out, err
}

// Chain returns the digest chain of a view whose messages hash to msgs:
// d[0] = seed, d[i+1] = SHA-256(d[i] || msgs[i]), len(msgs)+1 digests.
// d[k] identifies the first k messages under that seed. Chaining the
// per-message hash (rather than the canonical bytes) lets a message be
// canonicalized and hashed once and reused by every view that contains it;
// it is as collision-resistant as hashing the bytes, since each link is a
// fixed 64-byte input.
func Chain(seed Digest, msgs []Digest) []Digest {
	out := make([]Digest, len(msgs)+1)
	out[0] = seed
	for i := range msgs {
		out[i+1] = Link(out[i], msgs[i])
	}
	return out
}

// ViewChain computes what EstimateView needs for a view: its digest chain
// under seed and the local token estimate of each message (est; nil means
// the default estimator). A message whose HasDigest is set is not hashed
// again; the others are hashed from Raw and their Digest and HasDigest are
// filled in place, so a message shared by several views (client's view,
// compacted view) is hashed once. An invalid message is an error naming
// its index.
func ViewChain(seed Digest, msgs []chat.Message, est LocalEstimator) ([]Digest, []int, error) {
	if est == nil {
		est = defaultEstimator
	}
	chain := make([]Digest, len(msgs)+1)
	local := make([]int, len(msgs))
	chain[0] = seed
	for i := range msgs {
		m := &msgs[i]
		if !m.HasDigest {
			d, err := MessageHash(m.Raw)
			if err != nil {
				return nil, nil, fmt.Errorf("anchor: message %d: %w", i, err)
			}
			m.Digest, m.HasDigest = d, true
		}
		chain[i+1] = Link(chain[i], m.Digest)
		local[i] = est.Tokens(m)
	}
	return chain, local, nil
}
