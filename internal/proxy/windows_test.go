package proxy

import (
	"testing"
	"time"
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
			w := newWindows(nil, tc.configured)
			w.now = func() time.Time { return now }
			w.accept("m", tc.accepted, ttl)
			w.learn("m", tc.learn, ttl)
			now = now.Add(tc.after)
			if got := w.get("m"); got != tc.want {
				t.Errorf("window %d, want %d", got, tc.want)
			}
			if got := w.get("other"); got != tc.configured {
				t.Errorf("another model's window %d, want %d", got, tc.configured)
			}
		})
	}
}

// A prompt accepted above a learned n_ctx disproves it.
func TestAcceptedPromptDropsLearnedWindow(t *testing.T) {
	w := newWindows(nil, 8000)
	w.learn("m", 3000, time.Minute)
	w.accept("m", 3500, time.Minute)
	if got := w.get("m"); got != 8000 {
		t.Errorf("window %d after the upstream accepted 3500, want 8000", got)
	}
}
