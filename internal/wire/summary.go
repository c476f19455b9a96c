package wire

import (
	"bytes"
	"strings"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// SummaryBuilder writes the summarize request as a continuation of the
// client's very request, for when the summarizer is the chat upstream and
// model (dialect is upstream.dialect): the same model, tools and other
// top-level fields as the client sent them, so the forwarded prefix and the
// upstream's prompt cache are shared, with the fields the request's API
// sets or removes for a summary (API.SummaryFields: no tool call, no
// streaming, no option that would shape or cut it, the summary's own token
// limit). A chat request's top-level fields are copied (the messages array
// is replaced anyway; the body is pooled); a Responses or Messages
// request's items are its own, so the builder may run after the request is
// over.
func SummaryBuilder(req *chat.Request, dialect string) func(msgs []chat.Message, maxTokens int) []byte {
	api := For(req.Dialect())
	own := req
	if req.Dialect() == chat.DialectChat { // only a chat body is pooled (read)
		own = &chat.Request{Fields: make([]chat.Field, 0, len(req.Fields))}
		for _, f := range req.Fields {
			c := chat.Field{Key: strings.Clone(f.Key)}
			if f.Key != "messages" {
				c.Value = bytes.Clone(f.Value)
			}
			own.Fields = append(own.Fields, c)
		}
	}
	return func(msgs []chat.Message, maxTokens int) []byte {
		return own.Build(msgs, api.SummaryFields(own, maxTokens, dialect))
	}
}
