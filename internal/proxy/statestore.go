package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"

	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/compactproxy/compactproxy/internal/store"
	"go.uber.org/zap"
)

// openStore builds the configured state backend (store.backend).
func openStore(c config.Store) (store.Backend, error) {
	switch c.Backend {
	case "", "memory":
		return store.NewMemoryBackend(c.MaxEntries, c.TTL), nil
	case "bolt":
		b, err := store.OpenBolt(c.Bolt.Path, store.BoltOptions{MaxEntries: c.MaxEntries, TTL: c.TTL})
		if err != nil {
			return nil, err
		}
		return b, nil
	case "redis":
		r, err := store.OpenRedis(store.RedisOptions{URL: c.Redis.URL.Reveal(), Prefix: c.Redis.Prefix, TTL: c.TTL, Timeout: c.Timeout})
		if err != nil {
			return nil, err
		}
		return r, nil
	}
	return nil, fmt.Errorf("store: unknown backend %q", c.Backend)
}

// storeHealth remembers whether the store is failing, so an outage is
// logged once when it starts and once when it ends, not per request.
type storeHealth struct {
	down atomic.Bool
}

// storeResult counts a failed store operation (store_errors_total{op}) and
// logs the first failure of an outage and the recovery.
func (s *Server) storeResult(reqID, op string, err error) {
	if err == nil {
		if s.storeHealth.down.CompareAndSwap(true, false) {
			s.log.Info("state store recovered", zap.String("op", op))
		}
		return
	}
	s.metrics.StoreErrors.WithLabelValues(op).Inc()
	if s.storeHealth.down.CompareAndSwap(false, true) {
		kind := "error"
		var ne net.Error
		switch {
		case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
			kind = "timeout"
		case errors.Is(err, store.ErrUnavailable):
			kind = "unavailable"
		}
		// The error text of a store client may quote addresses; the kind
		// and the operation are what an operator needs here.
		s.log.Warn("state store failing; forwarding without new compaction until it recovers",
			zap.String("request_id", reqID), zap.String("op", op), zap.String("kind", kind))
	}
}

// driverObserver is what the proxy counts and logs of the driver's work.
type driverObserver struct{ s *Server }

func (o driverObserver) StoreResult(reqID, op string, err error) { o.s.storeResult(reqID, op, err) }

func (o driverObserver) Decided(reqID, conversation string, out compaction.Output) {
	o.s.countCompaction(reqID, conversation, out)
}

func (o driverObserver) ChainFailed() { o.s.metrics.CompactionErrors.Inc() }

func (o driverObserver) Background(ok bool) {
	if ok {
		o.s.metrics.Presummarize.WithLabelValues("success").Inc()
	} else {
		o.s.metrics.Presummarize.WithLabelValues("failure").Inc()
	}
}
