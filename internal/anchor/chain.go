package anchor

import (
	"crypto/sha256"
	"encoding/binary"
	"hash"
)

// Digest is a 256-bit digest (SHA-256).
type Digest [32]byte

// PromptFields are the top-level request fields that change the prompt the
// provider renders besides the messages; their canonical values go into the
// seed d0 of every digest chain, so an anchor never applies to a request
// whose tools, output format or reasoning setting differ. Chat completions'
// come first; then the Responses API's text (text.format), reasoning and
// include, and Anthropic's thinking (tools and tool_choice are shared).
// Responses instructions and Anthropic system are not here: they are the
// leading system message, chained like any message (and the compaction
// records, keyed after the system messages, must survive a system prompt
// that changes).
var PromptFields = []string{"tools", "functions", "tool_choice", "response_format", "chat_template_kwargs",
	"text", "reasoning", "include", "thinking"}

// HistoryFields is how many of the first PromptFields shape how the
// history itself is rendered (tools, template, output format): the
// compaction records' seed holds these only, so a summary survives a
// request that changes its reasoning setting. They are also all the seed
// hashed before the newer APIs' fields were added: a later field that is
// absent adds nothing, so a request without them keeps its d0 (and
// persisted anchors and summaries keep matching).
const HistoryFields = 5

// seedDomain separates seed hashes from every other SHA-256 input here and
// versions the scheme: changing the canonical form must change it, so old
// persisted anchors stop matching instead of matching wrongly.
const seedDomain = "compactproxy/anchor/seed/v1"

// Seed is d0 of a conversation's digest chain: the hash of the model
// identity (upstream name + requested model) and the canonical values of
// the PromptFields. fields maps a top-level key to its raw JSON value; keys
// outside PromptFields are ignored, and a nil or empty value counts as
// absent. Absent and present differ (`"tools": null` is present), and every
// part is length-prefixed so no two different inputs concatenate to the
// same bytes. A value that is not valid JSON (the parser should have
// rejected the body) is hashed raw, under its own marker.
func Seed(modelIdentity string, fields map[string][]byte) Digest {
	h := sha256.New()
	h.Write([]byte(seedDomain))
	writeLenPrefixed(h, []byte(modelIdentity))
	c := canonPool.Get().(*canonicalizer)
	buf := c.buf[:0]
	for j, name := range PromptFields {
		v := fields[name]
		if len(v) == 0 && j >= HistoryFields {
			continue
		}
		writeLenPrefixed(h, []byte(name))
		if len(v) == 0 {
			h.Write([]byte{0})
			continue
		}
		var err error
		buf, err = c.run(buf[:0], v, false)
		if err != nil {
			h.Write([]byte{2})
			writeLenPrefixed(h, v)
			continue
		}
		h.Write([]byte{1})
		writeLenPrefixed(h, buf)
	}
	if cap(buf) <= maxPooledBuf {
		c.buf = buf[:0]
	}
	c.release()
	var d Digest
	h.Sum(d[:0])
	return d
}

func writeLenPrefixed(h hash.Hash, b []byte) {
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(b)))
	h.Write(n[:])
	h.Write(b)
}

// Link is one step of a digest chain: the digest of the view that extends
// the view whose digest is prev by the message whose hash is msg,
// SHA-256(prev || msg).
func Link(prev, msg Digest) Digest {
	var buf [64]byte
	copy(buf[:32], prev[:])
	copy(buf[32:], msg[:])
	return sha256.Sum256(buf[:])
}
