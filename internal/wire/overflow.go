package wire

import (
	"encoding/json"
	"regexp"
	"strconv"
	"strings"
)

// Overflow is what an upstream's context-overflow answer told us.
type Overflow struct {
	Prompt int // tokens the provider counted for the request's input (0 = not said)
	NCtx   int // the model's window (0 = not said, or not consistent)
}

// The overflow wordings compactproxy recognizes. Each is anchored at the
// start of the error message: an upstream's validation error may quote a
// client's own value ("Invalid value for 'user': 'This model's maximum
// context length is 300…'", a pydantic echo of the input), and a number
// that a client could have written teaches nothing (DESIGN § Window;
// CRAFT habit 25).
var (
	// OpenAI, DeepSeek and vLLM: "This model's maximum context length is
	// 8192 tokens. However, your messages resulted in 9000 tokens" / "you
	// requested 9300 tokens (8000 in the messages, 300 in the functions,
	// and 1000 in the completion)" / vLLM: "you requested 5000 tokens in the
	// messages" / vLLM ≥ 0.6: "your request has 5000 input tokens".
	reMaxCtx = regexp.MustCompile(`^This model's maximum context length is (\d{1,9}) tokens\. However, (?:your messages resulted in|you requested|your request has) (\d{1,9}) (?:input )?tokens`)
	// The breakdown after the total: "(8000 in the messages, 300 in the
	// functions, and 1000 in the completion)".
	reBreakdown = regexp.MustCompile(`^ ?\(((?:(?:, )?(?:and )?\d{1,9} in the [a-z ]+)+)\)`)
	rePart      = regexp.MustCompile(`(\d{1,9}) in the ([a-z ]+)`)
	// Anthropic: "prompt is too long: 210000 tokens > 200000 maximum".
	reAnthropic = regexp.MustCompile(`^prompt is too long: (\d{1,9}) tokens > (\d{1,9}) maximum$`)
	// llama.cpp's message: "request (9000 tokens) exceeds the available
	// context size (8192 tokens), try increasing it".
	reLlama = regexp.MustCompile(`^request \((\d{1,9}) tokens\) exceeds the available context size \((\d{1,9}) tokens\)`)
)

func atoi(s string) int { n, _ := strconv.Atoi(s); return n }

// overflowEnvelope is the part of an upstream error body the recognizer
// reads: OpenAI's envelope (llama.cpp, vLLM ≥ 0.6, DeepSeek and Anthropic
// use the same "error" object) and vLLM's older flat shape.
type overflowEnvelope struct {
	Error struct {
		Message       string          `json:"message"`
		Type          string          `json:"type"`
		Code          json.RawMessage `json:"code"`
		NPromptTokens int             `json:"n_prompt_tokens"`
		NCtx          int             `json:"n_ctx"`
	} `json:"error"`
	Object  string `json:"object"`  // vLLM's older flat shape: "error"
	Message string `json:"message"` // vLLM's older flat shape
}

// RecognizeOverflow tells whether an upstream error answer is a context
// overflow of the upstream's dialect (upstream.dialect; auto or "": any of them), and what sizes it
// proves. It is an overflow only when the upstream classified it so (its
// type or code) or said so in its own documented sentence, at the start of
// its message; a size is kept only when it is consistent (the request is
// over the window it names).
//
//   - llamacpp: type exceed_context_size_error with n_prompt_tokens ≥ n_ctx
//     (its condition), or its "request (M tokens) exceeds the available
//     context size (N tokens)" sentence;
//   - openai, deepseek, vllm: code context_length_exceeded (sizes or not),
//     or "This model's maximum context length is N tokens. However, …
//     M tokens" with M > N (M ≥ N for the input-only forms, whose servers
//     refuse at equality); the input is M less what the breakdown puts
//     "in the completion" (so the prompt may be under a window that the
//     prompt and the completion together exceed);
//   - anthropic: "prompt is too long: M tokens > N maximum" with M > N.
func RecognizeOverflow(dialect string, status int, body []byte) (Overflow, bool) {
	if status != 400 && status != 413 && status != 422 {
		return Overflow{}, false
	}
	var env overflowEnvelope
	if json.Unmarshal(body, &env) != nil {
		return Overflow{}, false
	}
	e := env.Error
	msg := e.Message
	if msg == "" && env.Object == "error" {
		msg = env.Message
	}
	code := ""
	if len(e.Code) > 0 && e.Code[0] == '"' {
		_ = json.Unmarshal(e.Code, &code)
	}
	is := func(d string) bool { return dialect == "auto" || dialect == "" || dialect == d }
	openaiLike := is("openai") || is("deepseek") || is("vllm")

	if is("llamacpp") && e.Type == "exceed_context_size_error" {
		if e.NCtx > 0 && e.NPromptTokens >= e.NCtx {
			return Overflow{Prompt: e.NPromptTokens, NCtx: e.NCtx}, true
		}
		if m := reLlama.FindStringSubmatch(msg); m != nil {
			if p, n := atoi(m[1]), atoi(m[2]); n > 0 && p >= n {
				return Overflow{Prompt: p, NCtx: n}, true
			}
		}
		return Overflow{}, true // the upstream's own class, no sizes to trust
	}
	if openaiLike {
		if info, ok := openAIOverflow(msg); ok {
			return info, true
		}
		if code == "context_length_exceeded" {
			return Overflow{}, true
		}
	}
	if is("anthropic") {
		if m := reAnthropic.FindStringSubmatch(msg); m != nil && (e.Type == "invalid_request_error" || e.Type == "") {
			if p, n := atoi(m[1]), atoi(m[2]); n > 0 && p > n {
				return Overflow{Prompt: p, NCtx: n}, true
			}
		}
	}
	return Overflow{}, false
}

// openAIOverflow reads "This model's maximum context length is N tokens.
// However, …" (OpenAI, DeepSeek, vLLM). ok only when the sizes say the
// request is over the window.
func openAIOverflow(msg string) (Overflow, bool) {
	m := reMaxCtx.FindStringSubmatchIndex(msg)
	if m == nil {
		return Overflow{}, false
	}
	n, total := atoi(msg[m[2]:m[3]]), atoi(msg[m[4]:m[5]])
	rest := msg[m[1]:]
	input, completion := total, 0
	if b := reBreakdown.FindStringSubmatch(rest); b != nil {
		sum := 0
		for _, p := range rePart.FindAllStringSubmatch(b[1], -1) {
			v := atoi(p[1])
			sum += v
			if strings.TrimSpace(p[2]) == "completion" {
				completion += v
			}
		}
		if sum != total {
			return Overflow{}, false // a breakdown that does not add up
		}
		input = total - completion
	}
	inputOnly := completion == 0
	if n <= 0 || total < n || (total == n && !inputOnly) {
		return Overflow{}, false
	}
	return Overflow{Prompt: input, NCtx: n}, true
}
