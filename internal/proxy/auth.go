package proxy

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"net/http"
	"strings"
)

// credential returns the client's credential as sent: the Authorization
// header, else x-api-key, else api-key; "" when none.
func credential(h http.Header) string {
	if v := h.Get("Authorization"); v != "" {
		return v
	}
	if v := h.Get("X-Api-Key"); v != "" {
		return v
	}
	return h.Get("Api-Key")
}

// bareKey strips a "Bearer " prefix.
func bareKey(cred string) string {
	if len(cred) > 7 && strings.EqualFold(cred[:7], "bearer ") {
		return strings.TrimSpace(cred[7:])
	}
	return strings.TrimSpace(cred)
}

// anonymousTenant is the tenant of requests without a credential.
const anonymousTenant = "anonymous"

// tenantOf derives the tenant from the client's credential: HMAC-SHA-256 with
// the tenant secret, so raw keys are never stored or compared later.
func tenantOf(secret []byte, h http.Header) string {
	c := credential(h)
	if c == "" {
		return anonymousTenant
	}
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(bareKey(c)))
	return "t:" + hex.EncodeToString(m.Sum(nil))
}

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
	k := []byte(bareKey(credential(h)))
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
