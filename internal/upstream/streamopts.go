package upstream

import (
	"sync"
	"time"
)

// maxStreamOptionsEntries bounds the memo: model names come from clients.
const maxStreamOptionsEntries = 4096

// StreamOptions remembers, per model identity, that the upstream does
// not accept stream_options (upstream.stream_usage auto). CRAFT habit 18: a
// switch learned from one request is scoped to the model identity, set only
// on proof (the resend without the proxy's stream_options succeeded, so the
// 400 was not the client's own bad field) and expires, so an upgraded
// upstream gets usage injection back. It was one process-wide flag, flipped
// by any 400 mentioning stream_options, forever.
type StreamOptions struct {
	ttl time.Duration
	now func() time.Time

	mu    sync.Mutex
	until map[string]time.Time // identity -> no injection before this time
}

// NewStreamOptions returns an empty memo whose entries last ttl.
func NewStreamOptions(ttl time.Duration) *StreamOptions {
	return &StreamOptions{ttl: ttl, now: time.Now, until: map[string]time.Time{}}
}

// Unsupported reports whether identity is known not to take stream_options.
func (m *StreamOptions) Unsupported(identity string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	t, ok := m.until[identity]
	if ok && !m.now().Before(t) {
		delete(m.until, identity)
		return false
	}
	return ok
}

// Learn records that identity rejected stream_options and accepted the
// same request without them.
func (m *StreamOptions) Learn(identity string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	if len(m.until) >= maxStreamOptionsEntries {
		for k, t := range m.until {
			if !now.Before(t) {
				delete(m.until, k)
			}
		}
		if len(m.until) >= maxStreamOptionsEntries {
			return // full of live entries: keep injecting (and retrying) rather than grow
		}
	}
	m.until[identity] = now.Add(m.ttl)
}
