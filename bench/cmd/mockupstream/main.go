// Command mockupstream is the load harness's OpenAI-compatible upstream: it
// reads every request body in full, waits a fixed latency (20 ms by
// default, standing in for the model), and answers a small chat completion
// with usage, or for "stream": true an SSE stream whose first byte leaves
// after the latency: a role chunk, a few content chunks, a finish chunk, a
// usage-only chunk when stream_options.include_usage is set, then
// "data: [DONE]". GET /v1/models answers a one-model list.
//
// It binds the given address (127.0.0.1:0 picks a free port) and writes the
// address it got to -addr-file, so bench/run.sh never races for ports.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to bind")
	addrFile := flag.String("addr-file", "", "write the bound address to this file")
	latency := flag.Duration("latency", 20*time.Millisecond, "fixed latency before the first response byte")
	idle := flag.Duration("idle-timeout", 0, "close keep-alive connections idle this long (0: never); the soak uses it to see the proxy's pools drain")
	flag.Parse()

	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("mockupstream: listen: %v", err)
	}
	if *addrFile != "" {
		if err := os.WriteFile(*addrFile, []byte(ln.Addr().String()), 0o644); err != nil {
			log.Fatalf("mockupstream: %v", err)
		}
	}
	m := &mock{latency: *latency}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", m.chat)
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"object":"list","data":[{"id":"bench-model","object":"model","created":1700000000,"owned_by":"mock"}]}`)
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{"status":"ok"}`) })
	// No server timeouts: like an LLM server, and so the mock never cuts a
	// slow proxy off.
	log.Fatal((&http.Server{Handler: mux, IdleTimeout: *idle}).Serve(ln))
}

type mock struct {
	latency time.Duration
}

var bufPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

func (m *mock) chat(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	buf := bufPool.Get().(*bytes.Buffer)
	buf.Reset()
	defer bufPool.Put(buf)
	if _, err := buf.ReadFrom(r.Body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	body := buf.Bytes()
	// The harness controls the bodies: a scan for the two keys is enough and
	// keeps the mock's CPU (which shares the cores with the proxies) small.
	// The keys are looked up at any depth, which is fine for these bodies.
	stream := boolKey(body, "stream")
	includeUsage := boolKey(body, "include_usage")
	prompt := len(body)/4 + 1
	usage := `{"prompt_tokens":` + strconv.Itoa(prompt) + `,"completion_tokens":12,"total_tokens":` + strconv.Itoa(prompt+12) + `,"prompt_tokens_details":{"cached_tokens":0}}`

	if d := m.latency - time.Since(start); d > 0 {
		time.Sleep(d)
	}
	created := strconv.FormatInt(time.Now().Unix(), 10)
	if !stream {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"chatcmpl-bench","object":"chat.completion","created":`+created+
			`,"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"Done: the file was read and the test passes."},"finish_reason":"stop","logprobs":null}],"usage":`+usage+`}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	fl := w.(http.Flusher)
	u := ""
	if includeUsage {
		u = `,"usage":null`
	}
	event := func(choices, usage string) {
		fmt.Fprintf(w, "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":%s,\"model\":\"bench-model\",\"choices\":%s%s}\n\n", created, choices, usage)
		fl.Flush()
	}
	event(`[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]`, u)
	// X-Mock-Stream-Duration (the soak): content events every
	// X-Mock-Stream-Interval (default 500ms) for that long, as a long
	// generation does. The stream ends early when the client leaves.
	if d, err := time.ParseDuration(r.Header.Get("X-Mock-Stream-Duration")); err == nil && d > 0 {
		every, err := time.ParseDuration(r.Header.Get("X-Mock-Stream-Interval"))
		if err != nil || every <= 0 {
			every = 500 * time.Millisecond
		}
		t := time.NewTicker(every)
		end := time.After(d)
	long:
		for {
			select {
			case <-r.Context().Done():
				t.Stop()
				return
			case <-end:
				break long
			case <-t.C:
				event(`[{"index":0,"delta":{"content":"a token or two of a long answer "},"finish_reason":null}]`, u)
			}
		}
		t.Stop()
	}
	for _, piece := range []string{"Done: ", "the file was read ", "and the test passes."} {
		event(`[{"index":0,"delta":{"content":"`+piece+`"},"finish_reason":null}]`, u)
	}
	event(`[{"index":0,"delta":{},"finish_reason":"stop"}]`, u)
	if includeUsage {
		event(`[]`, `,"usage":`+usage)
	}
	io.WriteString(w, "data: [DONE]\n\n")
	fl.Flush()
}

// boolKey reports whether body contains "key" : true (whitespace allowed).
func boolKey(body []byte, key string) bool {
	pat := []byte(`"` + key + `"`)
	for off := 0; ; {
		i := bytes.Index(body[off:], pat)
		if i < 0 {
			return false
		}
		j := off + i + len(pat)
		for j < len(body) && isSpace(body[j]) {
			j++
		}
		if j < len(body) && body[j] == ':' {
			j++
			for j < len(body) && isSpace(body[j]) {
				j++
			}
			if bytes.HasPrefix(body[j:], []byte("true")) {
				return true
			}
		}
		off = j
	}
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }
