// Package seal seals and opens the payload of a compaction item that
// compactproxy makes itself: when it emulates a provider's own compaction
// API (a Responses "compaction" item's encrypted_content) for an upstream
// that lacks it, the item the client keeps and sends back must be
// unreadable and unforgeable by the client, and refused for any tenant but
// the one it was made for (DESIGN § Other APIs, "The providers' own
// compaction APIs").
//
// A token is Prefix followed by the unpadded base64url encoding of
//
//	version (1 byte) | salt (16) | nonce (12) | AES-256-GCM ciphertext and tag
//
// The key is HKDF-SHA-256 of the secret (store.tenant_secret) with the salt
// and an info string naming the format, its version and the tenant; the
// associated data binds the version, the tenant and the Binding (the
// payload's purpose and the model identity) with length prefixes, so a
// token opens only for the tenant and Binding it was sealed for. A fresh
// salt per token gives every token its own key, so random nonces never
// approach GCM's limit per key.
//
// Every process and replica that shares the secret opens every token: a
// sealed item survives a restart and works across replicas. When
// store.tenant_secret is unset the proxy uses a random secret per process,
// and tokens it sealed are refused after a restart and by other replicas
// (as its tenants' state is not shared either): set store.tenant_secret
// wherever sealed items must outlive the process.
//
// The package is pure (standard library only), never logs, and never puts
// the payload, the secret or the tenant into an error.
package seal

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"io"
	"strings"
)

// Prefix starts every token Seal makes; IsSealed looks for it. "cpxs" is
// compactproxy-sealed, "1" the format version.
const Prefix = "cpxs1_"

// MaxPayload is the largest payload Seal accepts and Open returns. A
// compaction item holds one summary (compaction.summarizer.max_tokens,
// 1024 by default, a few KB of text); the bound keeps what a client can
// make Open decode and authenticate small.
const MaxPayload = 256 << 10

const (
	version   = 1
	saltLen   = 16
	nonceLen  = 12
	tagLen    = 16
	headerLen = 1 + saltLen + nonceLen
	// maxTokenLen is the longest token a MaxPayload payload seals to; a
	// longer one is refused before it is decoded.
	maxTokenLen = len(Prefix) + (headerLen+MaxPayload+tagLen+2)/3*4
	infoLabel   = "compactproxy/seal/v1\x00"
)

// Errors Open and Seal return; callers compare with errors.Is. None of them
// says which check failed beyond its class: a client learns nothing about
// the key, the tenant or the binding from a refusal.
var (
	// ErrNoSecret: New was given an empty secret.
	ErrNoSecret = errors.New("seal: empty secret")
	// ErrMalformed: not a token (no Prefix, not base64url, shorter than
	// a sealed empty payload).
	ErrMalformed = errors.New("seal: malformed token")
	// ErrTooLarge: a payload over MaxPayload, or a token longer than one
	// can seal to.
	ErrTooLarge = errors.New("seal: payload too large")
	// ErrVersion: a token of a format version this build does not know.
	ErrVersion = errors.New("seal: unknown token version")
	// ErrRefused: authentication failed: the token was altered or
	// truncated, or sealed for another tenant or Binding, or under
	// another secret.
	ErrRefused = errors.New("seal: token refused")
)

// Binding is what a token is bound to besides the tenant: Open with another
// Binding refuses it as if it had been altered.
type Binding struct {
	// Purpose names what the payload is, e.g. "responses/compaction";
	// a token made for one purpose is never accepted for another.
	Purpose string
	// Model is the model identity the payload was made for; "" binds
	// none.
	Model string
}

// Sealer seals and opens tokens under one secret. It is safe for
// concurrent use.
type Sealer struct {
	secret []byte
}

// New returns a Sealer for secret (store.tenant_secret, or the proxy's
// random per-process secret when that is unset). The Sealer keeps its own
// copy of secret.
func New(secret []byte) (*Sealer, error) {
	if len(secret) == 0 {
		return nil, ErrNoSecret
	}
	return &Sealer{secret: append([]byte(nil), secret...)}, nil
}

// IsSealed tells whether s looks like a token Seal makes (by its prefix
// only; Open decides whether it is one).
func IsSealed(s string) bool { return strings.HasPrefix(s, Prefix) }

// Seal encrypts payload for tenant and b and returns the token.
func (s *Sealer) Seal(tenant string, b Binding, payload []byte) (string, error) {
	return s.seal(tenant, b, payload, rand.Reader)
}

// seal is Seal with the salt and nonce read from random (tests make
// reproducible tokens with it).
func (s *Sealer) seal(tenant string, b Binding, payload []byte, random io.Reader) (string, error) {
	if len(payload) > MaxPayload {
		return "", ErrTooLarge
	}
	body := make([]byte, headerLen, headerLen+len(payload)+tagLen)
	body[0] = version
	// crypto/rand.Reader never fails (Go 1.24+: the process aborts
	// rather than see an error).
	if _, err := io.ReadFull(random, body[1:headerLen]); err != nil {
		return "", err
	}
	aead, err := s.aead(tenant, body[1:1+saltLen])
	if err != nil {
		return "", err
	}
	body = aead.Seal(body, body[1+saltLen:headerLen], payload, additional(tenant, b))
	out := make([]byte, len(Prefix)+base64.RawURLEncoding.EncodedLen(len(body)))
	copy(out, Prefix)
	base64.RawURLEncoding.Encode(out[len(Prefix):], body)
	return string(out), nil
}

// Open returns the payload of token if it was sealed by Seal under this
// secret for tenant and b, unaltered; otherwise nil and one of the errors
// above.
func (s *Sealer) Open(tenant string, b Binding, token string) ([]byte, error) {
	if !IsSealed(token) {
		return nil, ErrMalformed
	}
	enc := token[len(Prefix):]
	if len(token) > maxTokenLen {
		return nil, ErrTooLarge
	}
	// Only the unpadded base64url alphabet: the decoder would skip CR and
	// LF, and accept non-zero trailing bits without Strict, so two
	// different strings could open as one token.
	for i := 0; i < len(enc); i++ {
		c := enc[i]
		if !('A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
			return nil, ErrMalformed
		}
	}
	body, err := base64.RawURLEncoding.Strict().DecodeString(enc)
	if err != nil {
		return nil, ErrMalformed
	}
	if len(body) < headerLen+tagLen {
		return nil, ErrMalformed
	}
	if body[0] != version {
		return nil, ErrVersion
	}
	aead, err := s.aead(tenant, body[1:1+saltLen])
	if err != nil {
		return nil, err
	}
	payload, err := aead.Open(nil, body[1+saltLen:headerLen], body[headerLen:], additional(tenant, b))
	if err != nil {
		return nil, ErrRefused
	}
	if payload == nil {
		payload = []byte{}
	}
	return payload, nil
}

// aead is AES-256-GCM under the key for tenant and salt.
func (s *Sealer) aead(tenant string, salt []byte) (cipher.AEAD, error) {
	key, err := hkdf.Key(sha256.New, s.secret, salt, infoLabel+tenant, 32)
	if err != nil {
		return nil, err
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(block)
}

// additional is the associated data: the version, then tenant, purpose and
// model, each with its length, so no two different triples share bytes.
func additional(tenant string, b Binding) []byte {
	ad := make([]byte, 0, len(infoLabel)+1+12+len(tenant)+len(b.Purpose)+len(b.Model))
	ad = append(ad, infoLabel...)
	ad = append(ad, version)
	for _, f := range [...]string{tenant, b.Purpose, b.Model} {
		n := uint32(len(f))
		ad = append(ad, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
		ad = append(ad, f...)
	}
	return ad
}
