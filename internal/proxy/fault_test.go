package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/compactproxy/compactproxy/internal/store/storetest"
	"go.uber.org/goleak"
)

// The fault matrix (issue 9): for each broken upstream, summarizer or
// client, what the client receives, what the upstream received, that no
// goroutine outlives the cell, and that metrics and logs say what happened
// without message content or keys.

const (
	faultContent = "SECRET-CONTENT-7731"
	faultKey     = "sk-client-9931"
)

var faultBody = `{"model":"m","messages":[{"role":"user","content":"` + faultContent + `"}]}`
var faultStream = `{"model":"m","stream":true,"messages":[{"role":"user","content":"` + faultContent + `"}]}`

type clientMode int

const (
	clientNormal           clientMode = iota
	clientGivesUp                     // gives up after 400ms (the upstream is too slow)
	clientLeavesBefore                // cancels once the upstream has the request, before its answer
	clientLeavesDuring                // cancels after the first stream event
	clientLeavesAfterwards            // reads the whole answer, then closes
)

type metricWant struct {
	name   string
	labels map[string]string
	value  float64
}

type faultCell struct {
	name       string
	tweak      func(*config.Config)
	upstream   func(w http.ResponseWriter, r *http.Request, n int) // n: 1-based call number
	summarizer func(w http.ResponseWriter, r *http.Request)        // non-nil: a summarizer endpoint
	sumDead    bool                                                // summarizer URL where nothing listens
	body       string
	client     clientMode

	status      int      // client status; 0: the client's own request ended with an error
	code        string   // envelope code the client gets ("" = none checked)
	aborted     bool     // a 200 whose body ends with a read error
	bodyHas     []string // in what the client read
	calls       int      // chat requests the upstream received
	cancelled   bool     // the upstream saw its request context end
	logStatus   int      // access log status
	logMessages []string // log messages that must appear
	metrics     []metricWant
	header      map[string]string // response headers the client must get ("" = absent)
}

func jsonAnswer(w http.ResponseWriter, status int, body string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	io.WriteString(w, body)
}

func okAnswer(w http.ResponseWriter) { jsonAnswer(w, 200, okCompletion) }

// block waits for the request's end (the proxy cancelling it), at most 10 s.
func block(r *http.Request) {
	select {
	case <-r.Context().Done():
	case <-time.After(10 * time.Second):
	}
}

func streamHead(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream")
	sse(w, `{"choices":[{"index":0,"delta":{"content":"one"}}]}`)
}

// bigConversation is over the trigger of compactionConfig's 4,000-token
// window without any trimming: the proxy must summarize (or drop).
func bigConversation() string {
	a := newAgent()
	a.msgs[1] = `{"role":"user","content":"` + faultContent + `"}`
	for range 14 {
		a.toolStep(800)
	}
	a.msgs = append(a.msgs, `{"role":"user","content":"go on"}`)
	return a.body()
}

func summarizerAnswer(content string) string {
	return `{"id":"s","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":` + content + `},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":10}}`
}

func faultCells() []faultCell {
	sumCell := func(name string, h func(w http.ResponseWriter, r *http.Request), dead bool, extra ...metricWant) faultCell {
		return faultCell{
			name: "summarizer " + name, summarizer: h, sumDead: dead, body: bigConversation(),
			upstream: func(w http.ResponseWriter, r *http.Request, n int) { okAnswer(w) },
			status:   200, calls: 1, logStatus: 200,
			logMessages: []string{"request"},
			metrics:     append([]metricWant{{"compactproxy_summarize_total", map[string]string{"result": "failure"}, 1}}, extra...),
		}
	}
	return []faultCell{
		{name: "upstream 429 with Retry-After beyond max_elapsed",
			tweak: func(c *config.Config) { c.Retry.MaxElapsed = 500 * time.Millisecond },
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				w.Header().Set("Retry-After", "5")
				jsonAnswer(w, 429, `{"error":{"message":"slow down","type":"rate_limit_error"}}`)
			},
			status: 429, bodyHas: []string{"slow down"}, calls: 1, logStatus: 429,
			metrics: []metricWant{{"compactproxy_upstream_retries_total", map[string]string{"op": "chat", "reason": "status_429"}, 0}}},
		{name: "upstream 429 without Retry-After",
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				jsonAnswer(w, 429, `{"error":{"message":"slow down","type":"rate_limit_error"}}`)
			},
			status: 429, bodyHas: []string{"slow down"}, calls: 3, logStatus: 429,
			metrics: []metricWant{{"compactproxy_upstream_retries_total", map[string]string{"op": "chat", "reason": "status_429"}, 2}}},
		{name: "upstream 503 Loading model, then ready",
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				if n < 3 {
					jsonAnswer(w, 503, `{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}`)
					return
				}
				okAnswer(w)
			},
			status: 200, bodyHas: []string{`"chat.completion"`}, calls: 3, logStatus: 200,
			metrics: []metricWant{{"compactproxy_upstream_retries_total", map[string]string{"op": "chat", "reason": "status_5xx"}, 2}}},
		{name: "upstream 500",
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				jsonAnswer(w, 500, `{"error":{"message":"boom","type":"server_error"}}`)
			},
			status: 500, bodyHas: []string{"boom"}, calls: 1, logStatus: 500},
		{name: "upstream closes before headers",
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				c, _, _ := w.(http.Hijacker).Hijack()
				c.Close()
			},
			status: 502, code: "upstream_connection_closed", calls: 1, logStatus: 502,
			logMessages: []string{"upstream request failed"}},
		{name: "upstream times out before headers", client: clientGivesUp,
			upstream: func(w http.ResponseWriter, r *http.Request, n int) { block(r) },
			status:   0, calls: 1, cancelled: true, logStatus: 499,
			metrics: []metricWant{{"compactproxy_http_requests_total", map[string]string{"route": "chat", "code": "499"}, 1}}},
		{name: "upstream times out mid-stream", client: clientGivesUp, body: faultStream,
			upstream: func(w http.ResponseWriter, r *http.Request, n int) { streamHead(w); block(r) },
			status:   200, aborted: true, bodyHas: []string{"one"}, calls: 1, cancelled: true, logStatus: 499,
			metrics: []metricWant{{"compactproxy_stream_aborts_total", nil, 0}}},
		{name: "upstream resets mid-stream", body: faultStream,
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				streamHead(w)
				c, _, _ := w.(http.Hijacker).Hijack()
				if tc, ok := c.(*net.TCPConn); ok {
					_ = tc.SetLinger(0) // RST, not FIN
				}
				c.Close()
			},
			status: 200, aborted: true, bodyHas: []string{"one", `"code":"upstream_connection_closed"`}, calls: 1, logStatus: 200,
			logMessages: []string{"upstream stream broken off"},
			metrics:     []metricWant{{"compactproxy_stream_aborts_total", nil, 1}}},
		{name: "upstream sends garbage SSE", body: faultStream,
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, "data: {not json\n\nno field at all\n\n\x00\xff\xfe binary\n\ndata: {\"usage\":\n\n")
				sse(w, "[DONE]")
			},
			status: 200, bodyHas: []string{"{not json", "[DONE]"}, calls: 1, logStatus: 200,
			metrics: []metricWant{{"compactproxy_stream_aborts_total", nil, 0}}},
		{name: "upstream sends an 8 MiB line", body: faultStream,
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				w.Header().Set("Content-Type", "text/event-stream")
				sse(w, `{"choices":[{"index":0,"delta":{"content":"`+strings.Repeat("y", 8<<20)+`"}}]}`)
				sse(w, "[DONE]")
			},
			status: 200, bodyHas: []string{strings.Repeat("y", 8<<20), "[DONE]"}, calls: 1, logStatus: 200},
		{name: "upstream overflow with nothing to compact",
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				jsonAnswer(w, 400, `{"error":{"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error","n_prompt_tokens":5000,"n_ctx":4096}}`)
			},
			status: 400, bodyHas: []string{"exceed_context_size_error"}, calls: 1, logStatus: 400},
		// Issue 20: a validation error that quotes a context size is the
		// client's own 400, not an overflow: no recovery, nothing learned.
		// (A conversation that compaction can shrink: taken as an overflow,
		// the quoted 2500 would make the proxy compact again and resend.)
		{name: "upstream validation error quoting a context size", body: bigConversation(),
			summarizer: func(w http.ResponseWriter, r *http.Request) {
				jsonAnswer(w, 500, `{"error":{"message":"down","type":"server_error"}}`)
			},
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				jsonAnswer(w, 400, `{"error":{"message":"Invalid value for 'user': 'This model's maximum context length is 2500 tokens. However, your messages resulted in 9000 tokens.'","type":"invalid_request_error","param":"user","code":"invalid_value"}}`)
			},
			status: 400, bodyHas: []string{"invalid_value"}, calls: 1, logStatus: 400,
			metrics: []metricWant{{"compactproxy_upstream_retries_total", map[string]string{"op": "chat", "reason": "context_overflow"}, 0}}},
		// Issue 20: the upstream closes a stream with no Content-Length
		// mid-answer (no finish reason, no [DONE]): a clean EOF to the
		// reader, yet the client must see the error event and an abort.
		{name: "upstream SSE ends on EOF mid-answer", body: faultStream,
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				c, _, _ := w.(http.Hijacker).Hijack()
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"+
					`data: {"choices":[{"index":0,"delta":{"content":"one"}}]}`+"\n\n")
				c.Close()
			},
			status: 200, aborted: true, bodyHas: []string{"one", `"code":"upstream_connection_closed"`}, calls: 1, logStatus: 200,
			logMessages: []string{"upstream stream broken off"},
			metrics:     []metricWant{{"compactproxy_stream_aborts_total", nil, 1}}},
		// Issue 20: the upstream's own request id comes back beside the
		// proxy's, never instead of it.
		{name: "upstream X-Request-Id",
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				w.Header().Set("X-Request-Id", "req_upstream_77")
				okAnswer(w)
			},
			status: 200, calls: 1, logStatus: 200,
			header: map[string]string{"X-Upstream-Request-Id": "req_upstream_77"}},
		sumCell("errors", func(w http.ResponseWriter, r *http.Request) {
			jsonAnswer(w, 500, `{"error":{"message":"summarizer down","type":"server_error"}}`)
		}, false),
		sumCell("times out", func(w http.ResponseWriter, r *http.Request) { block(r) }, false),
		sumCell("answers empty", func(w http.ResponseWriter, r *http.Request) { jsonAnswer(w, 200, summarizerAnswer(`""`)) }, false),
		sumCell("answers garbage JSON", func(w http.ResponseWriter, r *http.Request) { jsonAnswer(w, 200, `{"choices":[{"message":`) }, false),
		sumCell("is unreachable", nil, true,
			metricWant{"compactproxy_upstream_retries_total", map[string]string{"op": "summarize", "reason": "connect"}, 2}),
		{name: "client leaves before the upstream answers", client: clientLeavesBefore,
			upstream: func(w http.ResponseWriter, r *http.Request, n int) { block(r) },
			status:   0, calls: 1, cancelled: true, logStatus: 499,
			metrics: []metricWant{{"compactproxy_http_requests_total", map[string]string{"route": "chat", "code": "499"}, 1}}},
		{name: "client leaves during the stream", client: clientLeavesDuring, body: faultStream,
			upstream: func(w http.ResponseWriter, r *http.Request, n int) { streamHead(w); block(r) },
			status:   200, aborted: true, bodyHas: []string{"one"}, calls: 1, cancelled: true, logStatus: 499,
			metrics: []metricWant{{"compactproxy_stream_aborts_total", nil, 0}}},
		{name: "client leaves after the answer", client: clientLeavesAfterwards, body: faultStream,
			upstream: func(w http.ResponseWriter, r *http.Request, n int) {
				streamHead(w)
				sse(w, "[DONE]")
			},
			status: 200, bodyHas: []string{"one", "[DONE]"}, calls: 1, logStatus: 200,
			metrics: []metricWant{{"compactproxy_http_requests_total", map[string]string{"route": "chat", "code": "200"}, 1}}},
	}
}

func TestFaultMatrix(t *testing.T) {
	for _, tc := range faultCells() {
		t.Run(tc.name, func(t *testing.T) {
			ignore := goleak.IgnoreCurrent()
			t.Cleanup(func() { goleak.VerifyNone(t, ignore) }) // runs last: after every server closed
			runFaultCell(t, tc)
		})
	}
}

func runFaultCell(t *testing.T, tc faultCell) {
	var (
		calls     atomic.Int32
		cancelled atomic.Bool
		arrived   = make(chan struct{}, 1)
	)
	up := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		n := int(calls.Add(1))
		select {
		case arrived <- struct{}{}:
		default:
		}
		tc.upstream(w, r, n)
		if r.Context().Err() != nil {
			cancelled.Store(true)
		}
	})
	cfg := testConfig(up.URL)
	cfg.Upstream.APIKey = "sk-upstream-4417"
	cfg.Auth.ClientKeys = []config.Secret{faultKey}
	if tc.summarizer != nil || tc.sumDead {
		sumURL := "http://" + closedPort(t)
		if tc.summarizer != nil {
			sum := newFakeUpstream(t, func(w http.ResponseWriter, r *http.Request, body []byte) { tc.summarizer(w, r) })
			sumURL = sum.URL
		}
		cfg = compactionConfig(up.URL, sumURL)
		cfg.Upstream.APIKey = "sk-upstream-4417"
		cfg.Auth.ClientKeys = []config.Secret{faultKey}
		cfg.Compaction.Trim.ToolResultTokens = 1 << 20 // no trimming: summarize is needed
		cfg.Compaction.Summarizer.Timeout = 300 * time.Millisecond
	}
	if tc.tweak != nil {
		tc.tweak(&cfg)
	}
	p := newTestProxy(t, cfg)
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr}

	body := tc.body
	if body == "" {
		body = faultBody
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if tc.client == clientGivesUp {
		ctx, cancel = context.WithTimeout(ctx, 400*time.Millisecond)
		defer cancel()
	}
	if tc.client == clientLeavesBefore {
		go func() {
			select {
			case <-arrived:
				cancel()
			case <-ctx.Done():
			}
		}()
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+faultKey)
	resp, err := client.Do(req)
	var got []byte
	var readErr error
	var clientID string // X-Request-Id the client got (cells with header checks)
	if err == nil {
		if tc.client == clientLeavesDuring {
			buf := make([]byte, 4096)
			n, _ := resp.Body.Read(buf)
			got = buf[:n]
			cancel()
			_, readErr = io.ReadAll(resp.Body)
			if readErr == nil {
				readErr = errors.New("no error after cancel")
			}
		} else {
			got, readErr = io.ReadAll(resp.Body)
		}
		resp.Body.Close()
	}

	// What the client received.
	switch {
	case tc.status == 0:
		if err == nil {
			t.Errorf("client got status %d, want its own request to end with an error", resp.StatusCode)
		}
	case err != nil:
		t.Fatalf("client request failed: %v", err)
	default:
		if resp.StatusCode != tc.status {
			t.Errorf("client status %d, want %d: %.300q", resp.StatusCode, tc.status, got)
		}
		if tc.aborted != (readErr != nil) {
			t.Errorf("client read error %v, want aborted=%v: %.300q", readErr, tc.aborted, got)
		}
		if tc.code != "" {
			if e := envelope(t, got); e.Code == nil || *e.Code != tc.code {
				t.Errorf("envelope %+v, want code %s", e, tc.code)
			}
		}
		for _, s := range tc.bodyHas {
			if !strings.Contains(string(got), s) {
				t.Errorf("client did not get %.80q: %.300q", s, got)
			}
		}
		if strings.Contains(string(got), "sk-upstream-4417") {
			t.Error("the upstream key reached the client")
		}
		for k, v := range tc.header {
			if got := resp.Header.Get(k); got != v {
				t.Errorf("response header %s = %q, want %q", k, got, v)
			}
		}
		if len(tc.header) > 0 {
			clientID = resp.Header.Get("X-Request-Id")
		}
	}

	// The access log line is written when the handler returns, which may be
	// after the client saw its end.
	waitFor(t, func() bool { return p.logs.FilterMessage("request").Len() >= 1 })

	// What the upstream received.
	if n := int(calls.Load()); n != tc.calls {
		t.Errorf("upstream received %d chat requests, want %d", n, tc.calls)
	}
	for _, r := range up.requests() {
		if !strings.Contains(string(r.Body), faultContent) || r.Header.Get("Authorization") != "Bearer sk-upstream-4417" {
			t.Errorf("upstream request %s %s is not the client's, with the proxy's key", r.Method, r.Path)
		}
	}
	if tc.cancelled {
		waitFor(t, cancelled.Load)
	}

	// Metrics and logs say what happened, without content or keys.
	entries := p.logs.FilterMessage("request").All()
	if len(tc.header) > 0 {
		if logged := fmt.Sprint(entries[0].ContextMap()["request_id"]); clientID != logged {
			t.Errorf("client's X-Request-Id %q, want the one in the access log (%q)", clientID, logged)
		}
	}
	if st := entries[0].ContextMap()["status"]; fmt.Sprint(st) != fmt.Sprint(tc.logStatus) {
		t.Errorf("access log status %v, want %d", st, tc.logStatus)
	}
	for _, m := range tc.logMessages {
		if p.logs.FilterMessage(m).Len() == 0 {
			t.Errorf("no %q log line", m)
		}
	}
	for _, m := range tc.metrics {
		if v := counter(t, p.reg, m.name, m.labels); v != m.value {
			t.Errorf("%s%v = %v, want %v", m.name, m.labels, v, m.value)
		}
	}
	logs := logText(p.logs)
	for _, leak := range []string{faultContent, faultKey, "sk-upstream-4417"} {
		if strings.Contains(logs, leak) {
			t.Errorf("logs carry %q:\n%s", leak, logs)
		}
	}
}

// Issue 20: on Redis with a 3 s TTL, a conversation that keeps talking for
// 10 s keeps its summary: every response's anchor write refreshes the TTL
// of all the conversation's keys, so each request re-applies the summary
// made by the first, and the summarizer is called once. (Before, the
// records key expired 3 s after the summary was made and the conversation
// was summarized again.) Requests come every 500 ms, far inside the TTL.
func TestFaultRedisShortTTLActiveConversation(t *testing.T) {
	rd := storetest.StartRedis(t)
	up := newFakeUpstream(t, nil)
	sum := newSummarizerServer(t)
	cfg := compactionConfig(up.URL, sum.URL)
	cfg.Store.Backend = "redis"
	cfg.Store.Redis.URL = config.Secret(rd.URL())
	cfg.Store.TTL = 3 * time.Second
	cfg.Store.Timeout = time.Second
	cfg.Compaction.Trim.ToolResultTokens = 1 << 20 // no trimming: summarize is needed
	cfg.Compaction.PresummarizeRatio = 0
	p := newTestProxy(t, cfg)
	resp := p.chatOK(t, bigConversation())
	if got := resp.Header.Get("X-Compactproxy-Compaction"); got != "summarized" {
		t.Fatalf("first request: compaction %q, want summarized", got)
	}
	body := bigConversation()
	start := time.Now()
	for i := 0; time.Since(start) < 10*time.Second; i++ {
		time.Sleep(500 * time.Millisecond)
		turn := fmt.Sprintf(`,{"role":"assistant","content":"step %d done"},{"role":"user","content":"go on %d"}]}`, i, i)
		body = strings.TrimSuffix(body, "]}") + turn
		resp := p.chatOK(t, body)
		if got := resp.Header.Get("X-Compactproxy-Compaction"); got != "reused" {
			t.Fatalf("after %v of activity (TTL 3s): compaction %q, want the stored summary reused", time.Since(start).Round(time.Second), got)
		}
	}
	if n := sum.calls.Load(); n != 1 {
		t.Errorf("summarizer called %d times, want once", n)
	}
}
