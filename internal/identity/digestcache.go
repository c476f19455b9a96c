package identity

import (
	"hash/maphash"
	"runtime"
	"sync"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

// digestCache remembers the canonical digest of message bytes this process
// has already hashed. An agent resends its whole history on every step, so
// all but the newest messages of a request were hashed before:
// canonicalizing and hashing 1 MiB costs milliseconds, looking 1,000
// messages up costs microseconds.
//
// The key is 128 bits of maphash (two random per-process seeds, never
// exposed) over the tenant and the raw bytes, plus the length: the result is
// a pure function of the bytes, and including the tenant means a cache hit
// can never tell one tenant that another sent the same message (no timing
// side channel across tenants).
//
// Bounded: two generations of at most max/2 entries each; when the current
// one fills up it becomes the old one and the older is dropped (an
// approximate LRU without per-entry bookkeeping; a hit in the old
// generation is promoted).
type digestCache struct {
	s1, s2 maphash.Seed
	max    int
	mu     sync.Mutex
	cur    map[digestKey]anchor.Digest
	old    map[digestKey]anchor.Digest
}

type digestKey struct {
	a, b uint64
	n    int
}

func newDigestCache(max int) *digestCache {
	return &digestCache{s1: maphash.MakeSeed(), s2: maphash.MakeSeed(), max: max,
		cur: map[digestKey]anchor.Digest{}, old: map[digestKey]anchor.Digest{}}
}

func (c *digestCache) key(tenant string, raw []byte) digestKey {
	var h1, h2 maphash.Hash
	h1.SetSeed(c.s1)
	h2.SetSeed(c.s2)
	h1.WriteString(tenant)
	h1.Write(raw)
	h2.WriteString(tenant)
	h2.Write(raw)
	return digestKey{a: h1.Sum64(), b: h2.Sum64(), n: len(raw)}
}

// hash fills Digest for every message of msgs: from the cache when the
// tenant already sent these bytes, else by canonicalizing and hashing them
// (anchor.MessageHash), remembering the result. It returns the first
// hashing error (a message that is not valid JSON cannot occur after
// chat.Parse, but a caller must not trust that).
func (c *digestCache) hash(tenant string, msgs []chat.Message) error {
	todo := 0
	for i := range msgs {
		if !msgs[i].HasDigest {
			todo++
		}
	}
	if todo == 0 {
		return nil // all reused from the parse cache
	}
	keys := make([]digestKey, len(msgs))
	// Keys are computed outside the lock, split over the cores for a large
	// request (a megabyte of history is ~0.3 ms of hashing on one core).
	parallel(len(msgs), func(lo, hi int) {
		for i := lo; i < hi; i++ {
			if !msgs[i].HasDigest {
				keys[i] = c.key(tenant, msgs[i].Raw)
			}
		}
	})
	miss := 0
	c.mu.Lock()
	for i := range msgs {
		m := &msgs[i]
		if m.HasDigest {
			continue
		}
		k := keys[i]
		if d, ok := c.cur[k]; ok {
			m.Digest, m.HasDigest = d, true
		} else if d, ok := c.old[k]; ok {
			m.Digest, m.HasDigest = d, true
			c.put(k, d)
		} else {
			miss++
		}
	}
	c.mu.Unlock()
	if miss == 0 {
		return nil
	}
	errs := make([]error, len(msgs))
	fresh := make([]bool, len(msgs)) // hashed now, to be remembered
	parallel(len(msgs), func(lo, hi int) {
		for i := lo; i < hi; i++ {
			m := &msgs[i]
			if m.HasDigest {
				continue
			}
			d, err := anchor.MessageHash(m.Raw)
			if err != nil {
				errs[i] = err
				continue
			}
			m.Digest, m.HasDigest = d, true
			fresh[i] = true
		}
	})
	c.mu.Lock()
	for i := range msgs {
		if fresh[i] {
			c.put(keys[i], msgs[i].Digest)
		}
	}
	c.mu.Unlock()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// parallel runs fn over [0, n) in one chunk per core when n is large enough
// to pay for the goroutines, else inline.
func parallel(n int, fn func(lo, hi int)) {
	workers := runtime.GOMAXPROCS(0)
	if n < 256 || workers < 2 {
		fn(0, n)
		return
	}
	var wg sync.WaitGroup
	step := (n + workers - 1) / workers
	for lo := 0; lo < n; lo += step {
		hi := min(lo+step, n)
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn(lo, hi)
		}()
	}
	wg.Wait()
}

func (c *digestCache) put(k digestKey, d anchor.Digest) {
	if len(c.cur) >= c.max/2 {
		c.old, c.cur = c.cur, make(map[digestKey]anchor.Digest, len(c.cur))
	}
	c.cur[k] = d
}
