package proxy

import (
	"crypto/subtle"
	"net/http"

	"github.com/compactproxy/compactproxy/internal/identity"
)

// clientAuth enforces auth.client_keys when the proxy holds the upstream key,
// so a proxy in front of a hosted API is not an open relay for that key.
type clientAuth struct {
	required       bool // upstream.api_key is set
	allowAnonymous bool
	keys           [][]byte
}

// allow reports whether the request may proceed.
func (a *clientAuth) allow(h http.Header) bool {
	if !a.required || a.allowAnonymous {
		return true
	}
	k := []byte(identity.BareKey(identity.Credential(h)))
	if len(k) == 0 {
		return false
	}
	ok := false
	for _, want := range a.keys {
		// Constant time per key; go through all keys.
		if subtle.ConstantTimeCompare(k, want) == 1 {
			ok = true
		}
	}
	return ok
}
