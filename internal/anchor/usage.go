package anchor

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"strconv"
)

// Usage is provider-reported usage normalized to one meaning.
//
// Input is everything that occupied the context window on the prompt side:
// Uncached + CacheRead + CacheWrite (the three always sum to Input). Cached
// input still occupies the window, so it counts. HasInput and HasOutput tell
// whether the provider reported them at all: "not reported" is not 0.
type Usage struct {
	Input, Output                   int
	Uncached, CacheRead, CacheWrite int
	HasInput, HasOutput             bool
}

// optInt is a non-negative integer field that never fails a decode: null,
// strings, negative numbers (llama.cpp writes prompt_n: -1 when it has no
// timing) and other shapes count as absent.
type optInt struct {
	v  int
	ok bool
}

func (o *optInt) UnmarshalJSON(b []byte) error {
	*o = optInt{}
	if len(b) == 0 || (b[0] != '-' && (b[0] < '0' || b[0] > '9')) {
		return nil
	}
	if n, err := strconv.ParseInt(string(b), 10, 64); err == nil {
		if n >= 0 && n <= math.MaxInt32 {
			*o = optInt{v: int(n), ok: true}
		}
		return nil
	}
	if f, err := strconv.ParseFloat(string(b), 64); err == nil && f >= 0 && f <= math.MaxInt32 && f == math.Trunc(f) {
		*o = optInt{v: int(f), ok: true}
	}
	return nil
}

type cachedDetails struct {
	CachedTokens     optInt `json:"cached_tokens"`
	CacheWriteTokens optInt `json:"cache_write_tokens"`
}

// usageBody holds only the usage fields of a response body or SSE chunk;
// encoding/json skips everything else ("choices" is scanned, not decoded).
type usageBody struct {
	Usage *struct {
		// OpenAI, vLLM, llama.cpp, DeepSeek, Gemini (OpenAI-compatible).
		PromptTokens        optInt         `json:"prompt_tokens"`
		CompletionTokens    optInt         `json:"completion_tokens"`
		PromptTokensDetails *cachedDetails `json:"prompt_tokens_details"`
		// DeepSeek: hit + miss = prompt_tokens.
		PromptCacheHitTokens  optInt `json:"prompt_cache_hit_tokens"`
		PromptCacheMissTokens optInt `json:"prompt_cache_miss_tokens"`
		// Anthropic style: three disjoint parts. Also OpenAI Responses
		// style (input_tokens inclusive, input_tokens_details.cached_tokens
		// a part of it), which llama.cpp's /v1/responses writes.
		InputTokens              optInt         `json:"input_tokens"`
		OutputTokens             optInt         `json:"output_tokens"`
		CacheReadInputTokens     optInt         `json:"cache_read_input_tokens"`
		CacheCreationInputTokens optInt         `json:"cache_creation_input_tokens"`
		InputTokensDetails       *cachedDetails `json:"input_tokens_details"`
	} `json:"usage"`
	// llama.cpp: prompt_n tokens were evaluated now, cache_n were reused
	// from the KV cache; predicted_n were generated.
	Timings *struct {
		PromptN    optInt `json:"prompt_n"`
		CacheN     optInt `json:"cache_n"`
		PredictedN optInt `json:"predicted_n"`
	} `json:"timings"`
}

var (
	usageKey   = []byte(`"usage"`)
	timingsKey = []byte(`"timings"`)
)

// UsageFromJSON reads provider usage from a JSON response body or from one
// SSE chunk's JSON. ok is false when the object reports neither input nor
// output (most stream chunks; "usage": null).
//
// Normalization, never double counting:
//   - usage.prompt_tokens (OpenAI, vLLM, llama.cpp, DeepSeek, Gemini) is
//     the whole prompt: prompt_tokens_details.cached_tokens, DeepSeek's
//     prompt_cache_hit_tokens/prompt_cache_miss_tokens and OpenRouter's
//     prompt_tokens_details.cache_write_tokens are parts of it, never added;
//   - else usage.input_tokens: Anthropic style, input_tokens (uncached) +
//     cache_read_input_tokens + cache_creation_input_tokens are disjoint and
//     summed; OpenAI-Responses style (input_tokens_details.cached_tokens, no
//     cache_*_input_tokens) is inclusive like prompt_tokens;
//   - else llama.cpp timings: prompt_n + cache_n.
//
// llama.cpp (tools/server/server-task.cpp, usage_json_oaicompat) writes
// prompt_tokens = n_prompt_tokens, the whole prompt, with
// prompt_tokens_details.cached_tokens = n_prompt_tokens_cache, and its
// timings object has prompt_n = tokens evaluated for this request (cached
// ones excluded) and cache_n = tokens reused from the KV cache; ollama
// (github.com/ollama/ollama pull 16428, "llama-server reports newly
// processed prompt tokens separately from cached prompt tokens, so add
// cache_n to prompt_n") relies on the same reading. So prompt_tokens is
// inclusive, timings.prompt_n alone is not, and both together must not be
// added: usage wins when present. llama.cpp may also attach timings to
// intermediate stream chunks (timings_per_token); callers keep the last
// chunk's answer.
func UsageFromJSON(obj []byte) (Usage, bool) {
	// Most stream chunks carry neither key: skip the decode.
	if !bytes.Contains(obj, usageKey) && !bytes.Contains(obj, timingsKey) {
		return Usage{}, false
	}
	var b usageBody
	if err := json.Unmarshal(obj, &b); err != nil {
		// A field of an unexpected type is skipped and the rest decoded;
		// only a syntax error leaves nothing to read.
		var te *json.UnmarshalTypeError
		if !errors.As(err, &te) {
			return Usage{}, false
		}
	}
	var u Usage
	if us := b.Usage; us != nil {
		switch {
		case us.PromptTokens.ok:
			u.Input, u.HasInput = us.PromptTokens.v, true
			switch {
			case us.PromptTokensDetails != nil && us.PromptTokensDetails.CachedTokens.ok:
				u.CacheRead = us.PromptTokensDetails.CachedTokens.v
			case us.PromptCacheHitTokens.ok:
				u.CacheRead = us.PromptCacheHitTokens.v
			case us.PromptCacheMissTokens.ok:
				u.CacheRead = max(0, u.Input-us.PromptCacheMissTokens.v)
			case us.CacheReadInputTokens.ok: // gateways that mix both styles
				u.CacheRead = us.CacheReadInputTokens.v
			}
			switch {
			case us.PromptTokensDetails != nil && us.PromptTokensDetails.CacheWriteTokens.ok:
				u.CacheWrite = us.PromptTokensDetails.CacheWriteTokens.v
			case us.CacheCreationInputTokens.ok:
				u.CacheWrite = us.CacheCreationInputTokens.v
			}
			u.splitInclusive()
		case us.InputTokens.ok && (us.CacheReadInputTokens.ok || us.CacheCreationInputTokens.ok):
			u.Uncached = us.InputTokens.v
			u.CacheRead = us.CacheReadInputTokens.v
			u.CacheWrite = us.CacheCreationInputTokens.v
			u.Input, u.HasInput = u.Uncached+u.CacheRead+u.CacheWrite, true
		case us.InputTokens.ok:
			u.Input, u.HasInput = us.InputTokens.v, true
			if d := us.InputTokensDetails; d != nil && d.CachedTokens.ok {
				u.CacheRead = d.CachedTokens.v
			}
			u.splitInclusive()
		}
		switch {
		case us.CompletionTokens.ok:
			u.Output, u.HasOutput = us.CompletionTokens.v, true
		case us.OutputTokens.ok:
			u.Output, u.HasOutput = us.OutputTokens.v, true
		}
	}
	if t := b.Timings; t != nil {
		if !u.HasInput && t.PromptN.ok {
			u.Uncached = t.PromptN.v
			u.CacheRead = t.CacheN.v // 0 when absent
			u.CacheWrite = 0
			u.Input, u.HasInput = u.Uncached+u.CacheRead, true
		}
		if !u.HasOutput && t.PredictedN.ok {
			u.Output, u.HasOutput = t.PredictedN.v, true
		}
	}
	return u, u.HasInput || u.HasOutput
}

// splitInclusive derives Uncached from an inclusive Input, clamping the
// reported parts so that the three always sum to Input.
func (u *Usage) splitInclusive() {
	u.CacheRead = min(u.CacheRead, u.Input)
	u.CacheWrite = min(u.CacheWrite, u.Input-u.CacheRead)
	u.Uncached = u.Input - u.CacheRead - u.CacheWrite
}
