// Package chat parses an OpenAI chat-completions request body while keeping
// the client's raw JSON: top-level fields and messages are byte spans of the
// original body, and only the few fields a decision needs are decoded into a
// small view. It is pure logic (standard library only).
package chat

// ToolCall is one entry of an assistant message's tool_calls array.
type ToolCall struct {
	ID    string // "" when absent
	HasID bool   // the "id" key was present and a string
	Name  string // function.name, "" when absent
}

// Message is the decoded view of one message plus its bytes.
type Message struct {
	// Raw is the message object exactly as it will be forwarded: the client's
	// bytes, except that a "ui_only" key has been removed (then re-encoded
	// minimally). Compaction-made messages carry their own bytes.
	Raw []byte
	// Index is the message's position in the client's messages array, UI-only
	// messages counted; -1 for messages compactproxy synthesized.
	Index int

	Role string // "" when missing or not a string (the parser rejects that)
	// ToolCalls are the assistant's tool calls, in order; nil/empty = no calls.
	ToolCalls []ToolCall
	// ToolCallID is the tool message's tool_call_id; HasToolCallID tells
	// whether the key was present as a string.
	ToolCallID    string
	HasToolCallID bool
	// Name is the message's "name" field (legacy function results use it).
	Name string
	// FunctionCall is true when an assistant message carries a legacy
	// "function_call" object.
	FunctionCall bool

	// Content is the raw JSON value of "content" (string, array of parts, or
	// null); nil when absent.
	Content []byte
	// ContentIsString is true when Content is a JSON string.
	ContentIsString bool
	// TextBytes is the number of bytes of text in the content (string
	// content, or the sum of "text" parts), escapes decoded approximately.
	TextBytes int
	// MediaParts counts image/audio/file parts; MediaBytes is their total
	// raw size, so estimators can exclude base64 payloads.
	MediaParts int
	MediaBytes int
	// HasReasoning is true when the message carries "reasoning_content".
	HasReasoning bool
	// Native tells whether the message stands for a provider's own
	// compaction state (Responses and Messages only); NativeNone for
	// every other message.
	Native NativeKind

	// Digest is the message's canonical hash (anchor.MessageHash), filled by
	// the proxy; zero until then.
	Digest [32]byte
	// HasDigest tells whether Digest is set.
	HasDigest bool
}

// NativeKind sorts the items of the providers' own compaction APIs (DESIGN §
// Other APIs, "The providers' own compaction APIs"). Each such item is a
// chat message of its own, its bytes kept as the client sent them
// (Request.NativeItem).
type NativeKind uint8

// The native kinds.
const (
	NativeNone NativeKind = iota
	// NativeCompaction is a Responses "compaction" input item or a
	// Messages "compaction" content block: the provider's summary of
	// everything before it, which the provider reads from that item on.
	// It is a cut: nothing before it is to be summarized again.
	NativeCompaction
	// NativeTrigger is a Responses "compaction_trigger" input item: the
	// client asks for a compaction now (the API wants it last).
	NativeTrigger
)

// Field is one top-level key of the request body.
type Field struct {
	Key   string // unquoted key
	Value []byte // raw JSON value span
}

// Request is a parsed chat-completions body.
type Request struct {
	Body   []byte  // the original body
	Fields []Field // top-level fields in the client's order ("messages" included)
	// Messages are the provider-visible messages, in order, UI-only removed.
	Messages []Message
	// UIOnlyRemoved counts messages dropped because of "ui_only": true.
	UIOnlyRemoved int
	// Total is the length of the client's messages array (UI-only counted).
	Total int

	Model     string // "model" field, "" if absent
	Stream    bool   // "stream": true
	MaxTokens int    // max_completion_tokens, else max_tokens; 0 if absent
	// IncludeUsage is true when stream_options.include_usage is true.
	IncludeUsage bool

	// Set by Parse for Unchanged: the span of the (last) "messages" array
	// in Body, and whether any message lost a "ui_only" key.
	msgStart, msgEnd int
	stripped         bool

	// Set by Parse for Snapshot: where each of Messages and each of Fields
	// lies in Body, how many "messages" keys the body has, and what the
	// parse knew when it reached the (last) "messages" value.
	pos          []msgPos
	fieldAt      []int
	messagesKeys int
	head         headState
	// Set by ParseAfter: the first shared messages are from's own (their
	// bytes are the snapshot's copy of the body's).
	shared int
	from   *Snapshot
	// src maps a Responses or Messages body's messages back to its items
	// (ParseDialect); nil for chat completions.
	src *source
}

// msgPos is where one parsed message lies in the body: the start of its
// object (raw) and of its "content" value (content, -1 when absent), and
// the end of its element (end). raw is -1 for a message whose bytes are its
// own (one that lost a "ui_only" key).
type msgPos struct{ raw, content, end int }

// headState is what the parser has read when it reaches the "messages"
// value: the top-level fields before it.
type headState struct {
	fields                   int // len(Fields)
	model                    string
	stream, includeUsage     bool
	maxTokens, maxCompletion int
	value                    int // index of the "messages" value ('[')
}

// ParseError is a client error in the body: the proxy answers 400 with
// Message and Param ("messages[3]", "messages", or "" for the body).
type ParseError struct {
	Message string
	Param   string
}

func (e *ParseError) Error() string { return "chat: " + e.Message }
