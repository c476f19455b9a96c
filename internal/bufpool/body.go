package bufpool

import (
	"bytes"
	"errors"
	"io"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"
)

// Request bodies of agents are large (a megabyte is common) and short-lived.
// Allocating each one costs a zeroing pass and GC and scavenger work that a
// streaming reverse proxy never pays, so chat bodies are read into pooled
// buffers by power-of-two size class and given back when the request ends.
// The pool is a Pool: a deliberate, bounded cache of at most
// bodyPoolBytes of buffers, none once no request gave one back for
// Idle (an idle proxy holds no body memory).
//
// A buffer is reused only once nothing can still read it: the outgoing
// request bodies that point into it are tracked, and http.Transport closes
// a request body when it is done with it (even on errors, possibly after
// RoundTrip returned). A buffer with a body still open is left to the GC.
//
// "Closed" alone does not mean "no reader": httputil notes that a closed
// body may still be read (Go issue 46866), and the HTTP/2 transport closes
// a request body from one goroutine while its body writer may be inside
// Read in another. So trackedReader makes it true itself: Read and Close
// exclude each other, and a Read after Close touches nothing and fails.
// Close returns only when no Read is running, so the buffer is free to
// reuse once every reader is closed.
const (
	minPoolClass = 16 // 64 KiB
	maxPoolClass = 26 // 64 MiB

	// bodyPoolBytes bounds the idle buffers kept: 32 concurrent requests
	// of a megabyte (a 2 MiB class each) reuse theirs.
	bodyPoolBytes = 64 << 20
	// Idle is how long an unused buffer is kept.
	Idle = 10 * time.Second
)

// Bodies is the pool of request body buffers.
var Bodies = New[*Body](maxPoolClass+1, bodyPoolBytes, Idle)

// Test hooks, nil in production (net/http's testHook pattern). They let a
// test stop the transport's body writer inside Read, at the two points
// where a reuse would bite, and see a buffer go back to the pool, so that
// "never reused while a transport may read it" is checked, not hoped for
// (TestBodyPoolNotReusedWhileHTTP2Reads).
var (
	// testHookBodyRead is called on entry to Read, before it takes the
	// lock; Read calls the returned func when it returns.
	testHookBodyRead func(*trackedReader) (returned func())
	// testHookBodyCopy is called just before Read copies from the buffer.
	testHookBodyCopy func(*trackedReader)
	// testHookBodyPooled is called as a buffer goes back to the pool.
	testHookBodyPooled func(*Body)
)

// Body is a request body buffer from the pool.
type Body struct {
	// Buf holds the body.
	Buf  []byte
	open atomic.Int32 // outgoing readers not yet closed
}

// Get returns a buffer of length n (contents undefined), pooled when n
// fits a size class.
func Get(n int) *Body {
	c := bits.Len(uint(n - 1))
	if n <= 0 || c > maxPoolClass {
		return &Body{Buf: make([]byte, max(n, 0))}
	}
	c = max(c, minPoolClass)
	if pb, ok := Bodies.Get(c); ok {
		pb.Buf = pb.Buf[:n]
		return pb
	}
	return &Body{Buf: make([]byte, n, 1<<c)}
}

// Release gives the buffer back unless an outgoing reader is still open.
func (pb *Body) Release() {
	if pb == nil || pb.open.Load() != 0 {
		return
	}
	c := bits.Len(uint(cap(pb.Buf) - 1))
	if cap(pb.Buf) != 1<<c || c < minPoolClass || c > maxPoolClass {
		return
	}
	if testHookBodyPooled != nil {
		testHookBodyPooled(pb)
	}
	pb.Buf = pb.Buf[:0]
	Bodies.Put(c, pb, int64(cap(pb.Buf)))
}

// Reader returns an io.ReadCloser over b (which may point into pb) that
// marks pb busy until the transport closes it.
func (pb *Body) Reader(b []byte) io.ReadCloser {
	t := &trackedReader{r: bytes.NewReader(b)}
	if pb != nil {
		pb.open.Add(1)
		t.pb = pb
	}
	return t
}

type trackedReader struct {
	mu     sync.Mutex
	r      *bytes.Reader
	pb     *Body
	closed bool
}

// errBodyClosed is what a Read after Close gets.
var errBodyClosed = errors.New("bufpool: request body read after close")

func (t *trackedReader) Read(p []byte) (int, error) {
	if testHookBodyRead != nil {
		defer testHookBodyRead(t)()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return 0, errBodyClosed
	}
	if testHookBodyCopy != nil {
		testHookBodyCopy(t)
	}
	return t.r.Read(p)
}

func (t *trackedReader) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.closed {
		t.closed = true
		if t.pb != nil {
			t.pb.open.Add(-1)
		}
	}
	return nil
}

// Grow returns a buffer of length n holding the first keep bytes of pb, and
// gives pb back to the pool.
func (pb *Body) Grow(n, keep int) *Body {
	nb := Get(n)
	copy(nb.Buf, pb.Buf[:keep])
	pb.Release()
	return nb
}
