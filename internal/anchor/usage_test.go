package anchor

import "testing"

func TestUsageFromJSON(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want Usage
		ok   bool
	}{
		{"openai plain", `{"choices":[{"message":{"content":"usage"}}],"usage":{"prompt_tokens":100,"completion_tokens":7,"total_tokens":107}}`,
			Usage{Input: 100, Output: 7, Uncached: 100, HasInput: true, HasOutput: true}, true},
		{"openai cached part of prompt", `{"usage":{"prompt_tokens":2006,"completion_tokens":300,"prompt_tokens_details":{"cached_tokens":1920}}}`,
			Usage{Input: 2006, Output: 300, Uncached: 86, CacheRead: 1920, HasInput: true, HasOutput: true}, true},
		{"openrouter cache write part of prompt", `{"usage":{"prompt_tokens":1010,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":800,"cache_write_tokens":200}}}`,
			Usage{Input: 1010, Output: 5, Uncached: 10, CacheRead: 800, CacheWrite: 200, HasInput: true, HasOutput: true}, true},
		{"anthropic 1010 regression", `{"usage":{"input_tokens":10,"cache_read_input_tokens":800,"cache_creation_input_tokens":200,"output_tokens":42}}`,
			Usage{Input: 1010, Output: 42, Uncached: 10, CacheRead: 800, CacheWrite: 200, HasInput: true, HasOutput: true}, true},
		{"anthropic read only", `{"usage":{"input_tokens":3,"cache_read_input_tokens":5000,"output_tokens":1}}`,
			Usage{Input: 5003, Output: 1, Uncached: 3, CacheRead: 5000, HasInput: true, HasOutput: true}, true},
		{"anthropic no cache fields", `{"usage":{"input_tokens":12,"output_tokens":1}}`,
			Usage{Input: 12, Output: 1, Uncached: 12, HasInput: true, HasOutput: true}, true},
		{"responses style inclusive", `{"usage":{"input_tokens":1000,"output_tokens":3,"input_tokens_details":{"cached_tokens":900}}}`,
			Usage{Input: 1000, Output: 3, Uncached: 100, CacheRead: 900, HasInput: true, HasOutput: true}, true},
		{"deepseek hit/miss parts", `{"usage":{"prompt_tokens":1000,"completion_tokens":9,"prompt_cache_hit_tokens":640,"prompt_cache_miss_tokens":360}}`,
			Usage{Input: 1000, Output: 9, Uncached: 360, CacheRead: 640, HasInput: true, HasOutput: true}, true},
		{"deepseek miss only", `{"usage":{"prompt_tokens":1000,"prompt_cache_miss_tokens":360}}`,
			Usage{Input: 1000, Uncached: 360, CacheRead: 640, HasInput: true}, true},
		{"llama.cpp usage and timings not added", `{"choices":[],"usage":{"prompt_tokens":10000,"completion_tokens":20,"prompt_tokens_details":{"cached_tokens":8500}},"timings":{"prompt_n":1500,"cache_n":8500,"predicted_n":20}}`,
			Usage{Input: 10000, Output: 20, Uncached: 1500, CacheRead: 8500, HasInput: true, HasOutput: true}, true},
		{"llama.cpp timings fallback", `{"choices":[{"delta":{}}],"timings":{"prompt_n":1500,"cache_n":8500,"predicted_n":19,"prompt_ms":12.5}}`,
			Usage{Input: 10000, Output: 19, Uncached: 1500, CacheRead: 8500, HasInput: true, HasOutput: true}, true},
		{"llama.cpp timings without cache_n", `{"timings":{"prompt_n":77,"predicted_n":1}}`,
			Usage{Input: 77, Output: 1, Uncached: 77, HasInput: true, HasOutput: true}, true},
		{"llama.cpp prompt_n -1", `{"timings":{"prompt_n":-1,"cache_n":5,"predicted_n":4}}`,
			Usage{Output: 4, HasOutput: true}, true},
		{"usage null", `{"choices":[{"delta":{"content":"hi"}}],"usage":null}`, Usage{}, false},
		{"no usage", `{"choices":[{"delta":{"content":"usage timings"}}]}`, Usage{}, false},
		{"zero reported is reported", `{"usage":{"prompt_tokens":0,"completion_tokens":0}}`,
			Usage{HasInput: true, HasOutput: true}, true},
		{"output only", `{"usage":{"completion_tokens":5}}`, Usage{Output: 5, HasOutput: true}, true},
		{"odd types skipped", `{"usage":{"prompt_tokens":"12","completion_tokens":3,"prompt_tokens_details":"x"}}`,
			Usage{Output: 3, HasOutput: true}, true},
		{"float literal", `{"usage":{"prompt_tokens":12.0,"completion_tokens":3}}`,
			Usage{Input: 12, Output: 3, Uncached: 12, HasInput: true, HasOutput: true}, true},
		{"cached larger than prompt clamped", `{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":50}}}`,
			Usage{Input: 10, CacheRead: 10, HasInput: true}, true},
		{"gemini", `{"usage":{"completion_tokens":8,"prompt_tokens":1234,"total_tokens":1242}}`,
			Usage{Input: 1234, Output: 8, Uncached: 1234, HasInput: true, HasOutput: true}, true},
		{"invalid json", `{"usage":{"prompt_tokens":1`, Usage{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := UsageFromJSON([]byte(tt.in))
			if ok != tt.ok || got != tt.want {
				t.Errorf("UsageFromJSON(%s) = %+v, %v; want %+v, %v", tt.in, got, ok, tt.want, tt.ok)
			}
			if got.Uncached+got.CacheRead+got.CacheWrite != got.Input {
				t.Errorf("parts %d+%d+%d do not sum to input %d", got.Uncached, got.CacheRead, got.CacheWrite, got.Input)
			}
		})
	}
}
