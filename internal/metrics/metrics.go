// Package metrics defines compactproxy's Prometheus metrics. Everything is
// registered on a registry passed in (never the global default), with the
// compactproxy_ prefix and labels from small fixed sets: never a conversation,
// a key or a free-form model name.
package metrics

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// RetryOps are the op label values of upstream_retries_total: a retry is
// counted with the route it serves (the http_requests_total route of the
// same name), summarize calls under their own.
var RetryOps = []string{"chat", "responses", "messages", "summarize"}

// ReducedSteps are the step label values of reduced_tokens_total, in the
// ladder's order.
var ReducedSteps = []string{"dedupe", "mask", "trim", "summarize", "drop"}

// Metrics holds every metric of DESIGN.md's list.
type Metrics struct {
	HTTPRequests        *prometheus.CounterVec // route, code
	UpstreamRetries     *prometheus.CounterVec // op (RetryOps), reason
	Compactions         *prometheus.CounterVec // action
	Summarize           *prometheus.CounterVec // result
	SummarizeSuppressed *prometheus.CounterVec // reason
	LatchEngaged        prometheus.Counter
	PairingViolations   *prometheus.CounterVec // kind
	UIOnlyRemoved       prometheus.Counter
	AnchorLookups       *prometheus.CounterVec // result
	ContextTokens       prometheus.Histogram
	UsageInputTokens    *prometheus.CounterVec // kind
	Overhead            prometheus.Histogram
	UpstreamDuration    prometheus.Histogram
	InvariantFailures   prometheus.Counter
	UnknownWindow       prometheus.Counter
	CompactionErrors    prometheus.Counter
	// ForwardedTokens is the estimate of what was forwarded, observed with
	// ContextTokens: the difference of their sums is the tokens compaction
	// saved (dashboards: "tokens saved").
	ForwardedTokens prometheus.Histogram
	// SummarizeDuration times the compaction steps that called the
	// summarizer (every chunk of one summary), by result.
	SummarizeDuration *prometheus.HistogramVec // result
	// CompactionImpossible counts chat requests whose fixed part alone
	// (leading system messages, tools, template) is over the budget.
	CompactionImpossible prometheus.Counter
	// SummarizeInputTokens is the summarize calls' own reported input
	// (kind uncached|cache_read|cache_write).
	SummarizeInputTokens *prometheus.CounterVec
	// Presummarize counts background summaries by result.
	Presummarize *prometheus.CounterVec // result
	// ReducedTokens is the estimated tokens each step of the ladder
	// removed from forwarded views (step dedupe|mask|trim|summarize|drop),
	// counted once per forwarded decision; CacheResets the forwarded views
	// whose prefix differs from the lineage's previous forwarded request
	// before its end (the provider re-reads from there uncached once).
	ReducedTokens *prometheus.CounterVec // step
	CacheResets   prometheus.Counter
	StoreErrors   *prometheus.CounterVec // op
	StreamAborts  prometheus.Counter
}

// New registers the metrics on reg, plus the Go and process collectors.
func New(reg prometheus.Registerer) *Metrics {
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	f := promauto.With(reg)
	const ns = "compactproxy"
	m := &Metrics{
		HTTPRequests: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "http_requests_total",
			Help: "HTTP requests served, by route and status code."}, []string{"route", "code"}),
		UpstreamRetries: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "upstream_retries_total",
			Help: "Upstream retries, by operation (the route served: chat|responses|messages, or summarize) and reason."}, []string{"op", "reason"}),
		Compactions: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "compactions_total",
			Help: "Compactions applied to forwarded requests, by action."}, []string{"action"}),
		Summarize: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "summarize_total",
			Help: "Summarize calls, by result."}, []string{"result"}),
		SummarizeSuppressed: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "summarize_suppressed_total",
			Help: "Summarize attempts skipped, by reason (latch|throttle)."}, []string{"reason"}),
		LatchEngaged: f.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "latch_engaged_total",
			Help: "Times the summarize failure latch engaged."}),
		PairingViolations: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "pairing_violations_total",
			Help: "Tool-call pairing violations seen in requests, by kind, in every pairing mode."}, []string{"kind"}),
		UIOnlyRemoved: f.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "ui_only_removed_total",
			Help: "UI-only messages removed before forwarding."}),
		AnchorLookups: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "anchor_lookups_total",
			Help: "Context estimates, by whether an anchored prefix was found."}, []string{"result"}),
		ContextTokens: f.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "context_tokens",
			Help:    "Estimated context tokens of chat requests (the estimate that decided the action).",
			Buckets: prometheus.ExponentialBuckets(256, 2, 12)}),
		UsageInputTokens: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "usage_input_tokens_total",
			Help: "Provider-reported input tokens, by kind (uncached|cache_read|cache_write)."}, []string{"kind"}),
		Overhead: f.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "overhead_seconds",
			Help:    "Time spent inside the proxy before the upstream call (summarize excluded).",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 14)}),
		UpstreamDuration: f.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "upstream_duration_seconds",
			Help:    "Upstream chat-completions duration, from sending the request to the end of the response.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 14)}),
		InvariantFailures: f.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "compaction_invariant_failures_total",
			Help: "Compaction views discarded because they failed the strict pairing check."}),
		UnknownWindow: f.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "unknown_window_total",
			Help: "Chat requests for a model whose context window is unknown (not compacted)."}),
		CompactionErrors: f.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "compaction_errors_total",
			Help: "Requests forwarded without compaction because compaction failed (fail open)."}),
		ForwardedTokens: f.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "forwarded_tokens",
			Help:    "Estimated tokens of the chat requests as forwarded (after compaction); observed with context_tokens.",
			Buckets: prometheus.ExponentialBuckets(256, 2, 12)}),
		SummarizeDuration: f.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "summarize_duration_seconds",
			Help:    "Time of the compaction steps that called the summarizer (all chunks of one summary), by result.",
			Buckets: prometheus.ExponentialBuckets(0.05, 2, 12)}, []string{"result"}),
		Presummarize: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "presummarize_total",
			Help: "Background summaries made after a response whose next request nears the trigger, by result."}, []string{"result"}),
		SummarizeInputTokens: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "summarize_input_tokens_total",
			Help: "Input tokens the summarize calls' answers reported, by kind (how much the upstream's cache served)."}, []string{"kind"}),
		CompactionImpossible: f.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "compaction_impossible_total",
			Help: "Chat requests over the budget whose fixed part (system messages, tools, template) alone is over it: forwarded as is."}),
		ReducedTokens: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "reduced_tokens_total",
			Help: "Estimated tokens removed from forwarded views, by the compaction step that removed them (dedupe|mask|trim|summarize|drop)."}, []string{"step"}),
		CacheResets: f.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "cache_resets_total",
			Help: "Forwarded views that change what the previous forwarded request of the conversation already held: the provider re-reads from there uncached once."}),
		StoreErrors: f.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "store_errors_total",
			Help: "Failed state store operations (load, save, lock); the request went on without them."}, []string{"op"}),
		StreamAborts: f.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "stream_aborts_total",
			Help: "Upstream streams broken off and aborted to the client (no clean end)."}),
	}
	// Pre-create the fixed label values so dashboards see zeros.
	for _, r := range []string{"hit", "miss"} {
		m.AnchorLookups.WithLabelValues(r)
	}
	for _, k := range []string{"uncached", "cache_read", "cache_write"} {
		m.SummarizeInputTokens.WithLabelValues(k)
	}
	for _, r := range []string{"success", "failure"} {
		m.Presummarize.WithLabelValues(r)
	}
	// Counters that alerts watch with increase()/rate(): a series born at
	// its first increment has no earlier sample, so Prometheus would miss
	// that first violation or retry.
	for _, k := range []string{"orphan_tool_result", "unanswered_tool_call", "duplicate_tool_call_id",
		"interleaved_message", "missing_tool_call_id", "orphan_function_result"} {
		m.PairingViolations.WithLabelValues(k)
	}
	for _, op := range RetryOps {
		for _, r := range []string{"connect", "status_429", "status_5xx", "context_overflow", "stream_options"} {
			m.UpstreamRetries.WithLabelValues(op, r)
		}
	}
	for _, k := range []string{"uncached", "cache_read", "cache_write"} {
		m.UsageInputTokens.WithLabelValues(k)
	}
	for _, r := range []string{"success", "failure"} {
		m.Summarize.WithLabelValues(r)
		m.SummarizeDuration.WithLabelValues(r)
	}
	for _, r := range []string{"latch", "throttle"} {
		m.SummarizeSuppressed.WithLabelValues(r)
	}
	for _, a := range []string{"masked", "trimmed", "summarized", "reused", "dropped"} {
		m.Compactions.WithLabelValues(a)
	}
	for _, st := range ReducedSteps {
		m.ReducedTokens.WithLabelValues(st)
	}
	for _, op := range []string{"load", "save", "lock"} {
		m.StoreErrors.WithLabelValues(op)
	}
	return m
}

// ObserveSummarize records how long a summarizing compaction step took.
func (m *Metrics) ObserveSummarize(ok bool, d time.Duration) {
	result := "failure"
	if ok {
		result = "success"
	}
	m.SummarizeDuration.WithLabelValues(result).Observe(d.Seconds())
}

// Code formats an HTTP status for the code label.
func Code(status int) string { return strconv.Itoa(status) }
