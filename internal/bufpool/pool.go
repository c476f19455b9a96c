// Package bufpool keeps freed buffers for reuse, bounded in bytes and
// emptied when idle: request bodies read by size class (Body) and any
// other kind of buffer (Pool).
package bufpool

import (
	"sync"
	"sync/atomic"
	"time"
)

// Pool keeps freed buffers for reuse, by size class, bounded in bytes,
// and empties itself when idle: an entry unused for ttl is dropped.
//
// Why not sync.Pool: it is unbounded, and it empties only over two GC
// cycles, while an idle Go process collects once every two minutes. After
// a burst (make soak: 1,000 streams, 1 MiB bodies) its buffers stayed live
// for three to four minutes, and they raised the heap goal, so the runtime
// kept the memory too. An idlePool holds at most maxBytes, and nothing
// once the proxy has been idle for ttl: the next collection frees it and
// the scavenger returns it to the OS.
//
// A class is a LIFO stack, so the entries of a class are ordered by the
// time they were put, oldest first; the sweep drops a prefix.
type Pool[T any] struct {
	// TTL is how long an unused entry is kept, in nanoseconds (atomic: a
	// test may shorten it while the pool sweeps).
	TTL atomic.Int64
	// Held is the bytes the pool holds (changed under the pool's lock;
	// atomic so that a test may watch it).
	Held     atomic.Int64
	maxBytes int64

	mu      sync.Mutex
	classes [][]idleEntry[T]
	timer   *time.Timer // armed while the pool holds anything
}

type idleEntry[T any] struct {
	v    T
	size int64
	at   time.Time
}

// New returns a pool of classes size classes that holds at most maxBytes
// and drops what was unused for ttl.
func New[T any](classes int, maxBytes int64, ttl time.Duration) *Pool[T] {
	p := &Pool[T]{maxBytes: maxBytes, classes: make([][]idleEntry[T], classes)}
	p.TTL.Store(int64(ttl))
	return p
}

// Get returns the most recently put entry of class c.
func (p *Pool[T]) Get(c int) (T, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.classes[c]
	if len(s) == 0 {
		var zero T
		return zero, false
	}
	e := s[len(s)-1]
	s[len(s)-1] = idleEntry[T]{}
	p.classes[c] = s[:len(s)-1]
	p.Held.Add(-e.size)
	return e.v, true
}

// Put keeps v (size bytes) for reuse; over the byte bound it is left to
// the GC instead.
func (p *Pool[T]) Put(c int, v T, size int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.Held.Load()+size > p.maxBytes {
		return
	}
	p.classes[c] = append(p.classes[c], idleEntry[T]{v: v, size: size, at: time.Now()})
	p.Held.Add(size)
	if p.timer == nil {
		p.timer = time.AfterFunc(p.ttl(), p.sweep)
	}
}

// sweep drops the entries unused for ttl and re-arms itself for the
// oldest one left; with nothing left, the timer is dropped (no goroutine
// or timer outlives a burst).
func (p *Pool[T]) sweep() {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	ttl := p.ttl()
	var oldest time.Time
	for c, s := range p.classes {
		n := 0
		for n < len(s) && now.Sub(s[n].at) >= ttl {
			p.Held.Add(-s[n].size)
			n++
		}
		if n > 0 {
			clear(s[:n])
			// Keep the stack's capacity only while it holds something.
			if n == len(s) {
				p.classes[c] = nil
				continue
			}
			p.classes[c] = append(s[:0:0], s[n:]...)
			s = p.classes[c]
		}
		if len(s) > 0 && (oldest.IsZero() || s[0].at.Before(oldest)) {
			oldest = s[0].at
		}
	}
	if oldest.IsZero() {
		p.timer = nil
		return
	}
	p.timer.Reset(ttl - now.Sub(oldest))
}

func (p *Pool[T]) ttl() time.Duration { return time.Duration(p.TTL.Load()) }
