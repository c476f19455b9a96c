package store

import (
	"context"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
)

// MemoryBackend is the memory backend (store.backend memory): a bounded
// in-process Memory of Conversations. Both updates run under the store's
// lock on the current value, so neither loses the other's write.
type MemoryBackend struct {
	m      *Memory[Conversation]
	leases localLeases
}

// memoryEntryBytes is each conversation's share of the memory backend's
// byte bound (store.max_entries × memoryEntryBytes: 400 MiB at the default
// 100,000): DESIGN's 2 KiB of state per conversation plus room for a
// summary of about a thousand tokens. A conversation may hold more (eight
// lineages, each with a summary and trim records); the bound is on the
// sum, least recently used evicted first, so a store full of large
// summaries holds fewer conversations instead of more memory.
const memoryEntryBytes = 4 << 10

// NewMemoryBackend returns a memory backend of at most maxEntries
// conversations and maxEntries × memoryEntryBytes bytes of state (0: no
// bound), each expiring ttl after its last write.
func NewMemoryBackend(maxEntries int, ttl time.Duration) *MemoryBackend {
	m := NewMemory[Conversation](maxEntries, ttl)
	m.size = conversationBytes
	m.maxBytes = int64(maxEntries) * memoryEntryBytes
	return &MemoryBackend{m: m}
}

// Load implements Backend.
func (b *MemoryBackend) Load(ctx context.Context, key string) (Conversation, bool, error) {
	return b.m.Load(ctx, key)
}

// UpdateAnchors implements Backend.
func (b *MemoryBackend) UpdateAnchors(ctx context.Context, key string, fn func([]anchor.Anchor) ([]anchor.Anchor, bool)) error {
	return b.m.Update(ctx, key, func(c *Conversation) {
		if v, ok := fn(c.Anchors); ok {
			c.Anchors = v
		}
	})
}

// UpdateLineages implements Backend.
func (b *MemoryBackend) UpdateLineages(ctx context.Context, key string, fn func([]compaction.Lineage) ([]compaction.Lineage, bool)) error {
	return b.m.Update(ctx, key, func(c *Conversation) {
		if v, ok := fn(c.Lineages); ok {
			c.Lineages = boundTrims(v)
		}
	})
}

// Delete implements Backend.
func (b *MemoryBackend) Delete(ctx context.Context, key string) error { return b.m.Delete(ctx, key) }

// Lease implements Backend (in-process).
func (b *MemoryBackend) Lease(_ context.Context, name string, ttl time.Duration) (func(), bool, error) {
	rel, ok := b.leases.take(name, ttl)
	return rel, ok, nil
}

// Bytes is the measured size of the state held (conversationBytes).
func (b *MemoryBackend) Bytes() int64 { return b.m.Bytes() }

// Len is the number of conversations held.
func (b *MemoryBackend) Len() int { return b.m.Len() }

// Close implements Backend.
func (b *MemoryBackend) Close() error { return nil }
