package proxy

import (
	"bytes"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/summarizer"
)

func (s *Server) compactionConfig() compaction.Config {
	c := s.cfg.Compaction
	return compaction.Config{
		TriggerRatio:         c.TriggerRatio,
		TargetRatio:          c.TargetRatio,
		ReserveTokens:        c.ReserveTokens,
		KeepTail:             c.KeepTail,
		LatchGrowth:          c.LatchGrowth,
		TrimToolResultTokens: c.Trim.ToolResultTokens,
		MinInterval:          c.MinInterval,
		SummarizerEnabled:    c.Summarizer.Enabled,
		Shadow:               c.Mode == "shadow",
		SummaryTokens:        c.Summarizer.MaxTokens,
		SummaryMinTokens:     c.SummaryMinTokens,
		TailRatio:            c.TailRatio,
	}
}

// textTokens is the calibrated estimate of n bytes of text sent as one
// message: the local estimator's count of such a message, scaled by the
// model's ratio (the request's fixed overhead is the summarizer's own
// allowance).
func textTokens(fit anchor.Fit, n int) int {
	local := anchor.MessageOverheadTokens + (n+3)/4
	r := fit.Ratio
	if !(r > 0) {
		r = 1
	}
	r = min(max(r, anchor.MinRatio), anchor.MaxRatio)
	return int(math.Ceil(float64(local) * r))
}

// summaryInUpstreamTokens tells whether summaries for model are made by
// the upstream's own model (the summarizer is the chat upstream, with no
// other model configured): a summarize call's limit then bounds the
// summary in the tokens the window counts.
func (s *Server) summaryInUpstreamTokens(model string) bool {
	sumModel := s.cfg.Compaction.Summarizer.Model
	return s.summarizerIsUpstream && (sumModel == "" || sumModel == model)
}

// detachMessages deep-copies the bytes of msgs (Raw and Content alias the
// request body, whose buffer is pooled), except those of the leading
// messages that req (nil: none) shares with a parse cache snapshot: their
// bytes are the snapshot's, never reused, so an agent's step in the
// presummarize band copies its new messages only, not its whole history.
func detachMessages(msgs []chat.Message, req *chat.Request) []chat.Message {
	out := make([]chat.Message, len(msgs))
	shared := 0
	if req != nil {
		shared = min(req.Shared(), len(req.Messages), len(msgs))
	}
	for i, m := range msgs {
		if i < shared && sameView(msgs[i:i+1], req.Messages[i:i+1]) {
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

// newSummarizer builds the HTTP summarizer with the same retry policy as
// chat, counted under op="summarize"; nil when the summarizer is off.
// Calls are bounded process-wide by compaction.summarizer.max_concurrent
// (the driver).
func (s *Server) newSummarizer() *summarizer.Client {
	c := s.cfg.Compaction.Summarizer
	if !c.Enabled {
		return nil
	}
	url := c.URL
	if url == "" {
		url = s.cfg.Upstream.URL
	}
	s.summarizerIsUpstream = strings.TrimRight(url, "/") == strings.TrimRight(s.cfg.Upstream.URL, "/")
	key := c.APIKey.Reveal()
	if key == "" && s.summarizerIsUpstream {
		key = s.cfg.Upstream.APIKey.Reveal()
	}
	// DESIGN: max_completion_tokens for dialect openai, max_tokens
	// otherwise; the summarizer has no dialect key of its own.
	// An overflow answer is read in the upstream's dialect when the
	// summarizer is the upstream, else in any dialect compactproxy knows.
	dialect := "auto"
	if s.summarizerIsUpstream {
		dialect = s.cfg.Upstream.Dialect
	}
	return summarizer.New(retryTransport{r: s.retrier, op: "summarize"}, summarizer.Options{
		URL:       url,
		APIKey:    key,
		Model:     c.Model,
		MaxTokens: c.MaxTokens,
		Dialect:   s.cfg.Upstream.Dialect,
		Timeout:   c.Timeout,
		Overflow: func(status int, body []byte) (int, int, bool) {
			info, ok := recognizeOverflow(dialect, status, body)
			return info.prompt, info.nCtx, ok
		},
	})
}

// summaryCall is what a summarize call takes from the chat request it
// serves (everything but the planner's request, which summarize adds): the
// requested model; the summarizer model's window and calibrated token
// counter when it is known like any window (the chat upstream's models, or
// a model the models table names); the client's credentials only when the
// summarizer is the chat upstream itself and the proxy holds no key of its
// own; the prefix-shaped request builder when the summarizer is the chat
// upstream and model; the usage counter. It is built only when a summarize
// is about to start, while the request's body is still valid, and owns
// every byte it keeps (the summarize may outlive the handler, whose body
// buffer is pooled).
func (s *Server) summaryCall(h http.Header, req *chat.Request) summarizer.Call {
	call := summarizer.Call{
		Model: req.Model,
		OnUsage: func(u anchor.Usage) {
			s.metrics.SummarizeInputTokens.WithLabelValues("uncached").Add(float64(u.Uncached))
			s.metrics.SummarizeInputTokens.WithLabelValues("cache_read").Add(float64(u.CacheRead))
			s.metrics.SummarizeInputTokens.WithLabelValues("cache_write").Add(float64(u.CacheWrite))
		},
	}
	sumModel := s.cfg.Compaction.Summarizer.Model
	if sumModel == "" {
		sumModel = req.Model
	}
	if s.summarizerIsUpstream {
		// The window the client would get for that model (its tenant's
		// learned window included).
		call.Window = s.windows.getFor(windowScope{tenant: tenantOf(s.tenantSecret, h), model: sumModel, shape: windowShape(h)})
		fit := s.calibration.Fit(s.modelIdentity(sumModel))
		call.Count = func(text string) int { return textTokens(fit, len(text)) }
	} else {
		call.Window = s.windows.listed(sumModel)
	}
	if s.summarizerIsUpstream && s.cfg.Compaction.Summarizer.APIKey == "" && s.cfg.Upstream.APIKey == "" {
		call.Credentials = http.Header{}
		for _, k := range []string{"Authorization", "X-Api-Key", "Api-Key"} {
			if v := h.Get(k); v != "" {
				call.Credentials.Set(k, v)
			}
		}
	}
	if d := req.Dialect(); d != chat.DialectChat && s.summarizerIsUpstream {
		// The upstream speaks the client's dialect (it may speak no other:
		// Anthropic): the summarize call does too.
		call.Dialect = d.String()
		for _, k := range []string{"Anthropic-Version", "Anthropic-Beta"} {
			if v := h.Values(k); len(v) > 0 {
				if call.Headers == nil {
					call.Headers = http.Header{}
				}
				call.Headers[k] = append([]string(nil), v...)
			}
		}
	}
	if s.summaryInUpstreamTokens(req.Model) {
		call.Build = s.requestBuilder(req)
	}
	return call
}

// dialectBuilder is requestBuilder for a Responses or Messages request: the
// client's request itself continued (its items' bytes are its own, so the
// builder may run after the request is over), not streamed, with the
// summary's own limit, no tool call, and without the options that would
// shape or cut the summary (Anthropic's extended thinking: its budget must
// stay under max_tokens).
func dialectBuilder(req *chat.Request) summarizer.Builder {
	// Codex's own compaction request sends "tools": [] — no tool_choice
	// for an empty tool list.
	hasTools := req.HasField("tools") && !bytes.Equal(bytes.TrimSpace(req.FieldValue("tools")), []byte("[]"))
	return func(msgs []chat.Message, maxTokens int) []byte {
		limit := []byte(strconv.Itoa(maxTokens))
		set := append([]chat.Field{{Key: "response_format"}}, serverOutputFields...)
		if req.Dialect() == chat.DialectResponses {
			set = append(set, chat.Field{Key: "stream", Value: []byte("false")}, chat.Field{Key: "max_output_tokens", Value: limit},
				chat.Field{Key: "stream_options"}, chat.Field{Key: "text"}, chat.Field{Key: "parallel_tool_calls"},
				chat.Field{Key: "max_tool_calls"}, chat.Field{Key: "background"}, chat.Field{Key: "previous_response_id"},
				chat.Field{Key: "tool_choice"})
			if hasTools {
				set[len(set)-1].Value = []byte(`"none"`)
			}
		} else {
			set = append(set, chat.Field{Key: "stream", Value: []byte("false")}, chat.Field{Key: "max_tokens", Value: limit},
				chat.Field{Key: "thinking"}, chat.Field{Key: "stop_sequences"}, chat.Field{Key: "tool_choice"})
			if hasTools {
				set[len(set)-1].Value = []byte(`{"type":"none"}`)
			}
		}
		return req.Build(msgs, set)
	}
}

// serverOutputFields are servers' own length and format options, removed
// from every summarize request: they win over its token limit
// (llama-server reads n_predict first: a client's n_predict 16 for its
// answers cut the summary to 16 tokens), and a grammar would force its
// format on the summary.
var serverOutputFields = []chat.Field{{Key: "n_predict"}, {Key: "ignore_eos"}, {Key: "min_tokens"},
	{Key: "grammar"}, {Key: "json_schema"}, {Key: "guided_json"}, {Key: "guided_regex"},
	{Key: "guided_choice"}, {Key: "guided_grammar"}}

// requestBuilder writes the summarize request as a continuation of the
// client's very request when the summarizer is the chat upstream and
// model: same model, tools and other top-level fields as the client sent
// them, so the forwarded prefix and the upstream's prompt cache are shared,
// with tool_choice "none", no streaming, no output options that would shape
// the summary (OpenAI's, and llama-server's and vLLM's own length and
// format fields), and the summary's own token limit. It keeps its own copy
// of the top-level fields (the messages array is replaced anyway).
func (s *Server) requestBuilder(req *chat.Request) summarizer.Builder {
	if req.Dialect() != chat.DialectChat {
		return dialectBuilder(req)
	}
	own := &chat.Request{Fields: make([]chat.Field, 0, len(req.Fields))}
	hasTools := false
	for _, f := range req.Fields {
		hasTools = hasTools || f.Key == "tools"
		c := chat.Field{Key: strings.Clone(f.Key)}
		if f.Key != "messages" {
			c.Value = bytes.Clone(f.Value)
		}
		own.Fields = append(own.Fields, c)
	}
	maxKey, otherKey := "max_tokens", "max_completion_tokens"
	if s.cfg.Upstream.Dialect == "openai" {
		maxKey, otherKey = otherKey, maxKey
	}
	return func(msgs []chat.Message, maxTokens int) []byte {
		set := []chat.Field{
			{Key: "stream", Value: []byte("false")},
			{Key: maxKey, Value: []byte(strconv.Itoa(maxTokens))},
			{Key: otherKey}, {Key: "stream_options"}, {Key: "n"}, {Key: "response_format"},
			{Key: "stop"}, {Key: "logprobs"}, {Key: "top_logprobs"}, {Key: "prediction"},
			{Key: "parallel_tool_calls"},
			{Key: "tool_choice"},
		}
		if hasTools {
			set[len(set)-1].Value = []byte(`"none"`)
		}
		return own.Build(msgs, append(set, serverOutputFields...))
	}
}
