// Package store keeps per-conversation state behind one small interface
// (Backend): one read and at most two writes per request, never one round
// trip per message. Backends: memory (bounded by a maximum entry count and
// by bytes, least recently used evicted first, and a TTL since the last
// write), bolt
// (an embedded file that survives restarts, swept in the background) and
// redis (shared by replicas, every key with a TTL, with a lease so one
// replica summarizes a lineage at a time).
package store

import (
	"container/list"
	"context"
	"sync"
	"time"
)

// Memory is an in-process LRU store with a TTL. Values are copied in and
// out by value; V should not share mutable memory with the caller (the
// proxy stores values whose slices it never mutates in place).
type Memory[V any] struct {
	mu    sync.Mutex
	max   int
	ttl   time.Duration
	now   func() time.Time
	ll    *list.List
	items map[string]*list.Element

	// size, when set, measures a value in bytes; then maxBytes (> 0)
	// bounds the sum, least recently used evicted first (the newest
	// entry is always kept).
	size     func(V) int64
	maxBytes int64
	bytes    int64
}

type entry[V any] struct {
	key  string
	val  V
	exp  time.Time
	size int64
}

// NewMemory returns a store holding at most maxEntries values (0 = no
// bound), each expiring ttl after its last write (0 = never).
func NewMemory[V any](maxEntries int, ttl time.Duration) *Memory[V] {
	return &Memory[V]{max: maxEntries, ttl: ttl, now: time.Now, ll: list.New(), items: map[string]*list.Element{}}
}

// Load returns the value under key, and whether it was there.
func (m *Memory[V]) Load(_ context.Context, key string) (V, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var zero V
	el, ok := m.items[key]
	if !ok {
		return zero, false, nil
	}
	e := el.Value.(*entry[V])
	if m.ttl > 0 && m.now().After(e.exp) {
		m.remove(el)
		return zero, false, nil
	}
	m.ll.MoveToFront(el)
	return e.val, true, nil
}

// Save stores v under key.
func (m *Memory[V]) Save(_ context.Context, key string, v V) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.put(key, v)
	return nil
}

// Update applies fn to the value under key (the zero value when absent)
// atomically and stores the result.
func (m *Memory[V]) Update(_ context.Context, key string, fn func(v *V)) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var v V
	if el, ok := m.items[key]; ok {
		e := el.Value.(*entry[V])
		if m.ttl <= 0 || !m.now().After(e.exp) {
			v = e.val
		}
	}
	fn(&v)
	m.put(key, v)
	return nil
}

// Delete forgets key.
func (m *Memory[V]) Delete(_ context.Context, key string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if el, ok := m.items[key]; ok {
		m.remove(el)
	}
	return nil
}

// Len returns the number of entries held (expired ones included until
// they are touched or evicted).
func (m *Memory[V]) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.ll.Len()
}

func (m *Memory[V]) put(key string, v V) {
	exp := time.Time{}
	if m.ttl > 0 {
		exp = m.now().Add(m.ttl)
	}
	var size int64
	if m.size != nil {
		size = m.size(v)
	}
	if el, ok := m.items[key]; ok {
		e := el.Value.(*entry[V])
		m.bytes += size - e.size
		e.val, e.exp, e.size = v, exp, size
		m.ll.MoveToFront(el)
	} else {
		m.items[key] = m.ll.PushFront(&entry[V]{key: key, val: v, exp: exp, size: size})
		m.bytes += size
	}
	for m.ll.Len() > 1 && ((m.max > 0 && m.ll.Len() > m.max) || (m.maxBytes > 0 && m.bytes > m.maxBytes)) {
		m.remove(m.ll.Back())
	}
}

func (m *Memory[V]) remove(el *list.Element) {
	e := el.Value.(*entry[V])
	m.ll.Remove(el)
	delete(m.items, e.key)
	m.bytes -= e.size
}

// Bytes is the measured size of the values held (0 without a size func).
func (m *Memory[V]) Bytes() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bytes
}
