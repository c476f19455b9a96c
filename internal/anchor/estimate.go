package anchor

import (
	"math"
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
	// Local is the local estimate of the whole measured view (0 = not
	// recorded): with Input it is the conversation's own calibration
	// evidence for views that share no prefix with it.
	Local int
	// SumInput and SumLocal are running totals over the conversation's
	// measurements up to this one: what the messages appended between
	// one measured view and the next that extends it cost (Input) and
	// counted locally (see Extend). Their ratio is the conversation's own
	// rate for the messages it appends (tool calls and results), over
	// every step, not the last few.
	SumInput, SumLocal int
}

// Extend carries the running totals of prev, the conversation's previous
// measurement, into a, the measurement of the view whose chain is chain:
// when that view extends prev's (same prefix) and costs and counts more,
// what the appended messages cost is added.
func Extend(prev, a Anchor, chain []Digest) Anchor {
	a.SumInput, a.SumLocal = prev.SumInput, prev.SumLocal
	if prev.PrefixLen >= 1 && prev.PrefixLen < a.PrefixLen && prev.PrefixLen < len(chain) &&
		chain[prev.PrefixLen] == prev.Prefix && a.Input > prev.Input && prev.Local > 0 && a.Local > prev.Local {
		a.SumInput += a.Input - prev.Input
		a.SumLocal += a.Local - prev.Local
	}
	return a
}

// MinRateLocal is the least SumLocal whose rate AppendRate gives: a few
// turns, not one (one turn's cost per local token swings by a factor of
// two on a small vocabulary).
const MinRateLocal = 256

// AppendRate is the conversation's rate for the messages it appends, the
// provider's tokens per local token (see SumInput), from its newest
// measurement a; ok false while too few were measured.
func (a Anchor) AppendRate() (float64, bool) {
	if a.SumLocal < MinRateLocal || a.SumInput <= 0 {
		return 0, false
	}
	return min(max(float64(a.SumInput)/float64(a.SumLocal), MinRatio), MaxRatio), true
}

// NewAnchor records a measurement for the view whose chain is chain (as
// of the forwarded messages, as the proxy computes them): the prefix is the whole
// view, whose local estimate is local. ok is false when the usage reports no
// input or the view is empty.
func NewAnchor(chain []Digest, u Usage, at int64, local int) (Anchor, bool) {
	n := len(chain) - 1
	if n < 1 || !u.HasInput {
		return Anchor{}, false
	}
	return Anchor{PrefixLen: n, Prefix: chain[n], Input: u.Input, Output: u.Output, At: at, Local: local}, true
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

// Bounds of a calibration ratio (provider tokens per local token).
const (
	MinRatio = 0.5
	MaxRatio = 4.0
)

// DefaultMaxModels bounds a Calibration's memory when NewCalibration gets 0.
const DefaultMaxModels = 256

// calibrationWindow is how many recent (reported, local) pairs a model
// keeps for its fit.
const calibrationWindow = 32

// minSpread is the relative spread of the pairs' local sizes, (max − min)
// ÷ max, below which the overhead is not refitted: pairs of nearly one size
// cannot tell a fixed cost from a per-token one (their noise would move the
// intercept by hundreds of tokens).
const minSpread = 0.3

// Fit is a model identity's calibration: a view whose local estimate is L
// costs about Overhead + Ratio × L provider tokens. Overhead is what a
// request costs beyond its messages (the tools array, the chat template's
// own text); Ratio is the tokenizer's tokens per local token. The zero
// value means "nothing learned" and estimates as Overhead 0, Ratio 1.
type Fit struct {
	Overhead float64
	Ratio    float64
	// Pairs is how many (reported, local) pairs the fit was learned from
	// (0 for a fit given as it is).
	Pairs int
}

// ratio is f.Ratio clamped to [MinRatio, MaxRatio] (1 when unset or NaN).
func (f Fit) ratio() float64 {
	r := f.Ratio
	if !(r > 0) {
		return 1
	}
	return min(max(r, MinRatio), MaxRatio)
}

func (f Fit) overhead() float64 {
	if !(f.Overhead > 0) {
		return 0
	}
	return f.Overhead
}

// Tokens is the fit's estimate of a view whose local estimate is local.
func (f Fit) Tokens(local int) int {
	return int(math.Round(f.overhead() + f.ratio()*float64(local)))
}

// Calibration learns, per model identity, the Fit of provider-reported
// input against the local estimate of the same whole views: a small
// least-squares fit over a bounded window of recent pairs (DESIGN.md §
// Anchors). It is statistics about a tokenizer and a chat template, shared
// across tenants. Safe for concurrent use; the zero value is ready
// (DefaultMaxModels).
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
	models map[string]*modelFit
}

type pair struct{ local, reported float64 }

type modelFit struct {
	recent [calibrationWindow]pair
	n      int // filled entries of recent
	next   int // ring position
	fit    Fit
	seen   uint64
}

// NewCalibration returns a Calibration keeping at most maxModels model
// identities (0 = DefaultMaxModels).
func NewCalibration(maxModels int) *Calibration {
	return &Calibration{max: maxModels}
}

// Observe records one pair for model: the input the provider reported for
// a whole view and the local estimate of the same view. Pairs with a
// non-positive side are ignored.
func (c *Calibration) Observe(model string, reported, local int) {
	if reported <= 0 || local <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.models == nil {
		c.models = make(map[string]*modelFit)
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
		m = &modelFit{}
		c.models[model] = m
	}
	m.seen = c.tick
	m.recent[m.next] = pair{local: float64(local), reported: float64(reported)}
	m.next = (m.next + 1) % calibrationWindow
	m.n = min(m.n+1, calibrationWindow)
	m.fit = fitPairs(m.recent[:m.n], m.fit.Overhead)
	m.fit.Pairs = m.n
}

// fitPairs fits reported = overhead + ratio × local by least squares. When
// the pairs' sizes are too close to separate the two (or the fit leaves
// the bounds), the previous overhead is kept and only the ratio is fitted
// through it; the overhead is never negative and the ratio stays within
// [MinRatio, MaxRatio].
func fitPairs(ps []pair, prevOverhead float64) Fit {
	var sl, sr, lo, hi float64
	lo = math.Inf(1)
	for _, p := range ps {
		sl += p.local
		sr += p.reported
		lo, hi = min(lo, p.local), max(hi, p.local)
	}
	n := float64(len(ps))
	ml, mr := sl/n, sr/n
	if len(ps) >= 3 && hi > 0 && (hi-lo)/hi >= minSpread {
		var cov, vr float64
		for _, p := range ps {
			cov += (p.local - ml) * (p.reported - mr)
			vr += (p.local - ml) * (p.local - ml)
		}
		if vr > 0 {
			b := cov / vr
			a := mr - b*ml
			if b >= MinRatio && b <= MaxRatio && a >= 0 {
				return Fit{Overhead: a, Ratio: b}
			}
		}
	}
	// Ratio through a fixed overhead: mean of (reported − a) ÷ local.
	a := max(prevOverhead, 0)
	var sum float64
	for _, p := range ps {
		sum += (p.reported - a) / p.local
	}
	b := min(max(sum/n, MinRatio), MaxRatio)
	return Fit{Overhead: a, Ratio: b}
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

// ObserveEstimate records the provider's reported input for a forwarded
// view whose estimate was est: the whole view's pair (reported, Local),
// whatever the estimate's source (the fit needs whole views to tell the
// fixed cost of a request from its per-token cost).
func (c *Calibration) ObserveEstimate(model string, est Estimate, reported int) {
	c.Observe(model, reported, est.Local)
}

// Fit is model's learned fit (the zero Fit until the first observation).
func (c *Calibration) Fit(model string) Fit {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if m := c.models[model]; m != nil && m.n > 0 {
		return m.fit
	}
	return Fit{}
}

// Ratio is model's learned ratio: 1 until the first observation, always
// within [MinRatio, MaxRatio].
func (c *Calibration) Ratio(model string) float64 { return c.Fit(model).ratio() }

// minMarginalTokens: two anchors whose local estimates differ by less
// than this give no marginal rate (a handful of tokens is noise).
const minMarginalTokens = 16

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
	// Ratio is the provider tokens per local token this estimate applied
	// to local counts (the fit's, or the conversation's own): callers use
	// it to size single messages in provider tokens.
	Ratio float64
}

// EstimateView estimates one view (any view: the client's, a re-applied
// compaction, a fresh one). chain holds the view's digests d[0..n] under
// its seed, local[i] the local estimate of message i (both as the proxy computes them).
//
// The longest anchor whose prefix matches the view (PrefixLen ≤ n and
// chain[PrefixLen] == Prefix) gives the baseline: Tokens = its Input +
// round(local estimate of every later message × fit's ratio). Anchors
// whose digest does not match (an earlier message was edited or compacted,
// another model or another tools list: the seed differs) are ignored. Of
// equal lengths the first (most recent) wins. Anchors with PrefixLen < 1
// never match: d0 alone says nothing about any message.
//
// No matching anchor: when the conversation has anchors (anchors with a
// recorded Local), its newest one is better evidence than the model's
// statistics: Tokens = overhead + r × local, where r = (Input − overhead)
// ÷ Local of that anchor (the ratio its measurement implies once the
// request's fixed cost is taken out). Otherwise Tokens = fit.Tokens(local).
//
// fit is the model identity's Calibration.Fit. Scaling the messages after
// an anchor by the ratio matters early in a conversation, when one step's
// tool results are a third of the prompt (the local estimate undercounts
// code): in TestSimulatedAgentLoop the unscaled suffix was 8-11% low at
// steps 1-2, the scaled one within 5%.
//
// If local is shorter than the chain's n, only its length counts.
func EstimateView(chain []Digest, local []int, anchors []Anchor, fit Fit) Estimate {
	n := min(len(chain)-1, len(local))
	total := 0
	for _, t := range local[:max(n, 0)] {
		total += t
	}
	best, newest := -1, -1
	for i := range anchors {
		a := &anchors[i]
		if a.Local > 0 && newest < 0 {
			newest = i
		}
		if a.PrefixLen < 1 || a.PrefixLen > n || chain[a.PrefixLen] != a.Prefix {
			continue
		}
		if best < 0 || a.PrefixLen > anchors[best].PrefixLen {
			best = i
		}
	}
	ratio := fit.ratio()
	if best >= 0 {
		a := anchors[best]
		if fit.Pairs == 1 {
			// One pair cannot tell the request's fixed cost (a tools
			// array, the template) from its per-token cost: its ratio
			// carries the whole overhead (4x, the bound, at step 2 with a
			// tools array on a real-tokenizer 8k model: +200%). The
			// messages after the anchor count at face value until a
			// second pair, or a shorter anchor's marginal rate, says
			// otherwise.
			ratio = 1
		}
		// The conversation's own marginal rate, when a shorter anchor of
		// the same view exists: what its messages between the two
		// measurements cost, free of the request's fixed part (a fit with
		// few pairs folds that into its ratio: 9x at step 2 with a tools
		// array on a 2k model).
		for i := range anchors {
			b := &anchors[i]
			if i == best || b.Local <= 0 || a.Local-b.Local < minMarginalTokens || b.PrefixLen < 1 ||
				b.PrefixLen >= a.PrefixLen || chain[b.PrefixLen] != b.Prefix {
				continue
			}
			ratio = min(max(float64(a.Input-b.Input)/float64(a.Local-b.Local), MinRatio), MaxRatio)
			break
		}
		suffix := 0
		for _, t := range local[a.PrefixLen:n] {
			suffix += t
		}
		return Estimate{
			Tokens: a.Input + int(math.Round(float64(suffix)*ratio)), Source: SourceAnchor,
			PrefixLen: a.PrefixLen, Baseline: a.Input, Local: total, Suffix: suffix, Ratio: ratio,
		}
	}
	if newest >= 0 {
		a := anchors[newest]
		oh := min(fit.overhead(), float64(a.Input)/2)
		r := min(max((float64(a.Input)-oh)/float64(a.Local), MinRatio), MaxRatio)
		return Estimate{Tokens: int(math.Round(oh + r*float64(total))), Source: SourceLocal, Local: total, Suffix: total, Ratio: r}
	}
	return Estimate{Tokens: fit.Tokens(total), Source: SourceLocal, Local: total, Suffix: total, Ratio: ratio}
}

// TextTokens is the calibrated estimate of n bytes of text sent as one
// message: the local estimator's count of such a message, scaled by the
// model's ratio (the request's fixed overhead is the summarizer's own
// allowance).
func TextTokens(fit Fit, n int) int {
	local := MessageOverheadTokens + (n+3)/4
	r := fit.Ratio
	if !(r > 0) {
		r = 1
	}
	r = min(max(r, MinRatio), MaxRatio)
	return int(math.Ceil(float64(local) * r))
}
