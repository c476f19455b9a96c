package store

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
)

// Conversation is what a request reads of its conversation in one round
// trip: the anchors (written by the response path) and the record lineages
// (written by the compaction path). The two are stored apart, so neither
// write can lose the other's (DESIGN § State).
type Conversation struct {
	Anchors  []anchor.Anchor
	Lineages []compaction.Lineage
}

// Backend is a conversation-state store: one read (Load) and at most two
// writes (UpdateAnchors, UpdateLineages) per request, never one round trip
// per message. The update functions may run more than once (a shared
// backend retries on a concurrent write) and must not keep or modify their
// argument; they return the new value and whether it changed (false: no
// write). Keys are the proxy's tenant-bound conversation keys.
type Backend interface {
	Load(ctx context.Context, key string) (Conversation, bool, error)
	UpdateAnchors(ctx context.Context, key string, fn func([]anchor.Anchor) ([]anchor.Anchor, bool)) error
	UpdateLineages(ctx context.Context, key string, fn func([]compaction.Lineage) ([]compaction.Lineage, bool)) error
	Delete(ctx context.Context, key string) error
	// Lease takes the named lease for ttl: ok false when another holder
	// has it. release frees it only while it is still this holder's (a
	// lease that expired and was taken by another is left alone).
	Lease(ctx context.Context, name string, ttl time.Duration) (release func(), ok bool, err error)
	// Close stops background work and releases the backend.
	Close() error
}

// Trim records are bounded per lineage by bytes: one is kept per long tool
// result outside the tail, so a long agent run without a summary would
// otherwise grow them with the conversation. Past maxTrimBytes the oldest
// (lowest index) are let go: those messages are re-trimmed when needed
// (trimming needs no model call).
const (
	trimRecordBytes = 48       // a compaction.Trim: index, 32-byte prefix digest, keep
	maxTrimBytes    = 64 << 10 // per lineage: 1,365 records
)

// boundTrims returns ls with every lineage's trim records within
// maxTrimBytes (the newest kept). ls is not modified; a lineage that needs
// no cut shares its records.
func boundTrims(ls []compaction.Lineage) []compaction.Lineage {
	const most = maxTrimBytes / trimRecordBytes
	var out []compaction.Lineage
	for i, l := range ls {
		if len(l.State.Trims) <= most {
			continue
		}
		if out == nil {
			out = slices.Clone(ls)
		}
		out[i].State.Trims = l.State.Trims[len(l.State.Trims)-most:]
	}
	if out == nil {
		return ls
	}
	return out
}

// Sizes the memory backend counts a conversation at (conversationBytes):
// the fixed part of an anchor and of a lineage as held in memory.
const (
	anchorBytes  = 80
	lineageBytes = 256
	dropBytes    = 48
)

// conversationBytes is about how much memory c holds.
func conversationBytes(c Conversation) int64 {
	n := int64(len(c.Anchors)) * anchorBytes
	for _, l := range c.Lineages {
		st := &l.State
		n += lineageBytes + int64(len(st.Trims))*trimRecordBytes + int64(len(st.Drops))*dropBytes
		if st.Summary != nil {
			n += int64(len(st.Summary.Text))
		}
		if st.Pending != nil {
			n += int64(len(st.Pending.Text))
		}
	}
	return n
}

// ErrUnavailable is returned, without a round trip, while a shared backend
// is considered down after a failure (it is tried again after a short
// pause, so the proxy recovers by itself).
var ErrUnavailable = errors.New("store: unavailable")

// localLeases are leases within one process (memory and bolt: only one
// process uses the state).
type localLeases struct {
	mu  sync.Mutex
	now func() time.Time
	m   map[string]localLease
	seq uint64
}

type localLease struct {
	token uint64
	exp   time.Time
}

func (l *localLeases) take(name string, ttl time.Duration) (func(), bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[string]localLease{}
	}
	now := time.Now()
	if l.now != nil {
		now = l.now()
	}
	if cur, ok := l.m[name]; ok && now.Before(cur.exp) {
		return nil, false
	}
	for k, v := range l.m { // keep the map small: drop expired leases
		if !now.Before(v.exp) {
			delete(l.m, k)
		}
	}
	l.seq++
	tok := l.seq
	l.m[name] = localLease{token: tok, exp: now.Add(ttl)}
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if cur, ok := l.m[name]; ok && cur.token == tok {
			delete(l.m, name)
		}
	}, true
}
