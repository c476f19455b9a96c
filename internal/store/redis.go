package store

import (
	"context"
	"crypto/rand"
	"crypto/sha1"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/store/redisurl"
	"github.com/redis/go-redis/v9"
)

// Redis is the redis backend (store.backend redis): state shared by
// replicas, in one Redis node, a master found through Sentinel, or a Redis
// Cluster (store.redis.url, package redisurl). Per conversation two keys,
// anchors and record lineages, so the response path and the compaction
// path never write the same key; a lease is one key of its own:
//
//	single node, Sentinel: <prefix>a:<key>   <prefix>r:<key>   <prefix>l:<name>
//	Cluster:               <prefix>{<key>}:a <prefix>{<key>}:r <prefix>{<name>}:l
//
// On a cluster the conversation part is a hash tag ("{...}"): both keys
// hash to one slot, so MGET, DEL and the compare-and-set script (which
// touches both) run on one node. A single node and a Sentinel master keep
// the untagged names, so a deployment upgraded in place keeps its state.
// The proxy's keys name the tenant by its HMAC and the conversation by an
// opaque digest, never a raw credential or content. Every key is written
// with the TTL, and every write refreshes the TTL of the conversation's
// other key too: they share one lifetime.
//
// Round trips: Load is one MGET; each update is one EVALSHA of a
// compare-and-set script against the value this process last saw (from
// its Load), so a request makes one read and at most two writes. When
// another replica wrote in between, the script answers the current value
// instead and the update is applied to that and sent again.
//
// Redis is state, not a dependency of traffic: every operation is bounded
// by the timeout, and after a failure operations fail fast with
// ErrUnavailable for a second before Redis is tried again. A failover
// (Sentinel or Cluster) fails operations only until go-redis follows the
// new master, which it learns by itself.
type Redis struct {
	c       redis.UniversalClient
	tagged  bool // cluster: a conversation's keys share a hash tag
	prefix  string
	ttl     time.Duration
	timeout time.Duration
	seen    seenCache

	downUntil atomic.Int64 // Unix ns; operations fail fast before it
	pause     time.Duration
}

// RedisOptions configures OpenRedis.
type RedisOptions struct {
	URL     string        // store.redis.url: redis://, rediss://, redis+sentinel://, redis+cluster:// (package redisurl)
	Prefix  string        // key prefix, e.g. "compactproxy:"
	TTL     time.Duration // of every key (must be > 0)
	Timeout time.Duration // per operation (0: 200ms)
}

// casScript sets KEYS[1] to ARGV[2] (PX ARGV[3]) when its current value's
// SHA-1 is ARGV[1] ("" = absent); otherwise it answers {0, current}. A
// successful write also gives KEYS[2], the conversation's other key, the
// TTL again: a conversation's keys share one lifetime (DESIGN § State), so
// the anchors written after every response keep its summary and latch
// alive, and a compaction record keeps its anchors.
var casScript = redis.NewScript(`
local cur = redis.call('GET', KEYS[1])
local h = ''
if cur then h = redis.sha1hex(cur) end
if h ~= ARGV[1] then
  if cur then return {0, cur} end
  return {0}
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if KEYS[2] then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
return {1}
`)

// releaseScript deletes a lease only while it holds the holder's token.
var releaseScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
`)

// quietLogger silences go-redis' own log (process-wide): it prints every
// failed dial, with the address, to stderr. Outages are logged once by the
// proxy, and counted in store_errors_total.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

var quietOnce sync.Once

// OpenRedis connects lazily: it fails only on a bad URL, never because
// Redis is down at start (the proxy serves traffic without it).
func OpenRedis(o RedisOptions) (*Redis, error) {
	u, err := redisurl.Parse(o.URL)
	if err != nil {
		return nil, fmt.Errorf("store: store.redis.url %w", err)
	}
	if o.Timeout <= 0 {
		o.Timeout = 200 * time.Millisecond
	}
	quietOnce.Do(func() { redis.SetLogger(quietLogger{}) })
	var c redis.UniversalClient
	if u.Mode == redisurl.Single {
		// go-redis' own parser, as before: its query options keep working.
		opt, err := redis.ParseURL(o.URL)
		if err != nil {
			// ParseURL's error may quote the URL (and its password).
			return nil, errors.New("store: store.redis.url is not a valid redis:// or rediss:// URL")
		}
		opt.DialTimeout = o.Timeout
		opt.ReadTimeout = o.Timeout
		opt.WriteTimeout = o.Timeout
		opt.ContextTimeoutEnabled = true
		opt.MaxRetries = -1 // a retry would double the time a request waits
		opt.DialerRetries = 1
		opt.DisableIdentity = true
		c = redis.NewClient(opt)
	} else {
		uo := &redis.UniversalOptions{
			Addrs:            u.Addrs,
			Username:         u.Username,
			Password:         u.Password,
			DB:               u.DB,
			MasterName:       u.Master, // "" unless Sentinel
			SentinelUsername: u.SentinelUsername,
			SentinelPassword: u.SentinelPassword,
			IsClusterMode:    u.Mode == redisurl.Cluster, // one seed node is a cluster too

			DialTimeout:           o.Timeout,
			ReadTimeout:           o.Timeout,
			WriteTimeout:          o.Timeout,
			ContextTimeoutEnabled: true,
			MaxRetries:            -1,
			DialerRetries:         1,
			DisableIdentity:       true,
		}
		if u.TLS {
			uo.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12} // server name: each address's host
		}
		c = redis.NewUniversalClient(uo)
	}
	return &Redis{
		c:       c,
		tagged:  u.Mode == redisurl.Cluster,
		prefix:  o.Prefix,
		ttl:     o.TTL,
		timeout: o.Timeout,
		seen:    seenCache{max: 8192},
		pause:   time.Second,
	}, nil
}

func (r *Redis) anchorsKey(key string) string { return r.key("a", key) }
func (r *Redis) recordsKey(key string) string { return r.key("r", key) }
func (r *Redis) leaseKey(name string) string  { return r.key("l", name) }

// key names one of the proxy's keys (see Redis). On a cluster the slot is
// that of the first "{...}" with something inside: the keys of one
// conversation are the same text up to the tag's "}", so they share a
// slot (the proxy's keys begin with the tenant, never with "}", which
// would leave the tag empty). Config validation refuses a prefix with
// braces, which could put every key in one slot.
func (r *Redis) key(kind, name string) string {
	if r.tagged {
		return r.prefix + "{" + name + "}:" + kind
	}
	return r.prefix + kind + ":" + name
}

// op bounds one operation and fails fast while Redis is down.
func (r *Redis) op(ctx context.Context) (context.Context, context.CancelFunc, error) {
	if until := r.downUntil.Load(); until != 0 && time.Now().UnixNano() < until {
		return nil, nil, ErrUnavailable
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.timeout)
	return ctx, cancel, nil
}

// result records whether Redis answered: a transport failure or timeout
// pauses Redis for a second.
func (r *Redis) result(err error) error {
	if err == nil || errors.Is(err, redis.Nil) {
		r.downUntil.Store(0)
		return nil
	}
	var rerr redis.Error
	if errors.As(err, &rerr) {
		return err // Redis answered (a script or command error)
	}
	r.downUntil.Store(time.Now().Add(r.pause).UnixNano())
	return err
}

// Load implements Backend: one MGET of both keys.
func (r *Redis) Load(ctx context.Context, key string) (Conversation, bool, error) {
	ctx, cancel, err := r.op(ctx)
	if err != nil {
		return Conversation{}, false, err
	}
	defer cancel()
	ak, rk := r.anchorsKey(key), r.recordsKey(key)
	vals, err := r.c.MGet(ctx, ak, rk).Result()
	if err = r.result(err); err != nil {
		return Conversation{}, false, fmt.Errorf("store: redis load: %w", err)
	}
	var c Conversation
	found := false
	for i, v := range vals {
		s, ok := v.(string)
		k := ak
		if i == 1 {
			k = rk
		}
		if !ok {
			r.seen.put(k, nil)
			continue
		}
		found = true
		r.seen.put(k, []byte(s))
		// An unreadable value (another format version, a corrupt write)
		// reads as absent, whole: never a partly decoded list that the
		// next write would re-encode (codec.go).
		if i == 0 {
			c.Anchors, _ = decodeAnchors([]byte(s))
		} else {
			c.Lineages, _ = decodeLineages([]byte(s))
		}
	}
	return c, found, nil
}

// casAttempts bounds the compare-and-set retries of one update.
const casAttempts = 12

// errConflict: the compare-and-set lost to concurrent writers every time.
var errConflict = errors.New("store: redis update: too many concurrent writers")

// update is a compare-and-set of rkey; sibling is the conversation's other
// key, whose TTL the write refreshes.
func (r *Redis) update(ctx context.Context, rkey, sibling string, apply func(raw []byte) ([]byte, bool)) error {
	ctx, cancel, err := r.op(ctx)
	if err != nil {
		return err
	}
	defer cancel()
	ttl := max(r.ttl.Milliseconds(), 1)
	// Each lost compare-and-set costs one round trip and brings the current
	// value back. One conversation rarely has more than a couple of writers
	// at once; a burst of them (a swarm on one conversation id, replicas)
	// is spread by a short random pause, all within the operation's timeout.
	for attempt := range casAttempts {
		if attempt >= 2 {
			var j [1]byte
			_, _ = rand.Read(j[:])
			select {
			case <-time.After(time.Duration(j[0]%8+1) * 250 * time.Microsecond):
			case <-ctx.Done():
				return fmt.Errorf("store: redis update: %w", ctx.Err())
			}
		}
		raw, _ := r.seen.get(rkey)
		next, changed := apply(raw)
		if !changed {
			return nil
		}
		expect := ""
		if raw != nil {
			h := sha1.Sum(raw)
			expect = hex.EncodeToString(h[:])
		}
		res, err := casScript.Run(ctx, r.c, []string{rkey, sibling}, expect, next, ttl).Slice()
		if err = r.result(err); err != nil {
			return fmt.Errorf("store: redis update: %w", err)
		}
		if len(res) > 0 {
			if ok, _ := res[0].(int64); ok == 1 {
				r.seen.put(rkey, next)
				return nil
			}
		}
		var cur []byte
		if len(res) > 1 {
			if s, ok := res[1].(string); ok {
				cur = []byte(s)
			}
		}
		r.seen.put(rkey, cur)
	}
	return errConflict
}

// UpdateAnchors implements Backend.
func (r *Redis) UpdateAnchors(ctx context.Context, key string, fn func([]anchor.Anchor) ([]anchor.Anchor, bool)) error {
	return r.update(ctx, r.anchorsKey(key), r.recordsKey(key), func(raw []byte) ([]byte, bool) {
		cur, _ := decodeAnchors(raw)
		v, ok := fn(cur)
		if !ok {
			return nil, false
		}
		return encodeAnchors(v), true
	})
}

// UpdateLineages implements Backend.
func (r *Redis) UpdateLineages(ctx context.Context, key string, fn func([]compaction.Lineage) ([]compaction.Lineage, bool)) error {
	return r.update(ctx, r.recordsKey(key), r.anchorsKey(key), func(raw []byte) ([]byte, bool) {
		cur, _ := decodeLineages(raw)
		v, ok := fn(cur)
		if !ok {
			return nil, false
		}
		return encodeLineages(boundTrims(v)), true
	})
}

// Delete implements Backend.
func (r *Redis) Delete(ctx context.Context, key string) error {
	ctx, cancel, err := r.op(ctx)
	if err != nil {
		return err
	}
	defer cancel()
	ak, rk := r.anchorsKey(key), r.recordsKey(key)
	r.seen.put(ak, nil)
	r.seen.put(rk, nil)
	if err := r.result(r.c.Del(ctx, ak, rk).Err()); err != nil {
		return fmt.Errorf("store: redis delete: %w", err)
	}
	return nil
}

// Lease implements Backend: SET NX PX with a random token; release is a
// compare-and-delete, so a holder whose lease expired (and was taken by
// another replica) never frees the new holder's.
func (r *Redis) Lease(ctx context.Context, name string, ttl time.Duration) (func(), bool, error) {
	ctx, cancel, err := r.op(ctx)
	if err != nil {
		return nil, false, err
	}
	defer cancel()
	var tok [16]byte
	_, _ = rand.Read(tok[:])
	token := hex.EncodeToString(tok[:])
	k := r.leaseKey(name)
	ok, err := r.c.SetNX(ctx, k, token, ttl).Result()
	if err = r.result(err); err != nil {
		return nil, false, fmt.Errorf("store: redis lease: %w", err)
	}
	if !ok {
		return nil, false, nil
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), r.timeout)
		defer cancel()
		// An error leaves the lease to expire by itself.
		_ = r.result(releaseScript.Run(ctx, r.c, []string{k}, token).Err())
	}, true, nil
}

// MemoryUsage is Redis' own account (MEMORY USAGE) of the conversation's
// keys, in bytes.
func (r *Redis) MemoryUsage(ctx context.Context, key string) (int64, error) {
	var n int64
	for _, k := range []string{r.anchorsKey(key), r.recordsKey(key)} {
		v, err := r.c.MemoryUsage(ctx, k).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return 0, err
		}
		n += v
	}
	return n, nil
}

// Close implements Backend.
func (r *Redis) Close() error { return r.c.Close() }

// seenCache holds the raw values this process last saw, so a write can
// compare-and-set without reading first; bounded (cleared when full: a
// miss costs one extra round trip, never a wrong write).
type seenCache struct {
	mu  sync.Mutex
	max int
	m   map[string][]byte
}

func (c *seenCache) get(k string) ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.m[k]
	return v, ok
}

func (c *seenCache) put(k string, v []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil || len(c.m) >= c.max {
		c.m = make(map[string][]byte, 64)
	}
	c.m[k] = v
}
