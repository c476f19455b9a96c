// Package summarizer is the HTTP summarizer: it asks an OpenAI-compatible
// chat-completions endpoint for a structured resume of a conversation head
// that an agent can continue from. It answers the summary a compaction decision asks for
// (compaction.SummaryRequest).
//
// The request and the answer's text are in the shape of the API the call
// speaks (internal/wire's SummaryRequest and SummaryText: chat
// completions unless the call names another); client requests are never
// re-encoded. Retries are the transport's business (the proxy passes one
// with its retry policy under op="summarize"); this package applies
// Options.Timeout per call.
package summarizer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/wire"
	openai "github.com/sashabaranov/go-openai"
)

// Errors. A failed call wraps one of them (or the transport's / context's
// error); callers classify with errors.Is / errors.As.
var (
	// ErrEmptySummary: the model answered without text.
	ErrEmptySummary = errors.New("summarizer: empty summary")
	// ErrNoModel: neither Options.Model nor the call names a model.
	ErrNoModel = errors.New("summarizer: no model")
	// ErrStatus: the endpoint answered a non-2xx status (see StatusError).
	ErrStatus = errors.New("summarizer: error status")
	// ErrBadResponse: the answer was not a chat completion.
	ErrBadResponse = errors.New("summarizer: bad response")
	// ErrWindowTooSmall: the summarizer model's window cannot hold the
	// instructions, the running summary and a useful piece of transcript.
	ErrWindowTooSmall = errors.New("summarizer: window too small")
)

// StatusError is a non-2xx answer. errors.Is(err, ErrStatus) holds.
type StatusError struct {
	StatusCode int
	// Message is the error envelope's message, else the start of the body.
	Message string
	// Overflow: the answer is a context overflow in the words of
	// Options.OverflowDialect (wire.RecognizeOverflow); Prompt is
	// the prompt size it reported and Window the model's window it named
	// (0 = not said).
	Overflow bool
	Prompt   int
	Window   int
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("summarizer: status %d: %s", e.StatusCode, e.Message)
}

// Is makes errors.Is(err, ErrStatus) true.
func (e *StatusError) Is(target error) bool { return target == ErrStatus }

// Options configures the client.
type Options struct {
	// URL is the base URL including its version path, e.g.
	// "http://127.0.0.1:8080/v1"; the call goes to URL + "/chat/completions".
	URL string
	// APIKey is sent as "Authorization: Bearer"; "" = the credentials the
	// call carries (Call.Credentials), else none.
	APIKey string
	// Model is the summarizing model; "" = the call's (Call.Model).
	Model string
	// MaxTokens bounds the summary when a call gives no limit of its own
	// (0 = not sent).
	MaxTokens int
	// Dialect "openai" sends max_completion_tokens, anything else
	// max_tokens (llama.cpp, vLLM, older servers).
	Dialect string
	// Timeout bounds each call (a chunked summary makes several); 0 = none
	// beyond the context's.
	Timeout time.Duration
	// Window is the summarizer model's context window in tokens when the
	// call names none (Call.Window); 0 = unknown: never chunk. Every
	// request's prompt plus the tokens it asks for fits windowShare of it;
	// a head that does not fit one request is summarized in chunks, each
	// folded into the running summary.
	Window int
	// OverflowDialect is the upstream.dialect whose context-overflow
	// answers the endpoint gives (wire.RecognizeOverflow: "auto" any of
	// them); "" recognizes none. A transcript request answered so is sent
	// again in smaller chunks, counted at the rate the answer measured,
	// within the window it names when none was known; a prefix-shaped one
	// gives way to a transcript.
	OverflowDialect string
}

// Client calls the summarizer endpoint. Safe for concurrent use.
type Client struct {
	rt  http.RoundTripper
	opt Options
}

// New returns a client. rt nil means http.DefaultTransport. Calls go
// through RoundTrip, never an http.Client: a redirect from the endpoint is
// an error status, not a POST silently turned into a GET elsewhere.
func New(rt http.RoundTripper, opt Options) *Client {
	if rt == nil {
		rt = http.DefaultTransport
	}
	opt.URL = strings.TrimRight(opt.URL, "/")
	return &Client{rt: rt, opt: opt}
}

// Call is one summarize call: the planner's request and everything the
// call takes from the chat request it serves. Nothing travels in the
// context but cancellation.
type Call struct {
	// Request is what to summarize (compaction.Output.Need).
	Request compaction.SummaryRequest
	// Model is the chat request's model, used when Options.Model is empty.
	Model string
	// Window is the summarizer model's context window (known like any
	// window: configured, discovered or learned); 0 = Options.Window.
	Window int
	// Count estimates the tokens the summarizer model spends on text sent
	// as one message (the proxy's calibrated estimate of that model); nil
	// counts one token per fallbackBytesPerToken bytes.
	Count Counter
	// Build, when set, writes a request that continues the client's own
	// (see Builder): the prefix-shaped request.
	Build Builder
	// Credentials are the client's credential headers (Authorization,
	// X-Api-Key, Api-Key; others are ignored), sent only when
	// Options.APIKey is empty: for a summarizer that is the chat upstream
	// itself with no key of its own.
	Credentials http.Header
	// OnUsage, when set, receives the usage every answer reports
	// (summarize_input_tokens_total).
	OnUsage func(anchor.Usage)
	// Dialect is the API the call speaks: "" for chat completions,
	// "responses" (POST …/responses) or "messages" (Anthropic, POST
	// …/messages). The proxy sets it when the summarizer is the upstream
	// and the client spoke that dialect: the summarize call is then in the
	// upstream's own dialect, and Build writes its body.
	Dialect string
	// Headers are the client's headers the dialect needs besides its
	// credentials (Anthropic-Version, Anthropic-Beta).
	Headers http.Header
}

// Builder writes a chat request body that continues the client's own
// request: its top-level fields (model, tools and the rest, as the client
// sent them) with msgs as the messages, tool_choice "none", no streaming
// and maxTokens as the output limit. The proxy provides it when the
// summarizer is the chat upstream and model, so a summarize request shares
// the forwarded request's prefix and the upstream's prompt cache (llama.cpp
// slot KV, a provider's prompt caching) covers the head.
type Builder func(msgs []chat.Message, maxTokens int) []byte

// Counter estimates the tokens the summarizer model spends on text sent as
// one message.
type Counter func(text string) int

// credentialHeaders are the headers that carry a client's credentials.
var credentialHeaders = []string{"Authorization", "X-Api-Key", "Api-Key"}

// Limits of what is sent.
const (
	// fallbackBytesPerToken counts tokens when the call carries no
	// Counter. It is deliberately low (small-vocabulary tokenizers spend
	// ~1.4 bytes per token on code): overcounting only makes chunks smaller.
	fallbackBytesPerToken = 1.5
	// windowShare is the part of the summarizer's window that a request's
	// prompt plus the answer it asks for may fill; the rest absorbs the
	// estimate's error.
	windowShare = 0.9
	// templateTokens: what a chat template adds around the two messages.
	templateTokens = 64
	// minChunkTokens: the smallest transcript chunk worth a call.
	minChunkTokens = 128
	// maxToolOutput is how much of one tool result the transcript keeps
	// (head and tail excerpt); a summary needs the gist, not the bytes.
	maxToolOutput = 6000
	// maxMessageText bounds any other message's text in the transcript.
	maxMessageText = 16000
	// maxResponse bounds the answer read from the endpoint.
	maxResponse = 8 << 20
)

// shortSystemPrompt replaces systemPrompt when the summarizer's window is
// small (the long one would take more than an eighth of it).
const shortSystemPrompt = `Summarize the transcript of an AI agent's work so it can continue from your summary alone: the goal in the user's words, decisions, files and key facts (exact paths and names), commands and outcomes, open errors, the next step. Fold in a previous summary when given. Use only stated facts. Answer with the summary only.`

// systemPrompt asks for a structured resume an agent can continue from.
const systemPrompt = `You compact the working memory of an AI agent. The earlier part of its conversation will be removed from its context and replaced by your summary; the agent must be able to continue its work from the summary alone, together with the most recent messages, which it keeps verbatim.

Write the summary in this structure (omit a section only when it would be empty):
## Goal
What the user asked for, in the user's own words where possible, and any later change of the request.
## Decisions and constraints
Choices made, approaches ruled out and why, constraints the user or the environment imposed.
## Files and key facts
Each file, module or resource that matters: its path, what it contains that the work depends on (function names, signatures, settings, line numbers), and what was changed in it.
## Commands run and outcomes
Commands and tool calls that matter, each with its outcome (passed, failed, what it printed that matters).
## Errors still open
Errors and failing tests not resolved yet, with the exact error text when short.
## Next step
What the agent was about to do next.

Rules:
- Use only facts stated in the previous summary or in the transcript. Do not invent file contents, results, decisions or plans; if something is unknown, say so.
- Keep identifiers, paths, commands, numbers and error messages exact.
- When a previous summary is given, fold the transcript into it: keep what is still true, update what changed, drop what no longer matters.
- Answer with the summary only, without preamble.`

// Summarize returns a summary of call.Request.Head that folds its Previous
// (the summary the head continues, "" when none), of at most its MaxTokens
// tokens (0 = Options.MaxTokens).
//
// With call.Build set (the summarizer is the chat upstream and
// model), the request continues the forwarded prefix — req.Prefix, then one
// user message with prefixInstruction — when that fits the window and the
// prefix does not end on a user message. Otherwise it is a transcript: when
// the summarizer model's window is known (Call.Window, else Options.Window),
// every request fits it (the prompt, counted with Call.Count,
// plus the tokens it asks for stay within windowShare of the window); a
// longer head is sent in chunks, each folded into the running summary.
func (c *Client) Summarize(ctx context.Context, call Call) (string, error) {
	req := call.Request
	model := c.opt.Model
	if model == "" {
		model = call.Model
	}
	if model == "" {
		return "", ErrNoModel
	}
	maxTokens := req.MaxTokens
	if maxTokens <= 0 {
		maxTokens = c.opt.MaxTokens
	}
	floor := 1.0
	if body, est := c.prefixBody(&call, maxTokens); body != nil {
		text, err := c.post(ctx, &call, body)
		var se *StatusError
		if !errors.As(err, &se) || !se.Overflow {
			return text, err
		}
		if c.window(&call) <= 0 {
			call.Window = se.Window
		}
		// The prefix measured over the window after all: a transcript
		// (chunked to fit) is the shape left, counted at least as much
		// short as the prefix's estimate was.
		if se.Prompt > est && est > 0 {
			floor = float64(se.Prompt) / float64(est) * overflowMargin
		}
	}
	blocks := renderHead(req.Head)
	summary := strings.TrimSpace(req.Previous)
	scale := min(max(countScale(&call, blocks), floor), maxScale)
	count := scaled(call.counter(), scale)
	prompt := c.systemPrompt(&call, count)
	chunks, err := c.chunks(&call, count, blocks, 0, summary, maxTokens, prompt)
	if err != nil {
		return "", err
	}
	for i, retries := 0, 0; i < len(chunks); i++ {
		ch := chunks[i]
		s, err := c.call(ctx, &call, model, summary, ch.text, maxTokens, prompt)
		var se *StatusError
		if errors.As(err, &se) && se.Overflow && c.window(&call) <= 0 {
			call.Window = se.Window // chunk within the window the answer names
		}
		if errors.As(err, &se) && se.Overflow && retries < maxOverflowRetries && c.window(&call) > 0 {
			// Counted short: count at the rate the answer measured (or
			// half again when it said no size) and send the rest again in
			// chunks that fit.
			retries++
			grow := overflowGrowth
			if est := requestTokens(count, prompt, summary, ch.text); se.Prompt > est && est > 0 {
				grow = float64(se.Prompt) / float64(est) * overflowMargin
			}
			scale = min(scale*grow, maxScale)
			count = scaled(call.counter(), scale)
			if i == 0 {
				prompt = c.systemPrompt(&call, count) // the window may be known only now
			}
			rest, cerr := c.chunks(&call, count, blocks[ch.from:], ch.from, summary, maxTokens, prompt)
			if cerr != nil {
				return "", cerr
			}
			chunks = append(chunks[:i:i], rest...)
			i--
			continue
		}
		if err != nil {
			return "", err
		}
		summary = s
	}
	return summary, nil
}

// systemPrompt is the transcript's system prompt: the short one when the
// long one would take more than an eighth of the summarizer's window (leave
// the room to the transcript).
func (c *Client) systemPrompt(call *Call, count Counter) string {
	if win := c.window(call); win > 0 && count(systemPrompt) > win/8 {
		return shortSystemPrompt
	}
	return systemPrompt
}

// Counting a transcript.
const (
	// maxOverflowRetries bounds how often one summary is sent again after
	// an overflow answer.
	maxOverflowRetries = 2
	// overflowGrowth scales the count after an overflow that reported no
	// size; overflowMargin is added to a measured rate.
	overflowGrowth = 1.5
	overflowMargin = 1.1
	// maxScale bounds the factor (the calibration's own bound).
	maxScale = 4
)

// scaled counts with count, times scale.
func scaled(count Counter, scale float64) Counter {
	if scale <= 1 {
		return count
	}
	return func(text string) int { return int(math.Ceil(float64(count(text)) * scale)) }
}

// countScale is the factor by which the call's Counter is taken to
// undercount the transcript of its head: what the head costs in the
// upstream's tokens (Request.HeadTokens, the planner's estimate) against
// the Counter's count of it. The Counter is calibrated on whole messages,
// whose JSON a template never renders: on a transcript, text alone, it can
// count half of what the model spends (stories260K, 1.3 bytes a token: a
// 3,199-byte request counted as fitting measured 2,122 tokens against a
// 2,048 window). Never under 1: a Counter that overcounts only makes the
// chunks smaller.
func countScale(call *Call, blocks []string) float64 {
	scale := 1.0
	if call.Count == nil || call.Request.HeadTokens <= 0 {
		return scale
	}
	local := 0
	for _, b := range blocks {
		local += call.Count(b)
	}
	if local > 0 {
		scale = max(scale, float64(call.Request.HeadTokens)/float64(local))
	}
	return min(scale, maxScale)
}

// prefixInstruction ends a prefix-shaped summarize request.
const prefixInstruction = `Stop here; call no tool. Summarize the conversation so far (fold in any earlier summary) so the work can go on from the summary and the latest messages alone: ` + summaryOutline

// summaryOutline is how the prefix-shaped instructions ask for the summary.
const summaryOutline = `## Goal (the user's words) ## Decisions ## Files and key facts (exact paths, names) ## Commands and outcomes ## Open errors ## Next step. Only stated facts; exact identifiers. Answer with the summary only.`

// keptInstruction ends a prefix-shaped summarize request that also carries
// the kept messages (a background summary): %d is how many of the latest
// messages stay verbatim and are not to be summarized.
const keptInstruction = `Stop here; call no tool. The last %d messages above stay in the context verbatim after your summary: do not summarize them. Summarize the conversation before them (fold in any earlier summary) so the work can go on from the summary and those messages alone: ` + summaryOutline

// prefixBody returns the prefix-shaped request body, nil when that shape
// does not apply (no Builder, no prefix, a prefix ending on a user message
// — two user messages would meet — or a request that would not fit the
// window). With req.Kept (a background summary) it extends the whole view
// as forwarded, so the upstream's cache of it survives the call, when that
// fits and does not end on a user message; else the prefix alone. tokens
// is the estimate of the body's prompt.
func (c *Client) prefixBody(call *Call, maxTokens int) (body []byte, tokens int) {
	req, build := &call.Request, call.Build
	if build == nil || len(req.Prefix) == 0 {
		return nil, 0
	}
	fits := func(tokens int, instruction string) bool {
		win := c.window(call)
		return win <= 0 || tokens+call.counter()(instruction)+maxTokens <= int(float64(win)*windowShare)
	}
	if k := len(req.Kept); k > 0 && req.Kept[k-1].Role != "user" {
		instruction := fmt.Sprintf(keptInstruction, k)
		if fits(req.PrefixTokens+req.KeptTokens, instruction) {
			msgs := make([]chat.Message, 0, len(req.Prefix)+k+1)
			msgs = append(msgs, req.Prefix...)
			msgs = append(msgs, req.Kept...)
			msgs = append(msgs, chat.NewTextMessage("user", instruction))
			return build(msgs, maxTokens), req.PrefixTokens + req.KeptTokens + call.counter()(instruction)
		}
	}
	if req.Prefix[len(req.Prefix)-1].Role == "user" || !fits(req.PrefixTokens, prefixInstruction) {
		return nil, 0
	}
	msgs := make([]chat.Message, 0, len(req.Prefix)+1)
	msgs = append(msgs, req.Prefix...)
	msgs = append(msgs, chat.NewTextMessage("user", prefixInstruction))
	return build(msgs, maxTokens), req.PrefixTokens + call.counter()(prefixInstruction)
}

// counter returns the call's Counter, else the byte fallback.
func (call *Call) counter() Counter {
	if call.Count != nil {
		return call.Count
	}
	return func(text string) int { return int(float64(len(text))/fallbackBytesPerToken) + 4 }
}

// window returns the summarizer model's window (0 = unknown).
func (c *Client) window(call *Call) int {
	if call.Window > 0 {
		return call.Window
	}
	return c.opt.Window
}

// chunk is one transcript: the rendered blocks from, up to the next
// chunk's.
type chunk struct {
	text string
	from int
}

// chunks packs the rendered messages (blocks, the first of which is block
// from of the head) into transcripts whose requests, counted with count,
// fit the summarizer's window (one transcript when the window is unknown or
// everything fits). Room is reserved for the answer, and for the running
// summary: the first chunk folds previous, a later one a summary of up to
// maxTokens. A block larger than a later chunk is cut to fit.
func (c *Client) chunks(call *Call, count Counter, blocks []string, from int, previous string, maxTokens int, prompt string) ([]chunk, error) {
	win := c.window(call)
	if win <= 0 {
		return []chunk{{strings.Join(blocks, ""), from}}, nil
	}
	sizes := make([]int, len(blocks))
	total := 0
	for i, b := range blocks {
		sizes[i] = count(b)
		total += sizes[i]
	}
	fixed := count(prompt) + count(foldInstruction) + templateTokens
	limit := int(float64(win)*windowShare) - maxTokens - fixed
	if total+count(previous) <= limit {
		return []chunk{{strings.Join(blocks, ""), from}}, nil
	}
	capacity := limit - max(count(previous), maxTokens)
	if capacity < minChunkTokens {
		return nil, fmt.Errorf("%w: %d tokens, %d for the answer", ErrWindowTooSmall, win, maxTokens)
	}
	first := limit - count(previous) // the first chunk folds previous, not an answer of maxTokens
	var out []chunk
	var cur strings.Builder
	curTokens, curFrom := 0, from
	for i, b := range blocks {
		t := sizes[i]
		if t > capacity {
			// Keep the share of its bytes that fits (the count is about
			// proportional to the bytes), with a margin for the marker.
			b = compaction.Excerpt(b, max(len(b)*(capacity-16)/t, 64))
			t = count(b)
		}
		room := capacity
		if len(out) == 0 {
			room = first
		}
		if curTokens > 0 && curTokens+t > room {
			out = append(out, chunk{cur.String(), curFrom})
			cur.Reset()
			curTokens, curFrom = 0, from+i
		}
		cur.WriteString(b)
		curTokens += t
	}
	if cur.Len() > 0 {
		out = append(out, chunk{cur.String(), curFrom})
	}
	return out, nil
}

// foldInstruction is the longest wrapper text a chunk's user message adds
// around the previous summary and the transcript.
const foldInstruction = "Previous summary:\n<previous_summary>\n\n</previous_summary>\n\nThe conversation continued as follows. Fold it into the previous summary.\n<transcript>\n</transcript>"

// userText is a transcript-shaped request's user message.
func userText(previous, transcript string) string {
	var user strings.Builder
	if previous != "" {
		user.WriteString("Previous summary:\n<previous_summary>\n")
		user.WriteString(previous)
		user.WriteString("\n</previous_summary>\n\nThe conversation continued as follows. Fold it into the previous summary.\n")
	} else {
		user.WriteString("Summarize this conversation.\n")
	}
	user.WriteString("<transcript>\n")
	user.WriteString(transcript)
	user.WriteString("</transcript>")
	return user.String()
}

// requestTokens is the count of a transcript-shaped request's prompt.
func requestTokens(count Counter, prompt, previous, transcript string) int {
	return count(prompt) + count(userText(previous, transcript)) + templateTokens
}

// call makes one transcript-shaped summarize request.
func (c *Client) call(ctx context.Context, call *Call, model, previous, transcript string, maxTokens int, prompt string) (string, error) {
	user := userText(previous, transcript)

	body, err := c.api(call).SummaryRequest(model, prompt, user, maxTokens, c.opt.Dialect)
	if err != nil {
		return "", fmt.Errorf("summarizer: encode: %w", err)
	}
	return c.post(ctx, call, body)
}

// api is the API the call speaks (Call.Dialect; chat completions when
// none).
func (c *Client) api(call *Call) *wire.API {
	if api, ok := wire.Named(call.Dialect); ok {
		return api
	}
	return wire.ChatCompletions
}

// post sends one summarize request body and returns the answer's text,
// reporting the answer's usage to the call's OnUsage.
func (c *Client) post(ctx context.Context, call *Call, body []byte) (string, error) {
	if c.opt.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.opt.Timeout)
		defer cancel()
	}
	api := c.api(call)
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, c.opt.URL+"/"+api.UpstreamPath, bytes.NewReader(body))
	if err != nil {
		return "", fmt.Errorf("summarizer: request: %w", err)
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("Accept", "application/json")
	if c.opt.APIKey != "" {
		if c.opt.Dialect == "anthropic" {
			hr.Header.Set("X-Api-Key", c.opt.APIKey)
		} else {
			hr.Header.Set("Authorization", "Bearer "+c.opt.APIKey)
		}
	} else {
		for _, k := range credentialHeaders {
			if v := call.Credentials.Values(k); len(v) > 0 {
				hr.Header[k] = append([]string(nil), v...)
			}
		}
	}
	for k, v := range call.Headers {
		hr.Header[k] = append([]string(nil), v...)
	}
	resp, err := c.rt.RoundTrip(hr)
	if err != nil {
		return "", fmt.Errorf("summarizer: call: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxResponse))
	if err != nil {
		return "", fmt.Errorf("summarizer: read: %w", err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		se := &StatusError{StatusCode: resp.StatusCode, Message: errorMessage(data)}
		if c.opt.OverflowDialect != "" {
			info, ok := wire.RecognizeOverflow(c.opt.OverflowDialect, resp.StatusCode, data)
			se.Prompt, se.Window, se.Overflow = info.Prompt, info.NCtx, ok
		}
		return "", se
	}
	if call.OnUsage != nil {
		if u, ok := anchor.UsageFromJSON(data); ok {
			call.OnUsage(u)
		}
	}
	text, why, err := api.SummaryText(data)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrBadResponse, err)
	}
	if text == "" {
		return "", fmt.Errorf("%w (%s)", ErrEmptySummary, why)
	}
	return text, nil
}

// errorMessage extracts the OpenAI error envelope's message, else the
// start of the body.
func errorMessage(data []byte) string {
	var env openai.ErrorResponse
	if json.Unmarshal(data, &env) == nil && env.Error != nil && env.Error.Message != "" {
		return env.Error.Message
	}
	s := strings.TrimSpace(string(data))
	if len(s) > 512 {
		s = s[:512] + "..."
	}
	return s
}

// rawMessage is what the transcript needs of a message beyond chat's view:
// the tool calls' arguments.
type rawMessage struct {
	ToolCalls []struct {
		ID       string `json:"id"`
		Function struct {
			Name      string          `json:"name"`
			Arguments json.RawMessage `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
	FunctionCall *struct {
		Name      string          `json:"name"`
		Arguments json.RawMessage `json:"arguments"`
	} `json:"function_call"`
}

// renderHead renders the head's messages as transcript blocks. A tool
// result is labelled with the name of the call it answers (its call id
// when the call is not in the head): a summary needs the tool, and a call
// id is noise that costs tokens (about one a character on a
// small-vocabulary model, twice per tool turn); results follow their calls
// in order.
func renderHead(head []chat.Message) []string {
	blocks := make([]string, 0, len(head))
	names := map[string]string{}
	for i := range head {
		blocks = append(blocks, renderMessage(&head[i], names))
	}
	return blocks
}

// renderMessage renders one message as a transcript block; names maps the
// call ids seen so far to their tool's name, and learns m's calls.
func renderMessage(m *chat.Message, names map[string]string) string {
	var b strings.Builder
	role := m.Role
	switch role {
	case "tool":
		if name := names[m.ToolCallID]; name != "" {
			fmt.Fprintf(&b, "[%s result]\n", name)
		} else {
			fmt.Fprintf(&b, "[tool result for %s]\n", m.ToolCallID)
		}
	case "function":
		fmt.Fprintf(&b, "[function result %s]\n", m.Name)
	default:
		fmt.Fprintf(&b, "[%s]\n", role)
	}
	text := chat.Text(*m)
	limit := maxMessageText
	if role == "tool" || role == "function" {
		limit = maxToolOutput
	}
	if text != "" {
		b.WriteString(compaction.Excerpt(text, limit))
		b.WriteByte('\n')
	}
	if m.MediaParts > 0 {
		fmt.Fprintf(&b, "(%d image/audio/file part(s) not shown)\n", m.MediaParts)
	}
	if len(m.ToolCalls) > 0 || m.FunctionCall {
		var rm rawMessage
		if json.Unmarshal(m.Raw, &rm) == nil {
			for _, tc := range rm.ToolCalls {
				if names != nil && tc.ID != "" {
					names[tc.ID] = tc.Function.Name
				}
				fmt.Fprintf(&b, "(calls %s with %s)\n", tc.Function.Name, compaction.Excerpt(arguments(tc.Function.Arguments), 2000))
			}
			if fc := rm.FunctionCall; fc != nil {
				fmt.Fprintf(&b, "(calls %s with %s)\n", fc.Name, compaction.Excerpt(arguments(fc.Arguments), 2000))
			}
		}
	}
	b.WriteByte('\n')
	return b.String()
}

// arguments returns tool-call arguments as text: the JSON string's value
// (OpenAI encodes arguments as a string), else the raw JSON.
func arguments(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	return string(raw)
}
