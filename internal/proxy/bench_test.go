package proxy

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/chat/chattest"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/compactproxy/compactproxy/internal/identity"
	"github.com/compactproxy/compactproxy/internal/pairing"
	"github.com/compactproxy/compactproxy/internal/upstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// BenchmarkChatPath measures the chat path (parse, pairing, digests,
// estimate, forward, usage record) with an in-process upstream, at 16 KB
// and 1 MiB, next to "bare": a handler that only reads the body and
// forwards it, measured in the same run. Report the ratio.
func BenchmarkChatPath(b *testing.B) {
	for _, size := range []struct {
		name string
		n    int
	}{{"16KB", 16 << 10}, {"1MiB", 1 << 20}} {
		body := chattest.AgentBody(size.n, false)
		up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, okCompletion)
		}))
		benchTargets(b, size.name+"/", up.URL, body)
		up.Close()
	}
}

func newBenchProxy(b *testing.B, cfg config.Config) http.Handler {
	b.Helper()
	srv, err := New(cfg, zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { srv.Close() })
	return srv.Handler()
}

// BenchmarkStreamPath is the 16 KB agent request streamed (usage injected
// and hidden), next to the bare forwarder, in the same run.
func BenchmarkStreamPath(b *testing.B) {
	body := chattest.AgentBody(16<<10, true)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for _, c := range []string{"Hel", "lo", " world"} {
			io.WriteString(w, `data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"`+c+`"}}]}`+"\n\n")
			w.(http.Flusher).Flush()
		}
		if bytes.Contains(in, []byte(`"include_usage":true`)) {
			io.WriteString(w, "data: "+usageChunk+"\n\n")
		}
		io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer up.Close()
	benchTargets(b, "", up.URL, body)
}

// bareForwarder is the floor a proxy is compared with: read the body and
// forward it to the upstream, nothing else.
func bareForwarder(target string) http.Handler {
	client := &http.Client{Transport: upstream.NewTransport()}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, _ := io.ReadAll(r.Body)
		resp, err := client.Post(target+"/v1/chat/completions", "application/json", bytes.NewReader(in))
		if err != nil {
			w.WriteHeader(502)
			return
		}
		defer resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
		io.Copy(w, resp.Body)
	})
}

// BenchmarkPairingAgentBodies is what the pairing check adds to a request
// of the load harness's sizes (view conversion + pairing.Check), next to
// parsing the same body, in the same run.
func BenchmarkPairingAgentBodies(b *testing.B) {
	for _, size := range []struct {
		name string
		n    int
	}{{"16KB", 16 << 10}, {"1MiB", 1 << 20}} {
		body := chattest.AgentBody(size.n, false)
		req, err := chat.Parse(body)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(size.name+"/parse", func(b *testing.B) {
			for b.Loop() {
				if _, err := chat.Parse(body); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(size.name+"/pairing", func(b *testing.B) {
			for b.Loop() {
				if vs := pairing.Check(compaction.PairingView(req.Messages)); len(vs) != 0 {
					b.Fatal(vs)
				}
			}
		})
	}
}

// benchTargets posts body to the bare forwarder and to compactproxy, both in
// front of the upstream at upURL, as sub-benchmarks of the same run.
func benchTargets(b *testing.B, prefix, upURL string, body []byte) {
	cfg := testConfig(upURL)
	cfg.Upstream.ContextWindow = 1000000
	for _, target := range []struct {
		name string
		h    http.Handler
	}{{"bare", bareForwarder(upURL)}, {"compactproxy", newBenchProxy(b, cfg)}} {
		b.Run(prefix+target.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body))
				req.Header.Set("Authorization", "Bearer k")
				w := httptest.NewRecorder()
				target.h.ServeHTTP(w, req)
				if w.Code != 200 {
					b.Fatalf("status %d: %s", w.Code, w.Body.String())
				}
			}
		})
	}
}

// BenchmarkAgentSteps is an agent's loop at about 1 MiB of history: every
// request is the previous one plus one assistant turn and its tool answer
// (cycling through 32 steps), next to the bare forwarder and to
// compactproxy without its parse cache, in the same run. With the cache,
// a step parses, hashes and chains only its new messages.
func BenchmarkAgentSteps(b *testing.B) {
	steps := 0
	for len(chattest.AgentSteps(steps+50, false)) < 1<<20 {
		steps += 50
	}
	bodies := make([][]byte, 32)
	for i := range bodies {
		bodies[i] = chattest.AgentSteps(steps+i, false)
	}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, okCompletion)
	}))
	defer up.Close()
	cfg := testConfig(up.URL)
	cfg.Upstream.ContextWindow = 1000000
	nocache := func() http.Handler {
		srv, err := New(cfg, zap.NewNop(), prometheus.NewRegistry())
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { srv.Close() })
		srv.ids = identity.New(srv.upstreamName, srv.local, 0)
		return srv.Handler()
	}
	for _, target := range []struct {
		name string
		h    http.Handler
	}{{"bare", bareForwarder(up.URL)}, {"compactproxy", newBenchProxy(b, cfg)}, {"compactproxy-nocache", nocache()}} {
		b.Run("1MiB/"+target.name, func(b *testing.B) {
			b.SetBytes(int64(len(bodies[0])))
			i := 0
			for b.Loop() {
				req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(bodies[i%len(bodies)]))
				req.Header.Set("Authorization", "Bearer k")
				w := httptest.NewRecorder()
				target.h.ServeHTTP(w, req)
				if w.Code != 200 {
					b.Fatalf("status %d: %s", w.Code, w.Body.String())
				}
				i++
			}
		})
	}
}
