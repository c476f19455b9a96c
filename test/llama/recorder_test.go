package llama

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// stepHeader is sent by the scripted agent on every request; compactproxy
// forwards a client's own headers, and its summarizer builds requests of
// its own without them, so the recorder tells a forwarded client request
// (header present) from a summarize call (header absent).
const stepHeader = "X-Llamatest-Step"

// upstreamCall is one POST /v1/chat/completions, /v1/responses or
// /v1/messages that reached llama-server.
type upstreamCall struct {
	Seq    int
	Path   string // the request's path
	Step   int    // the client step it belongs to (for summarize calls: the step running when it started, 0 = before step 1)
	Kind   string // "forward" or "summarize" (any call without the step header)
	Body   []byte
	Status int // llama-server's answer; 502 = the recorder could not reach it (see ProxyErr)
	// ProxyErr is the recorder's own error talking to llama-server.
	ProxyErr string
	resp     *lockedBuffer
	// start and end: the request arrived; its answer was read to the end
	// or closed (zero = still running).
	start, end time.Time
}

// closeRecorder notes when compactproxy finished with an answer.
type closeRecorder struct {
	io.Reader
	body io.Closer
	r    *recorder
	c    *upstreamCall
}

func (b closeRecorder) Close() error {
	b.r.mu.Lock()
	if b.c.end.IsZero() {
		b.c.end = time.Now()
	}
	b.r.mu.Unlock()
	return b.body.Close()
}

// reported is what llama-server said about one call.
type reported struct {
	PromptTokens  int     // usage.prompt_tokens (includes cached); -1 = not reported
	CachedTokens  int     // usage.prompt_tokens_details.cached_tokens
	PromptN       int     // timings.prompt_n (evaluated now)
	CacheN        int     // timings.cache_n (reused from the KV cache)
	PromptMS      float64 // timings.prompt_ms (time spent evaluating the prompt)
	Completion    int
	ErrType       string // error.type on a non-200
	NPromptTokens int    // exceed_context_size_error: n_prompt_tokens
	NCtx          int
}

// recorder is a reverse proxy between compactproxy and llama-server that
// keeps every chat-completions request body and the usage of its answer.
// Everything else (/props, /health, /v1/models, ...) passes through.
type recorder struct {
	srv  *httptest.Server
	rp   *httputil.ReverseProxy
	step atomic.Int64

	mu    sync.Mutex
	calls []*upstreamCall
	// others counts the other POSTs by path (a counter compactproxy may
	// call on a compacting step: /tokenize, /v1/messages/count_tokens, ...).
	others map[string]int
}

type callKey struct{}

func newRecorder(t *testing.T, target string) *recorder {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	r := &recorder{others: map[string]int{}}
	r.rp = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(u)
			pr.Out.Host = u.Host
		},
		FlushInterval: -1, // SSE: every event at once, as compactproxy flushes
		// llama-server closes an idle keep-alive connection after 5 s
		// (Keep-Alive: timeout=5), and a POST sent on it as it closes fails
		// with EOF (Go does not resend a POST): the recorder would answer 502
		// for a request llama-server never saw. One connection per request.
		Transport: &http.Transport{DisableKeepAlives: true},
		ErrorHandler: func(w http.ResponseWriter, req *http.Request, err error) {
			if c, _ := req.Context().Value(callKey{}).(*upstreamCall); c != nil {
				r.mu.Lock()
				c.Status, c.ProxyErr, c.end = http.StatusBadGateway, err.Error(), time.Now()
				r.mu.Unlock()
			}
			w.WriteHeader(http.StatusBadGateway)
		},
		ModifyResponse: func(resp *http.Response) error {
			c, _ := resp.Request.Context().Value(callKey{}).(*upstreamCall)
			if c == nil {
				return nil
			}
			r.mu.Lock()
			c.Status = resp.StatusCode
			r.mu.Unlock()
			resp.Body = closeRecorder{io.TeeReader(resp.Body, c.resp), resp.Body, r, c}
			return nil
		},
	}
	r.srv = httptest.NewServer(r)
	t.Cleanup(r.srv.Close)
	return r
}

func (r *recorder) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	if req.Method != http.MethodPost || !isModelCall(req.URL.Path) {
		if req.Method == http.MethodPost {
			r.mu.Lock()
			r.others[req.URL.Path]++
			r.mu.Unlock()
		}
		r.rp.ServeHTTP(w, req)
		return
	}
	body, err := io.ReadAll(req.Body)
	if err != nil {
		http.Error(w, "recorder: read body", http.StatusBadRequest)
		return
	}
	req.Body = io.NopCloser(bytes.NewReader(body))
	c := &upstreamCall{Path: req.URL.Path, Body: body, resp: &lockedBuffer{}, Kind: "summarize", Step: int(r.step.Load()), start: time.Now()}
	if s := req.Header.Get(stepHeader); s != "" {
		c.Kind = "forward"
		c.Step, _ = strconv.Atoi(s)
	}
	r.mu.Lock()
	c.Seq = len(r.calls) + 1
	r.calls = append(r.calls, c)
	r.mu.Unlock()
	r.rp.ServeHTTP(w, req.WithContext(context.WithValue(req.Context(), callKey{}, c)))
	r.mu.Lock()
	if c.end.IsZero() {
		c.end = time.Now()
	}
	r.mu.Unlock()
}

// isModelCall: a request that makes the model generate, in any dialect.
func isModelCall(path string) bool {
	return strings.HasSuffix(path, "/chat/completions") || strings.HasSuffix(path, "/v1/responses") ||
		strings.HasSuffix(path, "/v1/messages")
}

// otherCalls is a copy of the other POSTs' counts.
func (r *recorder) otherCalls() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]int{}
	for k, v := range r.others {
		out[k] = v
	}
	return out
}

// snapshot returns the calls so far; call it when no request is in flight.
func (r *recorder) snapshot() []*upstreamCall {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*upstreamCall(nil), r.calls...)
}

// parseReported reads usage, timings or the error of one answer (a JSON
// body or an SSE stream: the last event that carries them), in any of the
// three dialects, into chat's terms: PromptTokens is the whole prompt,
// cached included. Chat: usage.prompt_tokens (includes
// prompt_tokens_details.cached_tokens). Responses: usage.input_tokens
// (includes input_tokens_details.cached_tokens), in the body or in the
// response.completed event's response. Messages: input_tokens +
// cache_read_input_tokens + cache_creation_input_tokens (disjoint), in the
// body or the message_start event's message (message_delta carries only
// output_tokens). llama-server gives timings on chat answers and in the
// Responses stream's response.completed event only: where they are
// missing, prompt_n is prompt − cached and cache_n is cached.
func parseReported(body []byte) (rep reported) {
	rep = reported{PromptTokens: -1, CachedTokens: -1, PromptN: -1, CacheN: -1}
	type usage struct {
		PromptTokens     *int `json:"prompt_tokens"`
		CompletionTokens *int `json:"completion_tokens"`
		Details          *struct {
			Cached int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
		InputTokens  *int `json:"input_tokens"`
		OutputTokens *int `json:"output_tokens"`
		InputDetails *struct {
			Cached int `json:"cached_tokens"`
		} `json:"input_tokens_details"`
		CacheRead     *int `json:"cache_read_input_tokens"`
		CacheCreation *int `json:"cache_creation_input_tokens"`
	}
	applyUsage := func(u *usage) {
		if u == nil {
			return
		}
		switch {
		case u.PromptTokens != nil:
			rep.PromptTokens = *u.PromptTokens
			if u.Details != nil {
				rep.CachedTokens = u.Details.Cached
			}
		case u.InputTokens != nil && u.InputDetails != nil:
			rep.PromptTokens, rep.CachedTokens = *u.InputTokens, u.InputDetails.Cached
		case u.InputTokens != nil:
			read, creation := 0, 0
			if u.CacheRead != nil {
				read = *u.CacheRead
			}
			if u.CacheCreation != nil {
				creation = *u.CacheCreation
			}
			rep.PromptTokens, rep.CachedTokens = *u.InputTokens+read+creation, read
		}
		if u.CompletionTokens != nil {
			rep.Completion = *u.CompletionTokens
		} else if u.OutputTokens != nil {
			rep.Completion = *u.OutputTokens
		}
	}
	apply := func(obj []byte) {
		var v struct {
			Usage    *usage `json:"usage"`
			Response *struct {
				Usage *usage `json:"usage"`
			} `json:"response"`
			Message *struct {
				Usage *usage `json:"usage"`
			} `json:"message"`
			Timings *struct {
				PromptN  int     `json:"prompt_n"`
				CacheN   int     `json:"cache_n"`
				PromptMS float64 `json:"prompt_ms"`
			} `json:"timings"`
			Error *struct {
				Type          string `json:"type"`
				NPromptTokens int    `json:"n_prompt_tokens"`
				NCtx          int    `json:"n_ctx"`
			} `json:"error"`
		}
		if json.Unmarshal(obj, &v) != nil {
			return
		}
		applyUsage(v.Usage)
		if v.Response != nil {
			applyUsage(v.Response.Usage)
		}
		if v.Message != nil {
			applyUsage(v.Message.Usage)
		}
		if v.Timings != nil {
			rep.PromptN, rep.CacheN, rep.PromptMS = v.Timings.PromptN, v.Timings.CacheN, v.Timings.PromptMS
		}
		if v.Error != nil {
			rep.ErrType, rep.NPromptTokens, rep.NCtx = v.Error.Type, v.Error.NPromptTokens, v.Error.NCtx
		}
	}
	defer func() {
		if rep.PromptN < 0 && rep.PromptTokens >= 0 && rep.CachedTokens >= 0 {
			rep.PromptN, rep.CacheN = rep.PromptTokens-rep.CachedTokens, rep.CachedTokens
		}
	}()
	trimmed := bytes.TrimSpace(body)
	if bytes.HasPrefix(trimmed, []byte("{")) {
		apply(trimmed)
		return rep
	}
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if d, ok := bytes.CutPrefix(line, []byte("data: ")); ok && len(d) > 0 && d[0] == '{' {
			apply(d)
		}
	}
	return rep
}
