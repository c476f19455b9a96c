package anchor

import (
	"math"
	"slices"
	"sync"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// Anchor is one provider measurement of a conversation: the forwarded view's
// first PrefixLen messages (under the chain's seed, which carries the model
// identity and the prompt-shaping fields) hash to Prefix, and the provider
// reported Input (normalized, see Usage) and Output tokens for it at At
// (unix seconds). Tenant separation comes from the store key.
type Anchor struct {
	PrefixLen int
	Prefix    Digest
	Input     int
	Output    int
	At        int64
}

// NewAnchor records a measurement for the view whose chain is chain (as
// returned by ViewChain for the forwarded messages): the prefix is the whole
// view. ok is false when the usage reports no input or the view is empty.
func NewAnchor(chain []Digest, u Usage, at int64) (Anchor, bool) {
	n := len(chain) - 1
	if n < 1 || !u.HasInput {
		return Anchor{}, false
	}
	return Anchor{PrefixLen: n, Prefix: chain[n], Input: u.Input, Output: u.Output, At: at}, true
}

// LocalEstimator estimates the tokens one message adds to the prompt
// without a tokenizer. It must be O(1) or close: it runs for every message
// of every request.
type LocalEstimator interface {
	Tokens(m *chat.Message) int
}

// Constants of the default local estimator. They approximate BPE
// tokenizers of current chat models (cl100k/o200k, Llama 3, Qwen 2/3)
// on agent traffic; whatever they miss on the anchored path is bounded by
// the few messages after the anchor, and on the local path the calibration
// ratio absorbs a per-model bias.
const (
	// MessageOverheadTokens: role markers and separators a chat template
	// adds per message (ChatML: <|im_start|>role\n ... <|im_end|>\n).
	MessageOverheadTokens = 4
	// ToolCallOverheadTokens: per-call wrapper tokens (<tool_call> and
	// the like) beyond the call's JSON, which is counted by bytes.
	ToolCallOverheadTokens = 3
	// MediaPartTokens is the fixed cost of one image, audio or file part:
	// OpenAI's cost of a high-detail 1024x1024 image (85 base + 4 tiles x
	// 170). The base64 payload is never counted: its length says nothing
	// about the tokens a vision or audio encoder produces.
	MediaPartTokens = 765
	// textBytesPerToken: natural-language text and code average about 4
	// bytes per token (English ~4.2, code ~3.5; CJK text is ~3 bytes per
	// token and is undercounted here, which the calibration ratio corrects
	// per model on the local path).
	textBytesPerToken = 4
	// structBytesPerToken: JSON outside text content (tool-call arguments,
	// keys, ids, escapes) is token-dense.
	structBytesPerToken = 3
	// envelopeBytes: the bytes of the smallest message object,
	// {"role":"user","content":""}, which the template replaces by the
	// per-message overhead.
	envelopeBytes = 28
)

// NewLocalEstimator returns the default estimator: a calibrated byte count
// from the parser's fields, O(1) per message:
//
//	4 + ceil(TextBytes/4) + ceil((len(Raw) - MediaBytes - TextBytes - 28)/3)
//	  + 3 per tool call + 765 per image/audio/file part.
//
// Why not a real BPE tokenizer: a Go BPE runs at about 2.5 MB/s, so a
// 1 MiB agent request would cost ~400 ms of proxy overhead per request
// (compared to ~1 ms for the whole digest chain), unless every message's
// count were cached across requests; the anchor makes most of the count
// come from the provider anyway, and which tokenizer the upstream model
// uses is unknown to the proxy in general. The estimate only has to be
// close for the few messages after an anchor.
func NewLocalEstimator() LocalEstimator { return byteEstimator{} }

var defaultEstimator LocalEstimator = byteEstimator{}

type byteEstimator struct{}

func (byteEstimator) Tokens(m *chat.Message) int {
	text := max(m.TextBytes, 0)
	other := max(len(m.Raw)-max(m.MediaBytes, 0)-text-envelopeBytes, 0)
	return MessageOverheadTokens +
		(text+textBytesPerToken-1)/textBytesPerToken +
		(other+structBytesPerToken-1)/structBytesPerToken +
		len(m.ToolCalls)*ToolCallOverheadTokens +
		max(m.MediaParts, 0)*MediaPartTokens
}

// Bounds of a calibration ratio (reported ÷ local).
const (
	MinRatio = 0.5
	MaxRatio = 4.0
)

// DefaultMaxModels bounds a Calibration's memory when NewCalibration gets 0.
const DefaultMaxModels = 256

// calibrationWindow is how many recent ratios a model keeps; the ratio is
// their median, so one odd request (a huge image, a request the template
// renders unusually) does not move it.
const calibrationWindow = 15

// Calibration learns, per model identity, the ratio of provider-reported
// input to the local estimate of the same view. It is statistics about a
// tokenizer and a chat template, shared across tenants. Safe for concurrent
// use; the zero value is ready (DefaultMaxModels).
//
// Memory is bounded: at most max model identities (each a fixed window);
// when full, the identity observed least recently is forgotten. Since the
// requested model name is client input, callers should observe only after
// the upstream answered successfully, so only models the upstream serves
// take a slot.
type Calibration struct {
	mu     sync.RWMutex
	max    int
	tick   uint64
	models map[string]*modelRatio
}

type modelRatio struct {
	recent [calibrationWindow]float64
	n      int // filled entries of recent
	next   int // ring position
	ratio  float64
	seen   uint64
}

// NewCalibration returns a Calibration keeping at most maxModels model
// identities (0 = DefaultMaxModels).
func NewCalibration(maxModels int) *Calibration {
	return &Calibration{max: maxModels}
}

// Observe records one pair for model: tokens the provider reported and the
// local estimate of the same messages (see ObserveEstimate, which picks the
// pair). Pairs with a non-positive side are ignored; each ratio is clamped
// to [MinRatio, MaxRatio].
func (c *Calibration) Observe(model string, reported, local int) {
	if reported <= 0 || local <= 0 {
		return
	}
	r := min(max(float64(reported)/float64(local), MinRatio), MaxRatio)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.models == nil {
		c.models = make(map[string]*modelRatio)
	}
	c.tick++
	m := c.models[model]
	if m == nil {
		limit := c.max
		if limit <= 0 {
			limit = DefaultMaxModels
		}
		for len(c.models) >= limit {
			c.evictOldest()
		}
		m = &modelRatio{}
		c.models[model] = m
	}
	m.seen = c.tick
	m.recent[m.next] = r
	m.next = (m.next + 1) % calibrationWindow
	m.n = min(m.n+1, calibrationWindow)
	var buf [calibrationWindow]float64
	w := buf[:m.n]
	copy(w, m.recent[:m.n])
	slices.Sort(w)
	if m.n%2 == 1 {
		m.ratio = w[m.n/2]
	} else {
		m.ratio = (w[m.n/2-1] + w[m.n/2]) / 2
	}
}

func (c *Calibration) evictOldest() {
	var oldest string
	var seen uint64 = math.MaxUint64
	for k, m := range c.models {
		if m.seen < seen {
			oldest, seen = k, m.seen
		}
	}
	delete(c.models, oldest)
}

// minMarginalTokens: an anchored view whose messages after the anchor are
// estimated below this is not observed (a handful of tokens gives a noisy
// ratio; a retry of the same view has none).
const minMarginalTokens = 16

// ObserveEstimate records the provider's reported input for a forwarded
// view whose estimate was est. For an anchored estimate it observes the
// marginal pair (reported − Baseline, Suffix): the tokens the provider
// counted for the messages after the anchor against their local estimate,
// which is the ratio EstimateView applies to those messages and is free of
// the fixed scaffolding (tools, template) that whole-view pairs carry. For
// a local estimate it observes the whole view (reported, Local).
func (c *Calibration) ObserveEstimate(model string, est Estimate, reported int) {
	if est.Source == SourceAnchor {
		if est.Suffix >= minMarginalTokens {
			c.Observe(model, reported-est.Baseline, est.Suffix)
		}
		return
	}
	c.Observe(model, reported, est.Local)
}

// Ratio is model's learned ratio: 1 until the first observation, always
// within [MinRatio, MaxRatio].
func (c *Calibration) Ratio(model string) float64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if m := c.models[model]; m != nil && m.n > 0 {
		return m.ratio
	}
	return 1
}

// Estimate sources.
const (
	SourceAnchor = "anchor"
	SourceLocal  = "local"
)

// Estimate is the context size of one view.
type Estimate struct {
	// Tokens is the estimated provider input for the view.
	Tokens int
	// Source is SourceAnchor when a provider measurement of a prefix of the
	// view was used, else SourceLocal.
	Source string
	// PrefixLen is the number of leading messages the anchor covers (0 for
	// SourceLocal).
	PrefixLen int
	// Baseline is the anchor's reported input (0 for SourceLocal).
	Baseline int
	// Local is the unscaled local estimate of the whole view.
	Local int
	// Suffix is the unscaled local estimate of the messages after the
	// anchored prefix (equal to Local for SourceLocal).
	Suffix int
}

// EstimateView estimates one view (any view: the client's, a re-applied
// compaction, a fresh one). chain holds the view's digests d[0..n] under
// its seed, local[i] the local estimate of message i (both from ViewChain).
//
// The longest anchor whose prefix matches the view (PrefixLen ≤ n and
// chain[PrefixLen] == Prefix) gives the baseline: Tokens = its Input +
// round(local estimate of every later message × ratio). Anchors whose digest does not
// match (an earlier message was edited or compacted, another model or
// another tools list: the seed differs) are ignored. Of equal lengths the
// first (most recent) wins. Anchors with PrefixLen < 1 never match: d0
// alone says nothing about any message, and the local path with the
// calibration ratio is a better estimate than a measurement of another
// conversation's first request.
//
// No matching anchor: Tokens = round(sum(local) × ratio).
//
// ratio is the model's Calibration.Ratio, clamped to [MinRatio, MaxRatio]
// (a non-positive or NaN ratio means 1). With ratio 1 the anchored path is
// exactly DESIGN's "reported input + local estimate of every later
// message". Scaling the later messages too matters early in a conversation,
// when one step's tool results are a third of the prompt: in
// TestSimulatedAgentLoop the unscaled suffix was 8-11% low at steps 1-2
// (the local estimate undercounts code), the scaled one within 5%. Feed the
// Calibration with ObserveEstimate, so that the ratio is learned from the
// same kind of pair it is applied to.
//
// If local is shorter than the chain's n, only its length counts.
func EstimateView(chain []Digest, local []int, anchors []Anchor, ratio float64) Estimate {
	n := min(len(chain)-1, len(local))
	total := 0
	for _, t := range local[:max(n, 0)] {
		total += t
	}
	best := -1
	for i := range anchors {
		a := &anchors[i]
		if a.PrefixLen < 1 || a.PrefixLen > n || chain[a.PrefixLen] != a.Prefix {
			continue
		}
		if best < 0 || a.PrefixLen > anchors[best].PrefixLen {
			best = i
		}
	}
	if !(ratio > 0) { // also NaN
		ratio = 1
	}
	ratio = min(max(ratio, MinRatio), MaxRatio)
	if best >= 0 {
		a := anchors[best]
		suffix := 0
		for _, t := range local[a.PrefixLen:n] {
			suffix += t
		}
		return Estimate{
			Tokens: a.Input + int(math.Round(float64(suffix)*ratio)), Source: SourceAnchor,
			PrefixLen: a.PrefixLen, Baseline: a.Input, Local: total, Suffix: suffix,
		}
	}
	return Estimate{Tokens: int(math.Round(float64(total) * ratio)), Source: SourceLocal, Local: total, Suffix: total}
}
