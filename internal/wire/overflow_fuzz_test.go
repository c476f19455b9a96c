package wire

import (
	"bytes"
	"encoding/json"
	"strconv"
	"testing"
)

// overflowSeeds are real overflow answers of each upstream and the
// look-alikes that must teach nothing.
var overflowSeeds = []string{
	`{"error":{"code":400,"message":"request (9000 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":8192}}`,
	`{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":100,"n_ctx":8192}}`,
	`{"error":{"message":"This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens. Please reduce the length of the messages.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}`,
	`{"error":{"message":"This model's maximum context length is 8192 tokens. However, you requested 9300 tokens (8000 in the messages, 300 in the functions, and 1000 in the completion). Please reduce the length of the messages, functions, or completion.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}`,
	`{"error":{"message":"Your input exceeds the context window of this model. Please adjust your input and try again.","type":"invalid_request_error","param":"input","code":"context_length_exceeded"}}`,
	`{"error":{"message":"This model's maximum context length is 65536 tokens. However, you requested 70000 tokens (69000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.","type":"invalid_request_error","param":null,"code":"invalid_request_error"}}`,
	`{"object":"error","message":"This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. Please reduce the length of the input messages.","type":"BadRequestError","param":null,"code":400}`,
	`{"object":"error","message":"'max_tokens' or 'max_completion_tokens' is too large: 5000. This model's maximum context length is 4096 tokens and your request has 20 input tokens (5000 > 4096 - 20).","type":"BadRequestError","param":null,"code":400}`,
	`{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}`,
	`{"error":{"message":"Invalid value for 'user': 'This model's maximum context length is 300 tokens. However, your messages resulted in 9000 tokens.'","type":"invalid_request_error","param":"user","code":"invalid_value"}}`,
	`{"object":"error","message":"[{'type': 'string_too_long', 'input': 'maximum context length is 300'}]","type":"BadRequestError","param":null,"code":400}`,
	`{"error":{"message":"bad temperature","type":"invalid_request_error"}}`,
	``,
}

// FuzzOverflowRecognizer feeds any upstream error body, under every
// dialect, to the overflow recognizer and checks what DESIGN § Window asks
// of it: no window is learned unless the body is an overflow of that
// upstream's dialect, stating the window and the size that exceeded it;
// the same text quoted inside a validation error teaches nothing; auto
// recognizes what any single dialect does.
func FuzzOverflowRecognizer(f *testing.F) {
	for _, s := range overflowSeeds {
		for _, st := range []int{400, 413} {
			f.Add(st, uint8(0), []byte(s))
		}
	}
	dialects := []string{"auto", "openai", "llamacpp", "vllm", "deepseek", "anthropic"}
	f.Fuzz(func(t *testing.T, status int, d uint8, body []byte) {
		dialect := dialects[int(d)%len(dialects)]
		info, ok := RecognizeOverflow(dialect, status, body)
		if !ok {
			if info != (Overflow{}) {
				t.Fatalf("not an overflow, yet sizes %+v", info)
			}
			return
		}
		if status != 400 && status != 413 && status != 422 {
			t.Fatalf("status %d taken as an overflow", status)
		}
		if info.Prompt < 0 || info.NCtx < 0 {
			t.Fatalf("negative sizes %+v", info)
		}
		if a, aok := RecognizeOverflow("auto", status, body); !aok {
			t.Fatalf("%s recognizes an overflow that auto does not (%+v)", dialect, a)
		}
		if info.NCtx > 0 {
			// A window is learned only with the input that exceeded it,
			// both stated by the upstream in its own dialect's words.
			if info.Prompt <= 0 {
				t.Fatalf("window %d learned without the prompt that exceeded it", info.NCtx)
			}
			if !bytes.Contains(body, []byte(strconv.Itoa(info.NCtx))) {
				t.Fatalf("window %d is not in the body", info.NCtx)
			}
			marker := map[string]string{"llamacpp": "exceed_context_size_error", "anthropic": "prompt is too long",
				"openai": "maximum context length", "vllm": "maximum context length", "deepseek": "maximum context length"}[dialect]
			if marker != "" && !bytes.Contains(body, []byte(marker)) {
				t.Fatalf("window learned under %s from a body without %q", dialect, marker)
			}
		}
		// The same message quoted by a validation error is no overflow.
		var env overflowEnvelope
		if json.Unmarshal(body, &env) != nil {
			return
		}
		msg := env.Error.Message
		if msg == "" {
			msg = env.Message
		}
		for _, quote := range []string{"Invalid value for 'user': '" + msg + "'", "[{'type': 'string_too_long', 'input': '" + msg + "'}]"} {
			q, _ := json.Marshal(map[string]any{"error": map[string]any{"message": quote, "type": "invalid_request_error", "param": "user", "code": "invalid_value"}})
			if qi, qok := RecognizeOverflow(dialect, status, q); qok {
				t.Fatalf("a validation error quoting %q was taken as an overflow: %+v", msg, qi)
			}
		}
	})
}
