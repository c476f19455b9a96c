package anchor

import (
	"crypto/sha256"
	"fmt"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// benchRequest builds a ~1 MiB, 1,000-message agent request: tool results
// of code with escapes (\n, \t, \"), assistant tool calls, prose; keys in
// the order clients usually write them (role first: not sorted).
func benchRequest(b *testing.B) (body []byte, msgs []chat.Message) {
	b.Helper()
	line := `\tif err := s.store.Put(ctx, \"key\", value); err != nil {\n\t\treturn fmt.Errorf(\"put: %w\", err)\n\t}\n`
	var raws []string
	for i := 0; len(raws) < 1000; i++ {
		id := fmt.Sprintf("call_%04d", i)
		raws = append(raws,
			`{"role":"assistant","content":"Reading the next file to check the retry loop.","tool_calls":[{"id":"`+id+`","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"internal/pkg/file`+fmt.Sprint(i)+`.go\"}"}}]}`,
			`{"role":"tool","tool_call_id":"`+id+`","content":"`+strings.Repeat(line, 18)+`"}`,
		)
	}
	body = []byte(`{"model":"m","messages":[` + strings.Join(raws, ",") + `]}`)
	msgs = make([]chat.Message, len(raws))
	for i, r := range raws {
		msgs[i] = testMessage(b, r)
	}
	return body, msgs
}

// BenchmarkSHA256Body1MiB is the baseline: one SHA-256 over the whole body.
func BenchmarkSHA256Body1MiB(b *testing.B) {
	body, _ := benchRequest(b)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		sha256.Sum256(body)
	}
}

// BenchmarkViewChain1MiB: canonicalize and hash every message of the 1 MiB
// request (none hashed before), chain them, and estimate the view against
// 4 anchors.
func BenchmarkViewChain1MiB(b *testing.B) {
	body, msgs := benchRequest(b)
	seed := Seed("up/m", nil)
	chain, _, _ := ViewChain(seed, msgs, nil)
	anchors := []Anchor{{PrefixLen: 998, Prefix: chain[998], Input: 300000}, {PrefixLen: 996, Prefix: chain[996], Input: 299000}, {PrefixLen: 500, Prefix: chain[500]}, {PrefixLen: 3, Prefix: chain[2]}}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		for i := range msgs {
			msgs[i].HasDigest = false
		}
		chain, local, err := ViewChain(seed, msgs, nil)
		if err != nil {
			b.Fatal(err)
		}
		if e := EstimateView(chain, local, anchors, Fit{Ratio: 1.3}); e.PrefixLen != 998 {
			b.Fatal(e)
		}
	}
}

// BenchmarkEstimateView: the estimate alone, chain already computed.
func BenchmarkEstimateView(b *testing.B) {
	_, msgs := benchRequest(b)
	chain, local, _ := ViewChain(Seed("up/m", nil), msgs, nil)
	anchors := []Anchor{{PrefixLen: 998, Prefix: chain[998], Input: 300000}, {PrefixLen: 996, Prefix: chain[996]}, {PrefixLen: 500, Prefix: chain[500]}, {PrefixLen: 3, Prefix: chain[2]}}
	for b.Loop() {
		EstimateView(chain, local, anchors, Fit{Ratio: 1.3})
	}
}

// BenchmarkLocalEstimator: the default estimator over the 1,000 messages of
// the 1 MiB request (MB/s counts the request bytes it covers).
func BenchmarkLocalEstimator(b *testing.B) {
	body, msgs := benchRequest(b)
	est := NewLocalEstimator()
	b.SetBytes(int64(len(body)))
	n := 0
	for b.Loop() {
		for i := range msgs {
			n += est.Tokens(&msgs[i])
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(msgs)), "ns/msg")
	_ = n
}

// BenchmarkAppendCanonicalSorted: a message already canonical (fast path)
// against plain copy of the same bytes.
func BenchmarkAppendCanonicalSorted(b *testing.B) {
	raw := []byte(`{"content":"` + strings.Repeat("plain ascii text without escapes. ", 300) + `","role":"user"}`)
	dst := make([]byte, 0, 2*len(raw))
	b.SetBytes(int64(len(raw)))
	for b.Loop() {
		dst, _ = AppendCanonical(dst[:0], raw)
	}
}

func BenchmarkCopySameBytes(b *testing.B) {
	raw := []byte(`{"content":"` + strings.Repeat("plain ascii text without escapes. ", 300) + `","role":"user"}`)
	dst := make([]byte, 0, 2*len(raw))
	b.SetBytes(int64(len(raw)))
	for b.Loop() {
		dst = append(dst[:0], raw...)
	}
}

func BenchmarkMessageHash(b *testing.B) {
	_, msgs := benchRequest(b)
	raw := msgs[1].Raw
	b.SetBytes(int64(len(raw)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := MessageHash(raw); err != nil {
			b.Fatal(err)
		}
	}
}
