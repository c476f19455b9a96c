package proxy

import (
	"errors"
	"io"
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
	t := &trackedReader{b: b}
	if pb != nil {
		pb.open.Add(1)
		t.pb = pb
	}
	return t
}

type trackedReader struct {
	mu     sync.Mutex
	b      []byte // what is left to read
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
	if len(t.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p, t.b)
	t.b = t.b[n:]
	return n, nil
}

// writeChunk bounds one WriteTo write: large enough that a megabyte body
// goes out in a few system calls (io.Copy's 32 KiB buffer makes 32), small
// enough that Close never waits long behind the lock.
const writeChunk = 256 << 10

// WriteTo writes the rest of the body to w in writeChunk pieces, each under
// the lock like a Read (the HTTP/1 transport's body writer takes this path
// through net.TCPConn.ReadFrom); a Close between pieces stops it.
func (t *trackedReader) WriteTo(w io.Writer) (int64, error) {
	var total int64
	for {
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			return total, errBodyClosed
		}
		if len(t.b) == 0 {
			t.mu.Unlock()
			return total, nil
		}
		n, err := w.Write(t.b[:min(len(t.b), writeChunk)])
		t.b = t.b[n:]
		t.mu.Unlock()
		total += int64(n)
		if err != nil {
			return total, err
		}
	}
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
