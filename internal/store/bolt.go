package store

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
	bolt "go.etcd.io/bbolt"
)

var boltBucket = []byte("conversations")

// Bolt is the bolt backend (store.backend bolt): one embedded file, so a
// restarted proxy re-applies the stored summaries and trims. A value is
// [8-byte expiry, Unix ns][uvarint length][anchors][lineages]; both updates
// are read-modify-write inside one bolt transaction (bolt has one writer at
// a time), so an anchor recorded while a summarize runs is never lost when
// the summarize saves. Expired entries are swept in the background, and the
// sweep also evicts the entries nearest to expiry beyond maxEntries, so the
// file's size stays bounded (bolt reuses freed pages; it never shrinks).
type Bolt struct {
	db     *bolt.DB
	ttl    time.Duration
	max    int
	now    func() time.Time
	leases localLeases

	stop chan struct{}
	wg   sync.WaitGroup

	// sweepGap, when set (tests), runs between the sweep's read of the
	// expired keys and the transactions that delete them.
	sweepGap func()
}

// BoltOptions configures OpenBolt.
type BoltOptions struct {
	MaxEntries int           // bound on conversations (0 = none)
	TTL        time.Duration // since the last write (0 = never expires)
	// SweepInterval is how often expired and excess entries are removed
	// (0: a tenth of the TTL, at least 10 s and at most 5 min).
	SweepInterval time.Duration
	// LockTimeout is how long OpenBolt waits for another process to
	// release the file (0: 2 s).
	LockTimeout time.Duration
}

// OpenBolt opens (creating when missing) the state file at path. It fails
// when another process holds the file (bolt's file lock) past LockTimeout.
func OpenBolt(path string, o BoltOptions) (*Bolt, error) {
	if o.LockTimeout <= 0 {
		o.LockTimeout = 2 * time.Second
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: o.LockTimeout, NoFreelistSync: true})
	if err != nil {
		return nil, fmt.Errorf("store: bolt open %s: %w", path, err)
	}
	// The state is a cache of decisions: a power loss may forget the last
	// writes (the next request recomputes them), but a process exit or
	// SIGTERM never does (writes reach the OS at commit). An fsync per
	// anchor write would put disk latency before every response's last
	// byte; the sweeper syncs instead.
	db.NoSync = true
	if err := db.Update(func(tx *bolt.Tx) error {
		_, err := tx.CreateBucketIfNotExists(boltBucket)
		return err
	}); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("store: bolt init: %w", err)
	}
	b := &Bolt{db: db, ttl: o.TTL, max: o.MaxEntries, now: time.Now, stop: make(chan struct{})}
	every := o.SweepInterval
	if every <= 0 {
		every = min(max(o.TTL/10, 10*time.Second), 5*time.Minute)
	}
	b.wg.Add(1)
	go b.sweeper(every)
	return b, nil
}

func (b *Bolt) expiry() int64 {
	if b.ttl <= 0 {
		return 0
	}
	return b.now().Add(b.ttl).UnixNano()
}

// boltValue is one decoded entry; raw halves are kept so an update
// re-encodes only the half it changes.
type boltValue struct {
	exp              int64
	anchors, records []byte
}

func splitBolt(v []byte) (boltValue, bool) {
	if len(v) < 9 {
		return boltValue{}, false
	}
	bv := boltValue{exp: int64(binary.BigEndian.Uint64(v))}
	n, k := binary.Uvarint(v[8:])
	if k <= 0 || uint64(len(v)-8-k) < n {
		return boltValue{}, false
	}
	bv.anchors = v[8+k : 8+k+int(n)]
	bv.records = v[8+k+int(n):]
	return bv, true
}

func (bv boltValue) join() []byte {
	out := make([]byte, 8, 8+binary.MaxVarintLen64+len(bv.anchors)+len(bv.records))
	binary.BigEndian.PutUint64(out, uint64(bv.exp))
	out = binary.AppendUvarint(out, uint64(len(bv.anchors)))
	out = append(out, bv.anchors...)
	return append(out, bv.records...)
}

func (b *Bolt) live(bv boltValue) bool {
	return bv.exp == 0 || b.now().UnixNano() < bv.exp
}

// Load implements Backend.
func (b *Bolt) Load(_ context.Context, key string) (Conversation, bool, error) {
	var c Conversation
	var found bool
	err := b.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(boltBucket).Get([]byte(key))
		bv, ok := splitBolt(v)
		if !ok || !b.live(bv) {
			return nil
		}
		// Decoding copies out of bolt's mmap (valid only inside the tx).
		as, err1 := decodeAnchors(bv.anchors)
		ls, err2 := decodeLineages(bv.records)
		if err1 == nil {
			c.Anchors = as
		}
		if err2 == nil {
			c.Lineages = ls
		}
		found = true
		return nil
	})
	if err != nil {
		return Conversation{}, false, fmt.Errorf("store: bolt load: %w", err)
	}
	return c, found, nil
}

func (b *Bolt) update(key string, fn func(bv *boltValue) bool) error {
	err := b.db.Update(func(tx *bolt.Tx) error {
		bk := tx.Bucket(boltBucket)
		bv, ok := splitBolt(bk.Get([]byte(key)))
		if !ok || !b.live(bv) {
			bv = boltValue{}
		} else {
			bv.anchors = slices.Clone(bv.anchors)
			bv.records = slices.Clone(bv.records)
		}
		if !fn(&bv) {
			return nil
		}
		bv.exp = b.expiry()
		return bk.Put([]byte(key), bv.join())
	})
	if err != nil {
		return fmt.Errorf("store: bolt update: %w", err)
	}
	return nil
}

// UpdateAnchors implements Backend.
func (b *Bolt) UpdateAnchors(_ context.Context, key string, fn func([]anchor.Anchor) ([]anchor.Anchor, bool)) error {
	return b.update(key, func(bv *boltValue) bool {
		cur, _ := decodeAnchors(bv.anchors)
		v, ok := fn(cur)
		if ok {
			bv.anchors = encodeAnchors(v)
		}
		return ok
	})
}

// UpdateLineages implements Backend.
func (b *Bolt) UpdateLineages(_ context.Context, key string, fn func([]compaction.Lineage) ([]compaction.Lineage, bool)) error {
	return b.update(key, func(bv *boltValue) bool {
		cur, _ := decodeLineages(bv.records)
		v, ok := fn(cur)
		if ok {
			bv.records = encodeLineages(boundTrims(v))
		}
		return ok
	})
}

// Delete implements Backend.
func (b *Bolt) Delete(_ context.Context, key string) error {
	return b.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(boltBucket).Delete([]byte(key)) })
}

// Lease implements Backend: one process owns the file (bolt locks it), so
// leases are in-process.
func (b *Bolt) Lease(_ context.Context, name string, ttl time.Duration) (func(), bool, error) {
	rel, ok := b.leases.take(name, ttl)
	return rel, ok, nil
}

func (b *Bolt) sweeper(every time.Duration) {
	defer b.wg.Done()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-b.stop:
			return
		case <-t.C:
			_, _, _ = b.Sweep()
		}
	}
}

// Sweep removes expired entries and, beyond MaxEntries, the ones nearest
// to expiry (the least recently written); it returns how many it removed
// and how many are left.
//
// The candidates are chosen in a read transaction and deleted in later
// write transactions; each is checked again inside the write transaction
// that deletes it (DESIGN § State): an expired entry only if it is still
// expired, an excess one only if nobody wrote it since (its expiry is the
// one the sweep saw). A request that wrote meanwhile keeps its anchor or
// summary.
func (b *Bolt) Sweep() (removed, left int, err error) {
	type ent struct {
		key    []byte
		exp    int64
		expire bool // chosen because it expired (else: beyond MaxEntries)
	}
	var drop []ent
	now := b.now().UnixNano()
	err = b.db.View(func(tx *bolt.Tx) error {
		var keep []ent
		err := tx.Bucket(boltBucket).ForEach(func(k, v []byte) error {
			bv, ok := splitBolt(v)
			if !ok || (bv.exp != 0 && now >= bv.exp) {
				drop = append(drop, ent{key: slices.Clone(k), expire: true})
				return nil
			}
			keep = append(keep, ent{key: slices.Clone(k), exp: bv.exp})
			return nil
		})
		if b.max > 0 && len(keep) > b.max {
			slices.SortFunc(keep, func(x, y ent) int {
				switch {
				case x.exp < y.exp:
					return -1
				case x.exp > y.exp:
					return 1
				}
				return 0
			})
			drop = append(drop, keep[:len(keep)-b.max]...)
			keep = keep[len(keep)-b.max:]
		}
		left = len(keep)
		return err
	})
	if err != nil {
		return 0, 0, fmt.Errorf("store: bolt sweep: %w", err)
	}
	if b.sweepGap != nil {
		b.sweepGap()
	}
	// Delete in batches so a large sweep never holds the writer long.
	for len(drop) > 0 {
		n := min(len(drop), 1000)
		batch := drop[:n]
		drop = drop[n:]
		if err := b.db.Update(func(tx *bolt.Tx) error {
			bk := tx.Bucket(boltBucket)
			now := b.now().UnixNano()
			for _, e := range batch {
				bv, ok := splitBolt(bk.Get(e.key))
				switch {
				case e.expire && ok && (bv.exp == 0 || now < bv.exp):
					left++ // written since: live again
					continue
				case !e.expire && (!ok || bv.exp != e.exp):
					if ok {
						left++ // written since (or gone): not the entry chosen
					}
					continue
				}
				if err := bk.Delete(e.key); err != nil {
					return err
				}
				removed++
			}
			return nil
		}); err != nil {
			return removed, left, fmt.Errorf("store: bolt sweep: %w", err)
		}
	}
	if err := b.db.Sync(); err != nil {
		return removed, left, fmt.Errorf("store: bolt sync: %w", err)
	}
	return removed, left, nil
}

// Size is the state file's size in bytes.
func (b *Bolt) Size() (int64, error) {
	var n int64
	err := b.db.View(func(tx *bolt.Tx) error { n = tx.Size(); return nil })
	return n, err
}

// ValueSize is the stored size of key's value in bytes (0 when absent).
func (b *Bolt) ValueSize(key string) int {
	var n int
	_ = b.db.View(func(tx *bolt.Tx) error { n = len(tx.Bucket(boltBucket).Get([]byte(key))); return nil })
	return n
}

// Close implements Backend: it stops the sweeper, syncs and closes the file.
func (b *Bolt) Close() error {
	select {
	case <-b.stop:
		return nil
	default:
	}
	close(b.stop)
	b.wg.Wait()
	_ = b.db.Sync()
	return b.db.Close()
}
