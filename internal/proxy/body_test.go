package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"
)

// rawRequest opens a connection to the proxy and writes raw bytes.
func rawRequest(t *testing.T, p *testProxy, raw string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(p.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, raw); err != nil {
		t.Fatal(err)
	}
	return c
}

// rawResponse reads one response from c (at most 10 s).
func rawResponse(t *testing.T, c net.Conn) (*http.Response, []byte) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no response: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, b
}

const chatHeaders = "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"

// A declared Content-Length is a claim, not memory to reserve: eight
// connections that send headers and one byte of a 32 MiB body must not make
// the proxy allocate 256 MiB (issue 9 item 4).
func TestDeclaredLengthNotReservedUpFront(t *testing.T) {
	up := newFakeUpstream(t, nil)
	p := newTestProxy(t, testConfig(up.URL))
	const conns = 8
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	var cs []net.Conn
	for range conns {
		cs = append(cs, rawRequest(t, p, chatHeaders+"Content-Length: 33554432\r\n\r\n{"))
	}
	time.Sleep(300 * time.Millisecond) // the handlers are reading by now
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 64<<20 {
		t.Errorf("%d connections with one byte each made the process allocate %d MiB", conns, grew>>20)
	}
	for _, c := range cs {
		c.Close()
	}
	waitFor(t, func() bool {
		return counter(t, p.reg, "compactproxy_http_requests_total", map[string]string{"route": "chat", "code": "499"}) == conns
	})
	if n := len(up.requests()); n != 0 {
		t.Errorf("upstream received %d requests", n)
	}
}

// The buffer still grows to hold what really arrives, whatever the
// declared length (none, exact) and across the pool's size classes.
func TestBodyReadGrowsToWhatArrives(t *testing.T) {
	for _, size := range []int{0, 1, 70 << 10, 1<<20 + 3, 3 << 20} {
		for _, declared := range []bool{false, true} {
			t.Run(fmt.Sprintf("%d/declared=%v", size, declared), func(t *testing.T) {
				body := make([]byte, size)
				for i := range body {
					body[i] = byte('a' + i%23)
				}
				r, _ := http.NewRequest(http.MethodPost, "/", strings.NewReader(string(body)))
				if !declared {
					r.ContentLength = -1
				}
				pb, err := readBody(r, 4<<20)
				if err != nil {
					t.Fatal(err)
				}
				defer pb.Release()
				if string(pb.Buf) != string(body) {
					t.Fatalf("read %d bytes, not the %d sent", len(pb.Buf), size)
				}
			})
		}
	}
	r, _ := http.NewRequest(http.MethodPost, "/", strings.NewReader(strings.Repeat("x", 5<<20)))
	r.ContentLength = -1
	if _, err := readBody(r, 4<<20); err != errBodyTooLarge {
		t.Errorf("undeclared 5 MiB under a 4 MiB limit: %v", err)
	}
}

// A malformed chunked body is the client's fault: 400 in OpenAI's envelope,
// nothing forwarded (it was 200 with an empty body; issue 9 item 5).
func TestMalformedChunkedBody(t *testing.T) {
	up := newFakeUpstream(t, nil)
	p := newTestProxy(t, testConfig(up.URL))
	c := rawRequest(t, p, chatHeaders+"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\nzz-not-hex\r\n")
	resp, b := rawResponse(t, c)
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("status %d, want 400: %q", resp.StatusCode, b)
	}
	if e := envelope(t, b); e.Code == nil || *e.Code != "invalid_body" {
		t.Errorf("envelope %+v", e)
	}
	if n := len(up.requests()); n != 0 {
		t.Errorf("upstream received %d requests", n)
	}
}

// A client that sends its body slower than limits.body_read_timeout gets
// 408 in OpenAI's envelope (issue 9 item 4).
func TestSlowBodyTimesOut(t *testing.T) {
	up := newFakeUpstream(t, nil)
	cfg := testConfig(up.URL)
	cfg.Limits.BodyReadTimeout = 300 * time.Millisecond
	p := newTestProxy(t, cfg)
	c := rawRequest(t, p, chatHeaders+"Content-Length: 100\r\n\r\n{\"model\":")
	start := time.Now()
	resp, b := rawResponse(t, c)
	if resp.StatusCode != http.StatusRequestTimeout {
		t.Fatalf("status %d after %s, want 408: %q", resp.StatusCode, time.Since(start), b)
	}
	if e := envelope(t, b); e.Code == nil || *e.Code != "request_timeout" {
		t.Errorf("envelope %+v", e)
	}
	if n := len(up.requests()); n != 0 {
		t.Errorf("upstream received %d requests", n)
	}
}
