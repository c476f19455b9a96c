package llama

import (
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/pairing"
)

// The figures of issue 8's "Done when", per configuration, and how each is
// defined when the issue leaves it open:
//
//   - non-200: client-visible answers other than 200 (and streams that did
//     not end with [DONE] or carried an error event).
//   - summary made then reused: a step answered X-Compactproxy-Compaction
//     summarized, and a later step answered reused.
//   - drop while the summarizer works: with summarize_total{failure} = 0, any
//     step answered dropped, or compactions_total{action="dropped"} > 0 (a
//     drop under a summary is answered reused: the header names the
//     strongest action only).
//   - instruction verbatim: every request forwarded to llama-server (every
//     attempt, retries included) holds a user message whose text equals the
//     newest user message the client sent; a step answered dropped must also
//     hold the first user message (the original ask). A summary view carries
//     the original ask inside the summary, so it is not required there.
//   - summarize fits: every summarize request's prompt, counted exactly with
//     llama-server's /apply-template + /tokenize, is < n_ctx, and none was
//     answered 400 (exceed_context_size_error or otherwise).
//   - anchored error: steps with Context-Source anchor and no new compaction
//     (Forwarded-Tokens = Context-Tokens and not summarized): mean of
//     |Forwarded-Tokens − prompt_tokens| ÷ prompt_tokens, prompt_tokens being
//     what llama-server reported for that very forwarded request.
//   - fresh error: the same for steps whose view was compacted now
//     (summarized, or Forwarded-Tokens ≠ Context-Tokens).
//   - local error (not a goal, shown): no new compaction, Context-Source local.
//   - cache reuse: over the forwarded requests of steps 2–40 that reported
//     usage (a refused request reports none: n shows how many counted),
//     Σ cached_tokens ÷ Σ prompt_tokens (summarize calls excluded; their own
//     ratio is shown apart).

// stepFigures is one row of the per-step table.
type stepFigures struct {
	clientStep
	attempts     int    // forwarded requests for this step (2 = a retry)
	attStatus    string // their statuses, e.g. "503,200"
	summarizes   int    // summarize calls that began during this step
	upMS         int64  // wall time of this step's forwarded calls at llama-server
	fwdMsgs      int
	fwdBytes     int
	rep          reported // of the last forwarded attempt
	class        string   // anchored, fresh, local, "" (no figure)
	errPct       float64  // (forwarded − prompt_tokens) ÷ prompt_tokens × 100, signed
	summary      string   // the forwarded summary message's text, "" = none
	latestOK     bool
	firstOK      bool // first user message present
	finalOK      bool // the client's last message is the forwarded last message
	pairingIssue string
	view         string // the forwarded roles, one letter each (see viewString)
}

// viewString is a forwarded view in one letter per message: s system,
// u user, a assistant (text), c assistant with tool calls, t tool; F marks
// the first user message (the original ask), L the latest instruction.
func viewString(msgs []fwdMessage, latest string) string {
	var b strings.Builder
	for _, m := range msgs {
		switch {
		case m.Role == "user" && m.text() == firstTask:
			b.WriteByte('F')
		case m.Role == "user" && m.text() == latest:
			b.WriteByte('L')
		case m.Role == "assistant" && len(m.ToolCalls) > 0:
			b.WriteByte('c')
		case m.Role == "":
			b.WriteByte('?')
		default:
			b.WriteByte(m.Role[0])
		}
	}
	return b.String()
}

// summarizeFigures is one summarize call.
type summarizeFigures struct {
	path           string // the endpoint it was sent to
	fields         string // its top-level fields other than the history, for a failure's log
	seq, step      int
	status         int
	measured       int // /apply-template + /tokenize
	reported       reported
	maxTokens      int
	messages       int
	bytes          int
	measureErr     string
	hasTools       bool
	lastRoleIsUser bool
	dur            time.Duration
}

type figures struct {
	cfg      llamaConfig
	nCtx     int
	duration time.Duration
	rows     []stepFigures
	sums     []summarizeFigures
	metrics  map[string]float64

	non200, badStreams    int
	actions               map[string]int
	firstSummarized       int     // first step forwarding a summary, 0 = none
	firstReusedAfter      int     // first later step forwarding a summary an earlier step forwarded, 0 = none
	summariesApplied      int     // distinct summaries forwarded
	drops                 int     // steps answered dropped
	dropMetric            float64 // compactions_total{action="dropped"}: also drops under a summary (answered reused)
	sumSuccess, sumFail   float64 // metrics
	sumOverWindow, sum400 int
	sumMaxMeasured        int
	latestMissing         []int
	firstMissing          []int
	finalMoved            []int
	pairingBad            []int
	anchoredN, freshN     int
	localN                int
	anchoredMAE, freshMAE float64
	localMAE              float64
	cacheReuse            float64
	sumCached, sumPrompt  int
	cacheSteps            int // forwarded requests the cache figure covers
	// The cache figure's ceiling: what a forwarded prompt must evaluate
	// however the proxy compacts is what the client appended since its
	// previous request (N_i, exact: the client's views counted by
	// llama-server). ceiling = Σ(P_i − N_i) ÷ ΣP_i is the best cache share
	// any proxy gets forwarding these prompts; efficiency = Σcached ÷
	// Σ(P_i − N_i) is the share of the rest the cache served.
	sumAppended     int
	cacheCeiling    float64
	cacheEfficiency float64
	// cacheLateReference: the cache figure of a proxy that compacts only
	// when the budget forces it, straight to DESIGN's floor (reference_test.go).
	cacheLateReference float64
	sumCacheReuse      float64
	// Σ timings.prompt_n: the prompt tokens llama-server evaluated (not
	// served from its cache), forwarded requests and summarize calls.
	promptNFwd, promptNSum int
	forwards, summarizes   int
	overflowRetries        int
	toolsTokens            int // what the tools array adds to a prompt (exact)
	fixedTokens            int // the fixed part: system prompt + tools (exact)
	// Issue 19: the steps whose requests made a summarize call (request
	// path or background), and the steps that first forwarded a new
	// summary with that view's reported size and its target.
	summarizeSteps []int
	afterSummary   []afterSummary
	baseTokens     int // system prompt + first task, no tools
	resultBytes    int
	resultTokens   int
	// otherCalls: the POSTs other than model calls that reached
	// llama-server, by path (exact counters compactproxy may use).
	otherCalls map[string]int
}

// afterSummary is the first forwarded view that carries a new summary.
type afterSummary struct {
	step, prompt, target int
}

// target is compactproxy's target for step i's request at its defaults:
// F + target_ratio (0.6) × (budget − F), the room after the fixed part F
// with the budget the request's max tokens leave (DESIGN § Budget).
func (f *figures) target(shape requestShape) int {
	reserve := 4096
	if f.cfg.reserve > 0 {
		reserve = f.cfg.reserve
	}
	budget := f.cfg.ctx - min(max(reserve, shape.maxTokens), f.cfg.ctx/4)
	return f.fixedTokens + int(0.6*float64(budget-f.fixedTokens))
}

// fwdMessage is the part of a forwarded message the checks read.
type fwdMessage struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content"`
	ToolCallID *string         `json:"tool_call_id"`
	ToolCalls  []struct {
		ID       *string `json:"id"`
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	} `json:"tool_calls"`
}

func (m fwdMessage) text() string {
	var s string
	if json.Unmarshal(m.Content, &s) == nil {
		return s
	}
	var parts []textPart
	if json.Unmarshal(m.Content, &parts) == nil {
		var b strings.Builder
		for _, p := range parts {
			b.WriteString(p.Text)
		}
		return b.String()
	}
	return ""
}

type fwdBody struct {
	Messages            []fwdMessage      `json:"messages"`
	Tools               []json.RawMessage `json:"tools"`
	MaxTokens           int               `json:"max_tokens"`
	MaxCompletionTokens int               `json:"max_completion_tokens"`
}

func pairingOf(msgs []fwdMessage) []pairing.Message {
	out := make([]pairing.Message, len(msgs))
	for i, m := range msgs {
		pm := pairing.Message{Role: m.Role}
		if m.ToolCallID != nil {
			pm.ToolCallID, pm.HasToolCallID = *m.ToolCallID, true
		}
		for _, c := range m.ToolCalls {
			pc := pairing.Call{Name: c.Function.Name}
			if c.ID != nil {
				pc.ID, pc.HasID = *c.ID, true
			}
			pm.Calls = append(pm.Calls, pc)
		}
		out[i] = pm
	}
	return out
}

// summaryText is the text of the user message carrying compactproxy's
// summary (internal/compaction's label opens it), "" when there is none.
func summaryText(msgs []fwdMessage) string {
	for _, m := range msgs {
		if m.Role == "user" && strings.HasPrefix(m.text(), summaryLabel) {
			return m.text()
		}
	}
	return ""
}

// summaryLabel is the text compactproxy's summary message opens with
// (internal/compaction/view.go). A changed label fails the summary goals
// (no summary is found), so the late-compaction reference, which opens its
// summaries with it, never measures another label.
const summaryLabel = "[Summary of the earlier conversation (compactproxy); the latest messages follow verbatim.]\n\n"

func hasUser(msgs []fwdMessage, text string) bool {
	for _, m := range msgs {
		if m.Role == "user" && m.text() == text {
			return true
		}
	}
	return false
}

func computeFigures(t *testing.T, cfg llamaConfig, ls *llamaServer, cs []clientStep, calls []*upstreamCall,
	metrics map[string]float64, tools []json.RawMessage, script []scriptStep, final []message) *figures {
	t.Helper()
	f := &figures{cfg: cfg, nCtx: ls.nCtx, metrics: metrics, actions: map[string]int{}}
	byStep := map[int][]*upstreamCall{}
	sumsByStep := map[int]int{}
	for _, c := range calls {
		if c.Kind == "forward" {
			byStep[c.Step] = append(byStep[c.Step], c)
			f.forwards++
		} else {
			sumsByStep[c.Step]++
			f.summarizes++
		}
	}
	lastClient := func(i int) message { // the client's last message at step i
		return final[cs[i].clientMsgs-1]
	}
	var sumCachedS, sumPromptS int
	seenSummary := map[string]bool{}
	var anchored, fresh, local []float64
	for i, st := range cs {
		r := stepFigures{clientStep: st, summarizes: sumsByStep[st.n], latestOK: true, firstOK: true, finalOK: true}
		f.actions[st.action]++
		if st.status != 200 {
			f.non200++
		} else if !st.streamOK {
			f.badStreams++
		}
		atts := byStep[st.n]
		r.attempts = len(atts)
		if len(atts) > 1 {
			f.overflowRetries += len(atts) - 1
		}
		for k, c := range atts {
			if k > 0 {
				r.attStatus += ","
			}
			r.attStatus += fmt.Sprint(c.Status)
			if c.ProxyErr != "" {
				r.attStatus += "(" + c.ProxyErr + ")"
			}
			b, err := chatForm(c.Path, c.Body)
			if err != nil {
				r.pairingIssue = "unparsable body"
				continue
			}
			if !hasUser(b.Messages, st.latest) {
				r.latestOK = false
			}
			if st.action == "dropped" && !hasUser(b.Messages, firstTask) {
				r.firstOK = false
			}
			if vs := pairing.Check(pairingOf(b.Messages)); len(vs) > 0 {
				r.pairingIssue = fmt.Sprintf("%s at %d", vs[0].Kind, vs[0].Index)
			}
			if n := len(b.Messages); n > 0 {
				want := lastClient(i)
				got := b.Messages[n-1]
				wantText, _ := want.Content.(string)
				if parts, ok := want.Content.([]textPart); ok {
					wantText = parts[0].Text
				}
				if got.Role != want.Role || got.text() != wantText {
					r.finalOK = false
				}
			}
			if !c.end.IsZero() {
				r.upMS += c.end.Sub(c.start).Milliseconds()
			}
			rep := parseReported(c.resp.Bytes())
			f.promptNFwd += max(rep.PromptN, 0)
			if st.n >= 2 && rep.PromptTokens > 0 {
				f.sumPrompt += rep.PromptTokens
				cached := rep.CachedTokens
				if cached < 0 {
					cached = max(rep.CacheN, 0)
				}
				f.sumCached += cached
				f.cacheSteps++
			}
			if k == len(atts)-1 {
				r.rep = rep
				r.fwdMsgs = len(b.Messages)
				r.fwdBytes = len(c.Body)
				r.view = viewString(b.Messages, st.latest)
				r.summary = summaryText(b.Messages)
			}
		}
		if !r.latestOK {
			f.latestMissing = append(f.latestMissing, st.n)
		}
		if !r.firstOK {
			f.firstMissing = append(f.firstMissing, st.n)
		}
		if !r.finalOK {
			f.finalMoved = append(f.finalMoved, st.n)
		}
		if r.pairingIssue != "" {
			f.pairingBad = append(f.pairingBad, st.n)
		}
		if st.status == 200 && r.rep.PromptTokens > 0 && st.forwarded > 0 {
			e := float64(st.forwarded-r.rep.PromptTokens) / float64(r.rep.PromptTokens) * 100
			r.errPct = e
			isNew := st.action == "summarized" || st.forwarded != st.context
			switch {
			case isNew:
				r.class = "fresh"
				fresh = append(fresh, math.Abs(e))
			case st.source == "anchor":
				r.class = "anchored"
				anchored = append(anchored, math.Abs(e))
			default:
				r.class = "local"
				local = append(local, math.Abs(e))
			}
		}
		// A summary is made at the first step that forwards it (answered
		// summarized, or reused when a background summary made it) and
		// reused at a later step that forwards the same text again.
		if r.summary != "" {
			if seenSummary[r.summary] {
				if f.firstSummarized > 0 && f.firstReusedAfter == 0 {
					f.firstReusedAfter = st.n
				}
			} else {
				seenSummary[r.summary] = true
				f.summariesApplied++
				if r.rep.PromptTokens > 0 {
					f.afterSummary = append(f.afterSummary, afterSummary{step: st.n, prompt: r.rep.PromptTokens})
				}
				if f.firstSummarized == 0 {
					f.firstSummarized = st.n
				}
			}
		}
		if st.action == "dropped" {
			f.drops++
		}
		f.rows = append(f.rows, r)
	}
	f.anchoredN, f.anchoredMAE = len(anchored), mean(anchored)
	f.freshN, f.freshMAE = len(fresh), mean(fresh)
	f.localN, f.localMAE = len(local), mean(local)
	if f.sumPrompt > 0 {
		f.cacheReuse = float64(f.sumCached) / float64(f.sumPrompt)
	}
	f.cacheCeilingFigures(t, ls, cs, tools, final)
	f.lateReference(t, ls, cs, tools, final)

	for _, c := range calls {
		if c.Kind != "summarize" {
			continue
		}
		b, _ := chatForm(c.Path, c.Body)
		s := summarizeFigures{path: c.Path, fields: topLevelFields(c.Body), seq: c.Seq, step: c.Step, status: c.Status, reported: parseReported(c.resp.Bytes()),
			maxTokens: max(b.MaxTokens, b.MaxCompletionTokens), messages: len(b.Messages), bytes: len(c.Body), hasTools: len(b.Tools) > 0,
			dur: c.end.Sub(c.start)}
		if n := len(b.Messages); n > 0 {
			s.lastRoleIsUser = b.Messages[n-1].Role == "user"
		}
		n, err := ls.countBody(c.Path, c.Body)
		if err != nil {
			s.measureErr = err.Error()
		}
		s.measured = n
		if s.measured >= ls.nCtx || (s.measured == 0 && s.reported.NPromptTokens >= ls.nCtx) {
			f.sumOverWindow++
		}
		if c.Status == 400 {
			f.sum400++
		}
		f.sumMaxMeasured = max(f.sumMaxMeasured, s.measured)
		f.promptNSum += max(s.reported.PromptN, 0)
		if s.reported.PromptTokens > 0 {
			sumPromptS += s.reported.PromptTokens
			sumCachedS += max(s.reported.CachedTokens, 0)
		}
		f.sums = append(f.sums, s)

		if n := len(f.summarizeSteps); n == 0 || f.summarizeSteps[n-1] != c.Step {
			f.summarizeSteps = append(f.summarizeSteps, c.Step)
		}
	}
	if sumPromptS > 0 {
		f.sumCacheReuse = float64(sumCachedS) / float64(sumPromptS)
	}
	f.sumSuccess = metrics[`compactproxy_summarize_total{result="success"}`]
	f.sumFail = metrics[`compactproxy_summarize_total{result="failure"}`]
	f.dropMetric = metrics[`compactproxy_compactions_total{action="dropped"}`]

	// What the fixed part costs with this template, and this tokenizer's
	// bytes per token on the tool results.
	base := []message{{Role: "system", Content: systemPrompt}, {Role: "user", Content: firstTask}}
	withTools, _ := json.Marshal(map[string]any{"messages": base, "tools": tools})
	without, _ := json.Marshal(map[string]any{"messages": base})
	a, errA := ls.countTokens(withTools)
	b, errB := ls.countTokens(without)
	if errA != nil || errB != nil {
		t.Errorf("counting the fixed part: %v %v", errA, errB)
	}
	f.toolsTokens, f.baseTokens = a-b, b
	sysOnly, _ := json.Marshal(map[string]any{"messages": base[:1], "tools": tools})
	if n, err := ls.countTokens(sysOnly); err == nil {
		f.fixedTokens = n
	} else {
		t.Errorf("counting the fixed part: %v", err)
	}
	for i := range f.afterSummary {
		a := &f.afterSummary[i]
		a.target = f.target(cs[a.step-1].shape)
	}
	for _, s := range script {
		for _, r := range s.results {
			text, _ := r.Content.(string)
			if parts, ok := r.Content.([]textPart); ok {
				text = parts[0].Text
			}
			n, err := ls.countText(text)
			if err != nil {
				t.Errorf("tokenize: %v", err)
				break
			}
			f.resultBytes += len(text)
			f.resultTokens += n
		}
	}
	return f
}

func mean(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	var s float64
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

func pct(x float64) string {
	if math.IsNaN(x) {
		return "n/a"
	}
	return fmt.Sprintf("%.1f%%", x)
}

func ints(xs []int) string {
	if len(xs) == 0 {
		return "none"
	}
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ",")
}

// render is the table the coordinator quotes.
func (f *figures) render() string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	tmpl := templateName(f.cfg.template)
	window := "discovered (/props)"
	if f.cfg.configured {
		window = fmt.Sprintf("upstream.context_window=%d", f.cfg.ctx)
	}
	settings := "compactproxy's defaults"
	switch {
	case f.cfg.profile == smallWindow:
		settings = "small-window profile " + strings.Join(smallWindowSettings, " ")
	case f.cfg.capped:
		settings = fmt.Sprintf("defaults but summarizer.max_tokens %d (the old harness cap)", summaryTokens(f.cfg.ctx))
	case f.cfg.reserve > 0:
		settings = fmt.Sprintf("defaults but reserve_tokens %d", f.cfg.reserve)
	}
	if f.cfg.real != "" {
		tmpl = "embedded " + f.cfg.real + " (real tokenizer)"
	}
	w("=== %s: llama-server -c %d (n_ctx %d), template %s, window %s; %d steps in %v; %s", f.cfg.name, f.cfg.ctx, f.nCtx, tmpl, window, len(f.rows), f.duration.Round(time.Millisecond), settings)
	w("fixed part: system+task %d tokens, tools array +%d tokens (%d tools); tool results %d bytes / %d tokens = %.2f bytes/token",
		f.baseTokens, f.toolsTokens, len(toolsFor(f.cfg.ctx)), f.resultBytes, f.resultTokens, float64(f.resultBytes)/math.Max(1, float64(f.resultTokens)))
	var acts []string
	for k, v := range f.actions {
		acts = append(acts, fmt.Sprintf("%s=%d", k, v))
	}
	sort.Strings(acts)
	api := "chat completions"
	if f.cfg.dialect != "" {
		api = dialectPath(f.cfg.dialect) + " through the official SDK (sdkclient.mjs)"
	}
	paths := map[string]int{}
	for _, su := range f.sums {
		paths[su.path]++
	}
	var others []string
	for p, n := range f.otherCalls {
		others = append(others, fmt.Sprintf("%s=%d", p, n))
	}
	sort.Strings(others)
	w("client API: %s; upstream model POSTs: %d forwarded (%d overflow retries), %d summarize %v; other POSTs: %s",
		api, f.forwards, f.overflowRetries, f.summarizes, paths, strings.Join(others, " "))
	w("%-50s %-20s %s", "figure", "value", "goal")
	row := func(name, value, goal string, ok bool) {
		mark := "ok"
		if !ok {
			mark = "FAIL"
		}
		w("%-50s %-20s %s  %s", name, value, goal, mark)
	}
	row("non-200 answers (bad streams)", fmt.Sprintf("%d (%d)", f.non200, f.badStreams), "0", f.non200 == 0 && f.badStreams == 0)
	row("actions (X-Compactproxy-Compaction)", strings.Join(acts, " "), "", true)
	row("summaries forwarded; first step / first reuse", fmt.Sprintf("%d; %d / %d", f.summariesApplied, f.firstSummarized, f.firstReusedAfter), "both > 0", f.firstSummarized > 0 && f.firstReusedAfter > 0)
	row("summarize_total success / failure", fmt.Sprintf("%.0f / %.0f", f.sumSuccess, f.sumFail), "", true)
	consec, paced := f.consecutiveSummaries(), f.pacedSummaryLimit()
	row("summarize calls: steps (request path + background)", fmt.Sprintf("%d: %s", len(f.summarizeSteps), ints(f.summarizeSteps)),
		fmt.Sprintf("<= %s; none consecutive at >= 8k", paced), f.summaryCountOK() && (f.cfg.ctx < 8192 || consec == 0))
	under, n := f.afterSummaryUnderTarget()
	row("views right after a new summary <= target (+5%)", fmt.Sprintf("%d of %d", under, n), ">= 90% at >= 8k", f.cfg.ctx < 8192 || n == 0 || under*10 >= n*9)
	row("drops: steps answered dropped / compactions_total", fmt.Sprintf("%d / %.0f", f.drops, f.dropMetric), "0 while failure=0", !(f.sumFail == 0 && (f.drops > 0 || f.dropMetric > 0)))
	row("steps missing latest instruction", ints(f.latestMissing), "none", len(f.latestMissing) == 0)
	row("dropped steps missing the original ask", ints(f.firstMissing), "none", len(f.firstMissing) == 0)
	row("summarize requests: max tokens / over n_ctx", fmt.Sprintf("%d / %d", f.sumMaxMeasured, f.sumOverWindow), fmt.Sprintf("< %d / 0", f.nCtx), f.sumOverWindow == 0)
	row("summarize requests answered 400", fmt.Sprint(f.sum400), "0", f.sum400 == 0)
	row(fmt.Sprintf("anchored estimate mean |err| (n=%d)", f.anchoredN), pct(f.anchoredMAE), "<= 5%", f.anchoredN > 0 && f.anchoredMAE <= 5)
	row(fmt.Sprintf("fresh compacted view mean |err| (n=%d)", f.freshN), pct(f.freshMAE), "<= 10%", f.freshN == 0 || f.freshMAE <= 10)
	row(fmt.Sprintf("local unanchored mean |err| (n=%d)", f.localN), pct(f.localMAE), "(shown)", true)
	row(fmt.Sprintf("cache reuse Σcached/Σprompt, steps 2-40 (n=%d)", f.cacheSteps), fmt.Sprintf("%.3f (%d/%d)", f.cacheReuse, f.sumCached, f.sumPrompt), ">= 0.8", f.cacheReuse >= 0.8)
	row("  ceiling Σ(prompt − appended)/Σprompt", fmt.Sprintf("%.3f (appended %d)", f.cacheCeiling, f.sumAppended), "(shown)", true)
	row("  efficiency Σcached/Σ(prompt − appended)", fmt.Sprintf("%.3f", f.cacheEfficiency), "(shown)", true)
	row("  reference: compact at the budget, to the floor", fmt.Sprintf("%.3f", f.cacheLateReference), "(shown)", true)
	row("summarize calls' own cache reuse", fmt.Sprintf("%.3f", f.sumCacheReuse), "(shown)", true)
	row("evaluated prompt Σtimings.prompt_n fwd+sum", fmt.Sprintf("%d (%d + %d)", f.promptNFwd+f.promptNSum, f.promptNFwd, f.promptNSum), "(shown)", true)
	row("forwarded views failing strict pairing", ints(f.pairingBad), "none", len(f.pairingBad) == 0)
	row("steps whose final message moved", ints(f.finalMoved), "none", len(f.finalMoved) == 0)
	var ms []string
	for k, v := range f.metrics {
		if strings.Contains(k, "compactions_total") || strings.Contains(k, "summarize") || strings.Contains(k, "latch") ||
			strings.Contains(k, "retries") || strings.Contains(k, "invariant") || strings.Contains(k, "unknown_window") ||
			strings.Contains(k, "impossible") || strings.Contains(k, "errors_total") || strings.Contains(k, `route="`) ||
			strings.Contains(k, "reduced_tokens") || strings.Contains(k, "cache_resets") {
			if v != 0 {
				ms = append(ms, fmt.Sprintf("%s %g", strings.TrimPrefix(k, "compactproxy_"), v))
			}
		}
	}
	sort.Strings(ms)
	w("metrics (non-zero): %s", strings.Join(ms, "; "))
	w("step  strm  max_tok  cmsg  fmsg  status  action      src     ctx_tok  fwd_tok  prompt  cached  p_n   c_n   err%%   class     att  sum  ms     up_ms  pr_ms  latest  view (s system, F first ask, L latest instruction, u user, a text, c calls, t tool)")
	for _, r := range f.rows {
		strm := "-"
		if r.shape.stream {
			strm = "s"
			if r.shape.includeUsage {
				strm = "su"
			}
		}
		lat := "ok"
		if !r.latestOK {
			lat = "MISSING"
		}
		extra := ""
		if r.pairingIssue != "" {
			extra += " pairing:" + r.pairingIssue
		}
		if r.attempts > 1 {
			extra += " attempts:" + r.attStatus
		}
		if r.rep.ErrType != "" {
			extra += fmt.Sprintf(" upstream:%s n_prompt=%d n_ctx=%d", r.rep.ErrType, r.rep.NPromptTokens, r.rep.NCtx)
		} else if r.status != 200 {
			extra += " " + strings.ReplaceAll(r.errText[:min(len(r.errText), 160)], "\n", " ")
		}
		errs := "    -"
		if r.class != "" {
			errs = fmt.Sprintf("%+6.1f", r.errPct)
		}
		w("%4d  %-4s  %7d  %4d  %4d  %6d  %-10s  %-6s  %7d  %7d  %6d  %6d  %4d  %4d  %s  %-8s  %3d  %3d  %5d  %5d  %5.0f  %s%s  %s",
			r.n, strm, r.shape.maxTokens, r.clientMsgs, r.fwdMsgs, r.status, r.action, r.source, r.context, r.forwarded,
			r.rep.PromptTokens, r.rep.CachedTokens, r.rep.PromptN, r.rep.CacheN, errs, r.class, r.attempts, r.summarizes, r.dur.Milliseconds(), r.upMS, r.rep.PromptMS, lat, extra, r.view)
	}
	if len(f.sums) > 0 {
		w("summarize calls:  seq  step  status  measured  reported  cached  max_tokens  generated  msgs  bytes  tools  last=user  ms")
		for _, s := range f.sums {
			w("                 %4d  %4d  %6d  %8d  %8d  %6d  %10d  %9d  %4d  %5d  %5v  %9v  %d %s",
				s.seq, s.step, s.status, s.measured, s.reported.PromptTokens, s.reported.CachedTokens, s.maxTokens, s.reported.Completion,
				s.messages, s.bytes, s.hasTools, s.lastRoleIsUser, s.dur.Milliseconds(), s.measureErr)
		}
	}
	return b.String()
}

// assertGoals holds the engine to issue 8's "Done when". The goals the
// engine does not meet yet on this model are reported (a "GOAL NOT MET"
// line) and held to a regression bound instead: the anchored estimate
// (goal 5%, bound 8%) and cache reuse (goal 0.8, bound cacheBound). A
// drop while the summarizer works fails the test. A loop cut short by the
// time budget is reported too: its figures cover the steps that ran.
func (f *figures) assertGoals(t *testing.T) {
	t.Helper()
	notMet := func(format string, args ...any) { t.Logf("GOAL NOT MET: "+format, args...) }
	if len(f.rows) < steps {
		t.Errorf("the loop ran %d of %d steps", len(f.rows), steps)
	}
	// Issue 19: summarize calls only when they make progress.
	if f.cfg.ctx >= 8192 {
		// Large steps (a read is up to a third of the room at 8k) can
		// cross the trigger again right after a summary whose verbatim
		// tail holds two such reads: held to one such pair a run, the
		// goal reported.
		switch c := f.consecutiveSummaries(); {
		case c > 1 || (c > 0 && f.cfg.workload != large):
			t.Errorf("goal: never a summarize call on two consecutive steps at >= 8k; %d times (steps %s)", c, ints(f.summarizeSteps))
		case c > 0:
			notMet("never a summarize call on two consecutive steps at >= 8k; %d times (steps %s)", c, ints(f.summarizeSteps))
		}
		if under, n := f.afterSummaryUnderTarget(); n > 0 && under*10 < n*9 {
			t.Errorf("goal: the view right after a new summary at or under the target in >= 90%% of compactions; %d of %d", under, n)
		}
	}
	if !f.summaryCountOK() {
		if f.cfg.workload == large && len(f.summarizeSteps) <= largeSummaryBound {
			notMet("at most %s summarize calls in 40 steps; %d (steps %s)", f.pacedSummaryLimit(), len(f.summarizeSteps), ints(f.summarizeSteps))
		} else {
			t.Errorf("goal: at most %s summarize calls in 40 steps; %d (steps %s)", f.pacedSummaryLimit(), len(f.summarizeSteps), ints(f.summarizeSteps))
		}
	}
	if f.non200 > 0 {
		t.Errorf("goal: 0 non-200 answers; got %d", f.non200)
	}
	if f.badStreams > 0 {
		t.Errorf("goal: every stream ends with [DONE] and no error event; %d did not", f.badStreams)
	}
	if f.firstSummarized == 0 {
		t.Errorf("goal: at least one summary made and forwarded; none in %d steps (actions %v)", len(f.rows), f.actions)
	} else if f.firstReusedAfter == 0 {
		t.Errorf("goal: the summary first forwarded at step %d is forwarded again later; it never was", f.firstSummarized)
	}
	if f.sumFail == 0 && (f.drops > 0 || f.dropMetric > 0) {
		t.Errorf("goal: no drop while the summarizer works; summarize_total{failure}=0 but %d steps answered dropped, compactions_total{dropped}=%.0f", f.drops, f.dropMetric)
	}
	if len(f.latestMissing) > 0 {
		t.Errorf("goal: every forwarded view holds the latest user instruction verbatim; missing at steps %s", ints(f.latestMissing))
	}
	if len(f.firstMissing) > 0 {
		t.Errorf("goal: a drop never removes the original ask; missing at steps %s", ints(f.firstMissing))
	}
	if f.sumOverWindow > 0 || f.sum400 > 0 {
		t.Errorf("goal: every summarize request fits the model's window (n_ctx %d); %d over it (largest %d tokens), %d answered 400",
			f.nCtx, f.sumOverWindow, f.sumMaxMeasured, f.sum400)
	}
	if f.anchoredN == 0 {
		t.Errorf("goal: anchored estimates within 5%%; no step had an anchored estimate without a new compaction")
	} else if f.anchoredMAE > 8 && f.anchoredN >= minAnchoredForBound {
		t.Errorf("anchored estimates mean |error| %.1f%% over %d steps, over the 8%% regression bound (goal 5%%)", f.anchoredMAE, f.anchoredN)
	} else if f.anchoredMAE > 5 && f.anchoredN < minAnchoredForBound {
		notMet("anchored estimates within 5%% of the reported prompt_tokens; mean |error| %.1f%% over only %d steps (under %d: no regression bound; the rest forwarded compacted views, see the fresh figure)",
			f.anchoredMAE, f.anchoredN, minAnchoredForBound)
	} else if f.anchoredMAE > 5 {
		notMet("anchored estimates within 5%% of the reported prompt_tokens; mean |error| %.1f%% over %d steps", f.anchoredMAE, f.anchoredN)
	}
	if f.freshN > 0 && f.freshMAE > 10 {
		t.Errorf("goal: freshly compacted views within 10%% of the reported prompt_tokens; mean |error| %.1f%% over %d steps", f.freshMAE, f.freshN)
	}
	if bound, why := f.cacheBound(); f.cacheReuse < bound {
		t.Errorf("cache reuse Σcached ÷ Σprompt after step 1 %.3f (%d/%d), under the %.2f regression bound (%s; goal 0.8)", f.cacheReuse, f.sumCached, f.sumPrompt, bound, why)
	} else if f.cacheReuse < 0.8 {
		notMet("cache reuse Σcached ÷ Σprompt after step 1 >= 0.8; got %.3f (%d/%d)", f.cacheReuse, f.sumCached, f.sumPrompt)
	}
	if len(f.pairingBad) > 0 {
		t.Errorf("every forwarded view passes the strict pairing check; failed at steps %s", ints(f.pairingBad))
	}
	if len(f.finalMoved) > 0 {
		t.Errorf("the client's final message stays final in the forwarded view; not at steps %s", ints(f.finalMoved))
	}
	f.assertSummaryLength(t)
}

// assertSummaryLength: neither real-tokenizer model ever stops early, so
// a summarize call answered 200 generates the tokens it asked for unless
// the window ends first; fewer means a field of the client's that caps
// generation (llama-server's n_predict wins over max_tokens and
// max_output_tokens) reached the summarize request. Held for the
// Responses and Messages loops (issue 21), whose clients send their own
// n_predict as the chat loop's does.
func (f *figures) assertSummaryLength(t *testing.T) {
	t.Helper()
	if f.cfg.dialect == "" || f.cfg.real == "" {
		return
	}
	for _, s := range f.sums {
		if s.status != 200 || s.reported.Completion <= 0 || s.reported.Completion >= s.maxTokens {
			continue
		}
		if s.measured > 0 && s.measured+s.reported.Completion >= f.nCtx {
			continue
		}
		t.Errorf("summarize call %d (step %d, %s) generated %d of the %d tokens it asked for: a client field that caps generation reached it; its fields: %s",
			s.seq, s.step, s.path, s.reported.Completion, s.maxTokens, s.fields)
	}
}

// topLevelFields is a request body's top-level fields, the history
// (messages, input) shortened to its length and the rest cut at 80 bytes.
func topLevelFields(body []byte) string {
	var m map[string]json.RawMessage
	if json.Unmarshal(body, &m) != nil {
		return "(unparsable)"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		v := string(m[k])
		switch {
		case k == "messages" || k == "input" || k == "tools":
			v = fmt.Sprintf("(%d bytes)", len(v))
		case len(v) > 80:
			v = v[:80] + "..."
		}
		fmt.Fprintf(&b, "%s=%s ", k, v)
	}
	return strings.TrimSpace(b.String())
}

// largeSummaryBound is the regression bound on summarize calls of a
// large-step run (the goal is 12; measured 11 at 8k since 0779011, 12–13
// before; the bound leaves room for timing under -race).
const largeSummaryBound = 14

// consecutiveSummaries counts the summarize calls made on the step right
// after another's.
func (f *figures) consecutiveSummaries() int {
	n := 0
	for i := 1; i < len(f.summarizeSteps); i++ {
		if f.summarizeSteps[i] == f.summarizeSteps[i-1]+1 {
			n++
		}
	}
	return n
}

// pacedSummaryLimit is the issue's bound on summarize calls for this
// configuration: 3 in 40 steps for the paced workload at 16k–32k; the
// large-step workloads keep to the progress guard's rate (about one per
// quarter of the room folded, measured at 8k and 16k: at most 12);
// elsewhere the rate is reported.
func (f *figures) pacedSummaryLimit() string {
	switch {
	case f.cfg.real != "" && f.cfg.workload == paced && f.cfg.ctx >= 16384:
		return "3"
	case f.cfg.real != "" && f.cfg.workload == large:
		return "12"
	}
	return "(shown)"
}

func (f *figures) summaryCountOK() bool {
	n, err := strconv.Atoi(f.pacedSummaryLimit())
	return err != nil || len(f.summarizeSteps) <= n
}

// afterSummaryUnderTarget counts the first views carrying a new summary
// whose reported size is at or under the step's target (with 5% for the
// estimate the proxy aims by).
func (f *figures) afterSummaryUnderTarget() (under, n int) {
	for _, a := range f.afterSummary {
		n++
		if float64(a.prompt) <= 1.05*float64(a.target) {
			under++
		}
	}
	return under, n
}

// cacheBound is the cache figure's regression bound per workload, under
// the figures measured (docs/performance.md): paced 0.64–0.82, stress 0.49–0.63, large
// (real tokenizer, 8k) 0.59–0.62.
var cacheBound = map[string]float64{paced: 0.55, stress: 0.3, large: 0.5}

// smallWindowCacheBound holds the small-window profile near the goal
// (measured 0.81–0.85) where the room lets it get there: where the fixed
// part (system prompt, task, tools) is at most half the budget. Where it is
// more (Qwen2.5 at 2k: 893 of 1,536 tokens), the two-turn floor, the
// summary and the instruction leave less than a step of room, every step
// compacts and evaluates them again, and the workload's bound applies.
const smallWindowCacheBound = 0.78

// budget is compactproxy's budget at this window for every step of the
// loop: reserve_tokens (4096 by default) and any max_tokens are capped at
// a quarter of the window.
func (c llamaConfig) budget() int { return c.ctx - c.ctx/4 }

// cacheBound is this run's bound and what it is.
func (f *figures) cacheBound() (float64, string) {
	budget := f.cfg.budget()
	if f.cfg.profile == smallWindow && 2*(f.baseTokens+f.toolsTokens) <= budget {
		return smallWindowCacheBound, fmt.Sprintf("small-window profile, fixed part %d of a %d-token budget", f.baseTokens+f.toolsTokens, budget)
	}
	return cacheBound[f.cfg.workload], fmt.Sprintf("the %q workload", f.cfg.workload)
}

// minAnchoredForBound is how many anchored steps the 8% regression bound
// needs: below it the cold-start step 2 (one anchor, no calibration yet)
// alone decides the mean.
const minAnchoredForBound = 5

// cacheCeilingFigures measures N_i, the tokens the client appended at each
// step after the first (its view counted by llama-server minus its
// previous view), and from it the cache figure's ceiling and efficiency.
func (f *figures) cacheCeilingFigures(t *testing.T, ls *llamaServer, cs []clientStep, tools []json.RawMessage, final []message) {
	t.Helper()
	count := func(k int) (int, bool) {
		n, err := ls.countClientView(f.cfg, final[:k], tools)
		if err != nil {
			t.Logf("cache ceiling: counting the client's view of %d messages: %v", k, err)
			return 0, false
		}
		return n, true
	}
	prev := -1
	prompts, reusable := 0, 0
	for i, st := range cs {
		cur, ok := count(st.clientMsgs)
		if !ok {
			return
		}
		if i > 0 && prev >= 0 && i < len(f.rows) && f.rows[i].rep.PromptTokens > 0 {
			p := f.rows[i].rep.PromptTokens
			appended := min(max(cur-prev, 0), p)
			f.sumAppended += appended
			prompts += p
			reusable += p - appended
		}
		prev = cur
	}
	if prompts > 0 {
		f.cacheCeiling = float64(reusable) / float64(prompts)
	}
	if reusable > 0 {
		f.cacheEfficiency = float64(f.sumCached) / float64(reusable)
	}
}
