package identity

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strings"
)

// AnonymousTenant is the tenant of requests without a credential.
const AnonymousTenant = "anonymous"

// Credential returns the client's credential as sent: the Authorization
// header, else x-api-key, else api-key; "" when none.
func Credential(h http.Header) string {
	if v := h.Get("Authorization"); v != "" {
		return v
	}
	if v := h.Get("X-Api-Key"); v != "" {
		return v
	}
	return h.Get("Api-Key")
}

// BareKey strips a "Bearer " prefix.
func BareKey(cred string) string {
	if len(cred) > 7 && strings.EqualFold(cred[:7], "bearer ") {
		return strings.TrimSpace(cred[7:])
	}
	return strings.TrimSpace(cred)
}

// Tenant derives the tenant from the client's credential: HMAC-SHA-256
// with the tenant secret, so raw keys are never stored or compared later.
func Tenant(secret []byte, h http.Header) string {
	c := Credential(h)
	if c == "" {
		return AnonymousTenant
	}
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(BareKey(c)))
	return "t:" + hex.EncodeToString(m.Sum(nil))
}
