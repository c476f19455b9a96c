package wire

import "testing"

// The overflow answers compactproxy recognizes, and the look-alikes it must
// not (DESIGN § Window: a learned n_ctx comes only from a recognized
// overflow with consistent sizes; CRAFT habit 25).
func TestParseOverflow(t *testing.T) {
	cases := []struct {
		name   string
		status int
		body   string
		ok     bool
		prompt int
		nCtx   int
	}{
		{"llama.cpp exceed_context_size_error", 400,
			`{"error":{"code":400,"message":"request (9000 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":8192}}`,
			true, 9000, 8192},
		{"llama.cpp with inconsistent sizes learns nothing", 400,
			`{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":100,"n_ctx":8192}}`,
			true, 0, 0},
		{"OpenAI context_length_exceeded, resulted in", 400,
			`{"error":{"message":"This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens. Please reduce the length of the messages.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}`,
			true, 9000, 8192},
		{"OpenAI messages and functions and completion", 400,
			`{"error":{"message":"This model's maximum context length is 8192 tokens. However, you requested 9300 tokens (8000 in the messages, 300 in the functions, and 1000 in the completion). Please reduce the length of the messages, functions, or completion.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}`,
			true, 8300, 8192},
		{"OpenAI without sizes", 400,
			`{"error":{"message":"Your input exceeds the context window of this model. Please adjust your input and try again.","type":"invalid_request_error","param":"input","code":"context_length_exceeded"}}`,
			true, 0, 0},
		{"DeepSeek (OpenAI wording, no code)", 400,
			`{"error":{"message":"This model's maximum context length is 65536 tokens. However, you requested 70000 tokens (69000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.","type":"invalid_request_error","param":null,"code":"invalid_request_error"}}`,
			true, 69000, 65536},
		{"vLLM flat, input tokens", 400,
			`{"object":"error","message":"This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. Please reduce the length of the input messages.","type":"BadRequestError","param":null,"code":400}`,
			true, 5000, 4096},
		{"vLLM requested M < N is no overflow", 400,
			`{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 100 tokens (90 in the messages, 10 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}`,
			false, 0, 0},
		{"vLLM max_tokens too large is no overflow", 400,
			`{"object":"error","message":"'max_tokens' or 'max_completion_tokens' is too large: 5000. This model's maximum context length is 4096 tokens and your request has 20 input tokens (5000 > 4096 - 20).","type":"BadRequestError","param":null,"code":400}`,
			false, 0, 0},
		{"Anthropic prompt is too long", 400,
			`{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}`,
			true, 210000, 200000},
		{"Anthropic with M < N learns nothing", 400,
			`{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 10 tokens > 200000 maximum"}}`,
			false, 0, 0},
		{"a validation error quoting a size", 400,
			`{"error":{"message":"Invalid value for 'user': 'This model's maximum context length is 300 tokens. However, your messages resulted in 9000 tokens.'","type":"invalid_request_error","param":"user","code":"invalid_value"}}`,
			false, 0, 0},
		{"pydantic echo of a client's input", 400,
			`{"object":"error","message":"[{'type': 'string_too_long', 'input': 'maximum context length is 300'}]","type":"BadRequestError","param":null,"code":400}`,
			false, 0, 0},
		{"a 500 is never an overflow", 500,
			`{"error":{"message":"This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.","type":"invalid_request_error","code":"context_length_exceeded"}}`,
			false, 0, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			info, ok := RecognizeOverflow("auto", tc.status, []byte(tc.body))
			if ok != tc.ok || info.Prompt != tc.prompt || info.NCtx != tc.nCtx {
				t.Errorf("RecognizeOverflow = %+v %v, want prompt %d n_ctx %d ok %v", info, ok, tc.prompt, tc.nCtx, tc.ok)
			}
		})
	}
}
