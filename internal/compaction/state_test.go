package compaction

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
)

// A conversation's state, without the summary text and the trim records,
// stays within DESIGN's 2 KiB.
func TestStateSize(t *testing.T) {
	s := State{
		Summary:    &Summary{Cut: 1 << 20, Lead: 3, Ack: true, Ask: 1 << 19, AskInline: true},
		Drops:      []Drop{{From: 1 << 18, To: 1 << 19}, {From: 1<<19 + 1, To: 1 << 20}},
		Latched:    true,
		LatchCount: 1 << 20, LastAttempt: time.Now(), LastAttemptCount: 1 << 20,
	}
	for i := 0; i < MaxAnchors+2; i++ {
		s.AddAnchor(anchor.Anchor{PrefixLen: 1<<20 + i, Input: 1 << 30, Output: 1 << 20, At: time.Now().Unix(), Local: 1 << 30})
	}
	for i := range s.Summary.Head {
		s.Summary.Head[i], s.Drops[0].Prefix[i], s.Drops[1].Prefix[i] = 0xff, 0xff, 0xff
	}
	data, err := json.Marshal(s) // a verbose encoding: digests as arrays of numbers
	if err != nil {
		t.Fatal(err)
	}
	if len(data) > 2048 {
		t.Fatalf("state is %d bytes: %s", len(data), data)
	}
	t.Logf("state without summary text and trims: %d bytes as JSON", len(data))
}
