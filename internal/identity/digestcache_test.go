package identity

import (
	"fmt"
	"testing"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

func TestDigestCache(t *testing.T) {
	c := newDigestCache(8)
	msgs := func() []chat.Message {
		return []chat.Message{{Raw: []byte(`{"role":"user","content":"a"}`)}, {Raw: []byte(`{"content":"b", "role":"assistant"}`)}}
	}
	first := msgs()
	if err := c.hash("t1", first); err != nil {
		t.Fatal(err)
	}
	for i, m := range first {
		want, _ := anchor.MessageHash(m.Raw)
		if !m.HasDigest || m.Digest != want {
			t.Fatalf("message %d: digest not the canonical hash", i)
		}
	}
	again := msgs()
	c.hash("t1", again)
	if again[0].Digest != first[0].Digest || again[1].Digest != first[1].Digest {
		t.Fatal("cached digest differs")
	}
	if c.key("t1", first[0].Raw) == c.key("t2", first[0].Raw) {
		t.Fatal("tenants share cache keys")
	}
	bad := []chat.Message{{Raw: []byte(`{"role":`)}}
	if err := c.hash("t1", bad); err == nil || bad[0].HasDigest {
		t.Fatal("invalid JSON got a digest")
	}
	for i := 0; i < 100; i++ {
		c.hash("t1", []chat.Message{{Raw: []byte(fmt.Sprintf(`{"role":"user","content":"%d"}`, i))}})
	}
	if n := c.len(); n > 8 {
		t.Fatalf("cache holds %d entries, bound is 8", n)
	}
}
