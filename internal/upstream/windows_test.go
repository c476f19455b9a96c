package upstream

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
)

// A learned n_ctx lowers the window only as evidence allows: never below a
// prompt the upstream accepted, and only for upstream.discovery_interval
// (DESIGN § Window).
func TestLearnedWindowBounds(t *testing.T) {
	const ttl = 5 * time.Minute
	cases := []struct {
		name       string
		configured int
		accepted   int // a prompt the upstream accepted first (0: none)
		learn      int
		after      time.Duration // time passed after learning
		want       int
	}{
		{"lowers the configured window", 8000, 0, 3000, 0, 3000},
		{"never raises it", 8000, 0, 9000, 0, 8000},
		{"expires after discovery_interval", 8000, 0, 3000, ttl, 8000},
		{"refused below an accepted prompt", 8000, 5000, 3000, 0, 8000},
		{"kept at or above an accepted prompt", 8000, 3000, 4000, 0, 4000},
		{"the only window, until it expires", 0, 0, 3000, ttl - time.Second, 3000},
		{"unknown once expired", 0, 0, 3000, ttl + time.Second, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			now := time.Unix(1_000_000, 0)
			w := NewWindows(nil, tc.configured)
			w.now = func() time.Time { return now }
			w.Accept(Scope{Model: "m"}, tc.accepted, ttl)
			w.Learn(Scope{Model: "m"}, tc.learn, ttl)
			now = now.Add(tc.after)
			if got := w.GetFor(Scope{Model: "m"}); got != tc.want {
				t.Errorf("window %d, want %d", got, tc.want)
			}
			if got := w.GetFor(Scope{Model: "other"}); got != tc.configured {
				t.Errorf("another model's window %d, want %d", got, tc.configured)
			}
		})
	}
}

// A prompt accepted above a learned n_ctx disproves it.
func TestAcceptedPromptDropsLearnedWindow(t *testing.T) {
	w := NewWindows(nil, 8000)
	w.Learn(Scope{Model: "m"}, 3000, time.Minute)
	w.Accept(Scope{Model: "m"}, 3500, time.Minute)
	if got := w.GetFor(Scope{Model: "m"}); got != 8000 {
		t.Errorf("window %d after the upstream accepted 3500, want 8000", got)
	}
}

// A learned window and the accepted prompts that bound it are per tenant,
// model and window-shaping headers: tenant A's prompt accepted under
// Anthropic's 1M beta does not stop tenant B's 200k from being learned,
// and what B learned lowers only B's window (DESIGN § Window).
func TestLearnedWindowScope(t *testing.T) {
	const ttl = time.Minute
	beta := http.Header{"Anthropic-Beta": {"interleaved-thinking-2025-05-14, context-1m-2025-08-07"}}
	a1m := Scope{Tenant: "a", Model: "claude", Shape: WindowShape(beta)}
	a := Scope{Tenant: "a", Model: "claude"}
	b := Scope{Tenant: "b", Model: "claude", Shape: WindowShape(http.Header{"Anthropic-Beta": {"fine-grained-tool-streaming-2025-05-14"}})}
	if a1m.Shape != "context-1m-2025-08-07" || b.Shape != "" {
		t.Fatalf("window shapes %q and %q, want the context beta alone and none", a1m.Shape, b.Shape)
	}
	w := NewWindows(nil, 1_000_000)
	w.Accept(a1m, 600_000, ttl)
	if !w.Learn(b, 200_000, ttl) {
		t.Fatal("tenant B's own overflow was refused because of tenant A's accepted prompt")
	}
	for _, c := range []struct {
		sc   Scope
		want int
	}{{b, 200_000}, {a1m, 1_000_000}, {a, 1_000_000}, {Scope{Tenant: "b", Model: "other"}, 1_000_000}} {
		if got := w.GetFor(c.sc); got != c.want {
			t.Errorf("window in %+v: %d, want %d", c.sc, got, c.want)
		}
	}
	// Within one scope the accepted prompt still bounds what is learned.
	if w.Learn(a1m, 200_000, ttl) || w.GetFor(a1m) != 1_000_000 {
		t.Error("a window below a prompt accepted in the same scope was learned")
	}
}

// TestDiscoverModelsList: the window is read from an OpenAI-style /models
// list in the fields servers and gateways use, per model.
func TestDiscoverModelsList(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/models" {
			w.WriteHeader(404)
			return
		}
		io.WriteString(w, `{"object":"list","data":[{"id":"vllm","max_model_len":32768},{"id":"router","context_length":40000},{"id":"groq","context_window":131072},{"id":"mistral","max_context_length":65536},{"id":"none"}]}`)
	}))
	defer up.Close()
	cfg := config.Default()
	cfg.Upstream.URL = up.URL + "/v1"
	c, err := New(cfg.Upstream, cfg.Retry, cfg.Models, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !c.Discover(context.Background()) {
		t.Fatal("nothing discovered")
	}
	for model, want := range map[string]int{"vllm": 32768, "router": 40000, "groq": 131072, "mistral": 65536, "none": 0} {
		if got := c.Windows.GetFor(Scope{Model: model}); got != want {
			t.Errorf("%s: window %d, want %d", model, got, want)
		}
	}
}
