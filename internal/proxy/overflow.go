package proxy

import (
	"encoding/json"
	"regexp"
	"strconv"
	"strings"
)

// overflowInfo is what an upstream's context-overflow answer told us.
type overflowInfo struct {
	prompt int // tokens the provider counted for the request (0 = not said)
	nCtx   int // the model's window (0 = not said)
}

var (
	// OpenAI / vLLM: "This model's maximum context length is 8192 tokens.
	// However, your messages resulted in 9000 tokens" / "you requested 5000
	// tokens (4000 in the messages, 1000 in the completion)" / vLLM ≥ 0.6:
	// "... your request has 5000 input tokens".
	reMaxCtx      = regexp.MustCompile(`maximum context length is (\d+)`)
	reResulted    = regexp.MustCompile(`resulted in (\d+) tokens`)
	reInMessages  = regexp.MustCompile(`\((\d+) in the messages`)
	reInputTokens = regexp.MustCompile(`has (\d+) input tokens`)
	// Anthropic: "prompt is too long: 210000 tokens > 200000 maximum".
	reAnthropic = regexp.MustCompile(`prompt is too long: (\d+) tokens > (\d+) maximum`)
	// llama.cpp's message form: "request (9000 tokens) exceeds the available
	// context size (8192 tokens)".
	reLlama = regexp.MustCompile(`\((\d+) tokens\) exceeds the available context size \((\d+) tokens\)`)
)

func atoi(s string) int { n, _ := strconv.Atoi(s); return n }

// parseOverflow recognizes a context-overflow answer. Classification reads
// the structured fields first (llama.cpp's exceed_context_size_error with
// n_prompt_tokens/n_ctx, OpenAI's context_length_exceeded code) and falls
// back to the providers' documented wordings.
func parseOverflow(status int, body []byte) (overflowInfo, bool) {
	if status != 400 && status != 413 && status != 422 {
		return overflowInfo{}, false
	}
	var env struct {
		Error struct {
			Message       string          `json:"message"`
			Type          string          `json:"type"`
			Code          json.RawMessage `json:"code"`
			NPromptTokens int             `json:"n_prompt_tokens"`
			NCtx          int             `json:"n_ctx"`
		} `json:"error"`
		Message string `json:"message"` // vLLM's older flat shape
	}
	_ = json.Unmarshal(body, &env)
	e := env.Error
	msg := e.Message
	if msg == "" {
		msg = env.Message
	}
	code := strings.Trim(string(e.Code), `"`)
	var info overflowInfo
	matched := false
	if e.Type == "exceed_context_size_error" || code == "exceed_context_size_error" {
		info = overflowInfo{prompt: e.NPromptTokens, nCtx: e.NCtx}
		matched = true
	}
	if code == "context_length_exceeded" {
		matched = true
	}
	if m := reMaxCtx.FindStringSubmatch(msg); m != nil {
		matched = true
		info.nCtx = atoi(m[1])
		if m := reResulted.FindStringSubmatch(msg); m != nil {
			info.prompt = atoi(m[1])
		} else if m := reInMessages.FindStringSubmatch(msg); m != nil {
			info.prompt = atoi(m[1])
		} else if m := reInputTokens.FindStringSubmatch(msg); m != nil {
			info.prompt = atoi(m[1])
		}
	}
	if m := reAnthropic.FindStringSubmatch(msg); m != nil {
		matched = true
		info.prompt, info.nCtx = atoi(m[1]), atoi(m[2])
	}
	if m := reLlama.FindStringSubmatch(msg); m != nil {
		matched = true
		info.prompt, info.nCtx = atoi(m[1]), atoi(m[2])
	}
	if !matched && strings.Contains(msg, "exceeds the available context size") {
		matched = true
	}
	return info, matched
}

// learnOverflow recognizes an upstream's context-overflow answer to cr
// (DESIGN step 5) and learns the n_ctx it reports; recoverOnce does the
// rest.
func (s *Server) learnOverflow(cr *chatRequest, status int, body []byte) (overflowInfo, bool) {
	info, ok := parseOverflow(status, body)
	if !ok {
		return info, false
	}
	if info.nCtx > 0 {
		s.windows.learn(cr.req.Model, info.nCtx)
	}
	return info, true
}
