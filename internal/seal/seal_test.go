package seal

import (
	"bytes"
	"encoding/base64"
	"errors"
	"strings"
	"testing"
)

var (
	secret  = []byte("tenant-secret-for-tests")
	binding = Binding{Purpose: "responses/compaction", Model: "llama|qwen2.5-7b"}
)

func newSealer(t *testing.T, s []byte) *Sealer {
	t.Helper()
	sl, err := New(s)
	if err != nil {
		t.Fatal(err)
	}
	return sl
}

func TestRoundTrip(t *testing.T) {
	s := newSealer(t, secret)
	for _, n := range []int{0, 1, 100, 4096, MaxPayload} {
		payload := bytes.Repeat([]byte{'x'}, n)
		token, err := s.Seal("tenant-a", binding, payload)
		if err != nil {
			t.Fatalf("Seal(%d bytes): %v", n, err)
		}
		if !strings.HasPrefix(token, Prefix) || !IsSealed(token) {
			t.Fatalf("token %.20q lacks the prefix %q", token, Prefix)
		}
		if n >= 16 && strings.Contains(token, string(payload[:16])) {
			t.Fatalf("token shows the payload in clear")
		}
		got, err := s.Open("tenant-a", binding, token)
		if err != nil {
			t.Fatalf("Open(%d bytes): %v", n, err)
		}
		if !bytes.Equal(got, payload) {
			t.Fatalf("Open = %d bytes, want the %d sealed", len(got), n)
		}
	}
}

func TestSealIsRandomized(t *testing.T) {
	s := newSealer(t, secret)
	a, _ := s.Seal("t", binding, []byte("same"))
	b, _ := s.Seal("t", binding, []byte("same"))
	if a == b {
		t.Fatal("two seals of one payload are identical: the nonce is not fresh")
	}
}

// TestAnotherSealerOpens: a process restarted with the same tenant_secret,
// or another replica, opens what this one sealed.
func TestAnotherSealerOpens(t *testing.T) {
	token, err := newSealer(t, secret).Seal("tenant-a", binding, []byte("summary"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := newSealer(t, bytes.Clone(secret)).Open("tenant-a", binding, token)
	if err != nil || string(got) != "summary" {
		t.Fatalf("a new Sealer with the same secret: Open = %.40q, %v", got, err)
	}
}

func TestOpenRefuses(t *testing.T) {
	s := newSealer(t, secret)
	token, err := s.Seal("tenant-a", binding, []byte("the summary of a long conversation"))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		sealer  *Sealer
		tenant  string
		binding Binding
		token   string
		want    error
	}{
		{"another tenant", s, "tenant-b", binding, token, ErrRefused},
		{"tenant prefix of another", s, "tenant-", binding, token, ErrRefused},
		{"another purpose", s, "tenant-a", Binding{Purpose: "messages/compaction", Model: binding.Model}, token, ErrRefused},
		{"another model", s, "tenant-a", Binding{Purpose: binding.Purpose, Model: "other"}, token, ErrRefused},
		{"binding fields shifted", s, "tenant-a", Binding{Purpose: binding.Purpose + "l", Model: strings.TrimPrefix(binding.Model, "l")}, token, ErrRefused},
		{"wrong secret", newSealer(t, []byte("another secret")), "tenant-a", binding, token, ErrRefused},
		{"empty", s, "tenant-a", binding, "", ErrMalformed},
		{"no prefix", s, "tenant-a", binding, strings.TrimPrefix(token, Prefix), ErrMalformed},
		{"prefix only", s, "tenant-a", binding, Prefix, ErrMalformed},
		{"not base64url", s, "tenant-a", binding, token[:len(token)-1] + "+", ErrMalformed},
		{"newline inside", s, "tenant-a", binding, token[:len(Prefix)+4] + "\n" + token[len(Prefix)+4:], ErrMalformed},
		{"padding", s, "tenant-a", binding, token + "=", ErrMalformed},
		{"truncated below header", s, "tenant-a", binding, token[:len(Prefix)+20], ErrMalformed},
		{"truncated tag", s, "tenant-a", binding, reencode(t, token, func(b []byte) []byte { return b[:len(b)-3] }), ErrRefused},
		{"byte appended", s, "tenant-a", binding, reencode(t, token, func(b []byte) []byte { return append(b, 0) }), ErrRefused},
		{"oversized", s, "tenant-a", binding, Prefix + strings.Repeat("A", maxTokenLen), ErrTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.sealer.Open(tt.tenant, tt.binding, tt.token)
			if !errors.Is(err, tt.want) {
				t.Fatalf("Open = %.40q (%d bytes), %v; want error %v", got, len(got), err, tt.want)
			}
			if got != nil {
				t.Fatalf("Open returned %d bytes with its error", len(got))
			}
		})
	}
}

// reencode decodes token's body, changes it with f and encodes it again.
func reencode(t *testing.T, token string, f func([]byte) []byte) string {
	t.Helper()
	body, err := base64.RawURLEncoding.DecodeString(strings.TrimPrefix(token, Prefix))
	if err != nil {
		t.Fatal(err)
	}
	return Prefix + base64.RawURLEncoding.EncodeToString(f(body))
}

// TestOpenRefusesTampering flips one bit in every byte of the sealed body
// (version, salt, nonce, ciphertext, tag): each is refused.
func TestOpenRefusesTampering(t *testing.T) {
	s := newSealer(t, secret)
	token, err := s.Seal("tenant-a", binding, []byte("summary: the user wants a web server"))
	if err != nil {
		t.Fatal(err)
	}
	body, err := base64.RawURLEncoding.DecodeString(strings.TrimPrefix(token, Prefix))
	if err != nil {
		t.Fatal(err)
	}
	for i := range body {
		tampered := bytes.Clone(body)
		tampered[i] ^= 0x01
		tok := Prefix + base64.RawURLEncoding.EncodeToString(tampered)
		got, err := s.Open("tenant-a", binding, tok)
		want := ErrRefused
		if i == 0 {
			want = ErrVersion
		}
		if !errors.Is(err, want) {
			t.Fatalf("byte %d (%s) flipped: Open = %.40q, %v; want %v", i, region(i), got, err, want)
		}
	}
}

func region(i int) string {
	switch {
	case i == 0:
		return "version"
	case i < 1+saltLen:
		return "salt"
	case i < headerLen:
		return "nonce"
	}
	return "ciphertext or tag"
}

func TestSealRefusesOversized(t *testing.T) {
	s := newSealer(t, secret)
	if _, err := s.Seal("t", binding, make([]byte, MaxPayload+1)); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("Seal(MaxPayload+1) error = %v, want ErrTooLarge", err)
	}
}

func TestNewRefusesEmptySecret(t *testing.T) {
	if _, err := New(nil); !errors.Is(err, ErrNoSecret) {
		t.Fatalf("New(nil) error = %v, want ErrNoSecret", err)
	}
}

// TestSealerKeepsNoAliasOfSecret: the caller may reuse its slice.
func TestSealerKeepsNoAliasOfSecret(t *testing.T) {
	sec := bytes.Clone(secret)
	s := newSealer(t, sec)
	token, _ := s.Seal("t", binding, []byte("p"))
	sec[0] ^= 0xff
	if _, err := s.Open("t", binding, token); err != nil {
		t.Fatalf("Open after the caller changed its secret slice: %v", err)
	}
}

// FuzzOpen: Open never panics, and accepts nothing but what Seal made — a
// mutated token is a forgery and must be refused.
func FuzzOpen(f *testing.F) {
	s, _ := New(secret)
	valid := map[string]bool{}
	for i, p := range []string{"", "a", "summary of the conversation so far"} {
		// Reproducible seeds: every fuzz worker builds the same map.
		random := bytes.NewReader(bytes.Repeat([]byte{byte(i + 1)}, headerLen))
		tok, err := s.seal("tenant-a", binding, []byte(p), random)
		if err != nil {
			f.Fatal(err)
		}
		valid[tok] = true
		f.Add(tok)
	}
	f.Add(Prefix)
	f.Add("")
	f.Add(Prefix + "AAAA")
	f.Fuzz(func(t *testing.T, token string) {
		got, err := s.Open("tenant-a", binding, token)
		if err == nil && !valid[token] {
			t.Fatalf("Open accepted a token Seal never made: %.80q -> %.40q", token, got)
		}
		if err != nil && got != nil {
			t.Fatal("Open returned bytes with its error")
		}
		if len(got) > MaxPayload {
			t.Fatalf("Open returned %d bytes, over MaxPayload", len(got))
		}
	})
}

// BenchmarkOpen: the cost a request carrying a sealed item pays (a 4 KB
// summary, about 1k tokens).
func BenchmarkOpen(b *testing.B) {
	s, _ := New(secret)
	token, _ := s.Seal("tenant-a", binding, bytes.Repeat([]byte("summary "), 512))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := s.Open("tenant-a", binding, token); err != nil {
			b.Fatal(err)
		}
	}
}
