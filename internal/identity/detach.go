package identity

import (
	"bytes"
	"slices"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// Detach deep-copies the bytes of msgs (Raw and Content alias the
// request body, whose buffer is pooled), except those of the leading
// messages that req (nil: none) shares with a parse cache snapshot: their
// bytes are the snapshot's, never reused, so an agent's step in the
// presummarize band copies its new messages only, not its whole history.
func Detach(msgs []chat.Message, req *chat.Request) []chat.Message {
	out := make([]chat.Message, len(msgs))
	shared := 0
	if req != nil {
		shared = min(req.Shared(), len(req.Messages), len(msgs))
	}
	for i, m := range msgs {
		if i < shared && SameView(msgs[i:i+1], req.Messages[i:i+1]) {
			out[i] = m
			continue
		}
		m.Raw = bytes.Clone(m.Raw)
		m.Content = bytes.Clone(m.Content)
		m.ToolCalls = slices.Clone(m.ToolCalls)
		out[i] = m
	}
	return out
}
