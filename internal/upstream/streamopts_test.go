package upstream

import (
	"testing"
	"time"
)

func TestStreamOptionsMemoExpires(t *testing.T) {
	now := time.Unix(1000, 0)
	m := NewStreamOptions(5 * time.Minute)
	m.now = func() time.Time { return now }
	m.Learn("up\x00old")
	if !m.Unsupported("up\x00old") || m.Unsupported("up\x00new") {
		t.Fatal("learned identity not scoped")
	}
	now = now.Add(5*time.Minute - time.Second)
	if !m.Unsupported("up\x00old") {
		t.Error("forgotten before the interval")
	}
	now = now.Add(time.Second)
	if m.Unsupported("up\x00old") {
		t.Error("not forgotten after upstream.discovery_interval")
	}
	for i := range maxStreamOptionsEntries + 10 {
		m.Learn(string(rune(i)))
	}
	if len(m.until) > maxStreamOptionsEntries {
		t.Errorf("memo grew to %d entries", len(m.until))
	}
}
