package bufpool

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A closed request body may still be read by a transport (Go issue 46866;
// the HTTP/2 transport closes from another goroutine): after Close, a Read
// must touch nothing of the pooled buffer (issue 9 item 10).
func TestTrackedReaderReadAfterClose(t *testing.T) {
	pb := Get(1 << 16)
	copy(pb.Buf, "secret of the first request")
	r := pb.Reader(pb.Buf)
	if pb.open.Load() != 1 {
		t.Fatal("reader not tracked")
	}
	r.Close()
	r.Close() // twice is fine
	if pb.open.Load() != 0 {
		t.Fatalf("open = %d after Close", pb.open.Load())
	}
	p := make([]byte, 64)
	if n, err := r.Read(p); n != 0 || err == nil {
		t.Fatalf("Read after Close = %d, %v (%q): the buffer may be reused by another request by now", n, err, p[:n])
	}
}

// TestBodyPoolNotReusedWhileHTTP2Reads checks, deterministically, that a
// pooled body buffer is never back in the pool while the HTTP/2
// transport's body writer reads from it (issue 9 item 10). The writer runs
// in its own goroutine; when the client leaves, RoundTrip closes the body
// from yet another goroutine and returns without waiting for the writer
// (httputil's Go issue 46866; h2_bundle's closeReqBodyLocked), so the
// handler ends and releases the buffer while the writer may be
// between two Reads or inside one. A front server does with the client's
// body what the proxy does (frontServer). The hooks stop the writer at exactly
// those two points, let the client leave, and record whether the buffer
// went back to the pool before the writer copied from it.
//
// A pool whose "closed" does not exclude a running or later Read (the
// first version: bytes.Reader and an atomic closed flag) fails both cases.
func TestBodyPoolNotReusedWhileHTTP2Reads(t *testing.T) {
	for _, tc := range []struct {
		name   string
		atCopy bool
	}{
		// The writer sent a chunk and is about to Read the next one when
		// the transport closes the body.
		{"read after close", false},
		// The transport closes the body while a Read copies from it.
		{"close during read", true},
	} {
		t.Run(tc.name, func(t *testing.T) { bodyPoolUnderLeavingClient(t, tc.atCopy) })
	}
}

func bodyPoolUnderLeavingClient(t *testing.T, atCopy bool) {
	t.Cleanup(func() { testHookBodyRead, testHookBodyCopy, testHookBodyPooled = nil, nil, nil }) // runs last
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done() // reads nothing, answers nothing: the client leaves first
	}))
	up.EnableHTTP2 = true
	up.Config.ErrorLog = log.New(io.Discard, "", 0)
	up.StartTLS()
	t.Cleanup(up.Close)
	tr := &http.Transport{
		TLSClientConfig:   &tls.Config{InsecureSkipVerify: true}, // the test server's own certificate
		ForceAttemptHTTP2: true,
	}
	t.Cleanup(tr.CloseIdleConnections)
	front := frontServer(t, up.URL, tr)

	var (
		mu         sync.Mutex
		target     *Body // the request's buffer
		reads      int   // Reads of it begun
		inPool     bool  // target is back in the pool
		violations []string
		armed      atomic.Pointer[trackedReader] // the Read to stop at its copy
	)
	paused, resume, returned, pooled := make(chan struct{}), make(chan struct{}), make(chan struct{}), make(chan struct{})
	stop := func() {
		close(paused)
		select {
		case <-resume:
		case <-time.After(20 * time.Second):
		}
	}
	testHookBodyRead = func(tr *trackedReader) func() {
		mu.Lock()
		if tr.pb == nil || (target != nil && tr.pb != target) {
			mu.Unlock()
			return func() {}
		}
		target = tr.pb
		reads++
		second := reads == 2 // the first chunk went out; stop at the next
		mu.Unlock()
		if !second {
			return func() {}
		}
		if atCopy {
			armed.Store(tr)
		} else {
			stop()
		}
		return func() { close(returned) }
	}
	testHookBodyCopy = func(tr *trackedReader) {
		if armed.CompareAndSwap(tr, nil) {
			stop()
		}
		mu.Lock()
		defer mu.Unlock()
		if tr.pb == target && inPool {
			violations = append(violations, fmt.Sprintf("Read %d copied from a buffer already back in the pool", reads))
		}
	}
	testHookBodyPooled = func(pb *Body) {
		mu.Lock()
		defer mu.Unlock()
		if pb == target && !inPool {
			inPool = true
			close(pooled)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	clientDone := make(chan struct{})
	go func() {
		defer close(clientDone)
		body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 2<<20) + `"}]}` // many h2 chunks
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, front.URL+"/v1/chat/completions", strings.NewReader(body))
		if resp, err := http.DefaultClient.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	select {
	case <-paused:
	case <-time.After(20 * time.Second):
		t.Fatal("the transport's body writer never began a second Read")
	}
	cancel() // the client leaves: the proxy's upstream request is cancelled
	if atCopy {
		// A sound pool cannot give the buffer back now (the transport's
		// Close waits for this Read); an unsound one does within
		// milliseconds. Give it a second.
		select {
		case <-pooled:
		case <-time.After(time.Second):
		}
	} else {
		// The transport closed the body and RoundTrip returned: the
		// handler ends and gives the buffer back, a sound pool too.
		select {
		case <-pooled:
		case <-time.After(20 * time.Second):
			t.Fatal("the buffer never went back to the pool after the client left")
		}
	}
	close(resume)
	select {
	case <-returned:
	case <-time.After(20 * time.Second):
		t.Fatal("the stopped Read never returned")
	}
	<-clientDone
	mu.Lock()
	defer mu.Unlock()
	if len(violations) > 0 {
		t.Errorf("a pooled buffer was reused while the HTTP/2 transport still read it: %v", violations)
	}
}

// frontServer does with a client's body what the proxy does: reads it into
// a pooled Body, sends it upstream to url through tr with the client's
// context, and releases the Body when the handler ends, whether or not the
// transport is done with it.
func frontServer(t *testing.T, url string, tr *http.Transport) *httptest.Server {
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		data, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		pb := Get(len(data))
		copy(pb.Buf, data)
		defer pb.Release()
		req, _ := http.NewRequestWithContext(r.Context(), http.MethodPost, url, pb.Reader(pb.Buf))
		req.ContentLength = int64(len(pb.Buf))
		resp, err := tr.RoundTrip(req)
		if err != nil {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
	}))
	t.Cleanup(front.Close)
	return front
}
