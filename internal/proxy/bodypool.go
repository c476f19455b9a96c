package proxy

import (
	"bytes"
	"errors"
	"math/bits"
	"sync"
	"sync/atomic"
)

// Request bodies of agents are large (a megabyte is common) and short-lived.
// Allocating each one costs a zeroing pass and GC and scavenger work that a
// streaming reverse proxy never pays, so chat bodies are read into pooled
// buffers by power-of-two size class and given back when the request ends.
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
)

var bodyPools [maxPoolClass + 1]sync.Pool

// pooledBody is a request body buffer from the pool.
type pooledBody struct {
	buf  []byte
	open atomic.Int32 // outgoing readers not yet closed
}

// getBody returns a buffer of length n (contents undefined), pooled when n
// fits a size class.
func getBody(n int) *pooledBody {
	c := bits.Len(uint(n - 1))
	if n <= 0 || c > maxPoolClass {
		return &pooledBody{buf: make([]byte, max(n, 0))}
	}
	c = max(c, minPoolClass)
	if v := bodyPools[c].Get(); v != nil {
		pb := v.(*pooledBody)
		pb.buf = pb.buf[:n]
		return pb
	}
	return &pooledBody{buf: make([]byte, n, 1<<c)}
}

// release gives the buffer back unless an outgoing reader is still open.
func (pb *pooledBody) release() {
	if pb == nil || pb.open.Load() != 0 {
		return
	}
	c := bits.Len(uint(cap(pb.buf) - 1))
	if cap(pb.buf) != 1<<c || c < minPoolClass || c > maxPoolClass {
		return
	}
	pb.buf = pb.buf[:0]
	bodyPools[c].Put(pb)
}

// reader returns an io.ReadCloser over b (which may point into pb) that
// marks pb busy until the transport closes it.
func (pb *pooledBody) reader(b []byte) *trackedReader {
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
	pb     *pooledBody
	closed bool
}

// errBodyClosed is what a Read after Close gets.
var errBodyClosed = errors.New("proxy: request body read after close")

func (t *trackedReader) Read(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return 0, errBodyClosed
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

// grow returns a buffer of length n holding the first keep bytes of pb, and
// gives pb back to the pool.
func (pb *pooledBody) grow(n, keep int) *pooledBody {
	nb := getBody(n)
	copy(nb.buf, pb.buf[:keep])
	pb.release()
	return nb
}
