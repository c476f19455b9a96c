package compaction

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/chat"
)

var update = flag.Bool("update", false, "rewrite testdata/*.txt with the planner's output")

// TestScripts runs the decision scripts in testdata/*.txt (in the style of
// etcd raft's data-driven tests): each block is a command, "----", and the
// planner's answer. The scripts drive Plan as the proxy does — one stored
// state per lineage (SelectLineage, SaveLineage), the clock passed in, a
// summary obtained only when a decision asks for one — with no HTTP and no
// summarizer behind it: `answer` says what the summarizer would have said.
// Run with -update to rewrite the expected blocks.
//
// Commands:
//
//	config k=v...         a new conversation and planner: window, keep_tail,
//	                      latch_growth, min_interval, summary_tokens,
//	                      summary_min_tokens, tail_ratio, trigger, target,
//	                      reserve, trim_tokens, summarizer=off, shadow=on,
//	                      dedupe=on, mask=on (step 0),
//	                      corrupt=orphan (every produced view loses its
//	                      first tool call: the invariant's test)
//	system TEXT|N         the leading system message, or N bytes of one (set
//	                      before or between steps)
//	task TEXT|N           the first user message (or N bytes of one)
//	step N [N...]         an agent step: an assistant call and its tool result of
//	                      N bytes (several sizes: parallel calls in one message)
//	steps K N             K agent steps of N bytes each
//	read PATH N [TAG]     an agent step reading PATH (read_file {"path":PATH})
//	                      with a result of N bytes made from TAG (default PATH:
//	                      the same TAG, the same text)
//	exec CMD N [TAG]      an agent step running CMD (exec_command {"cmd":CMD});
//	                      its result opens with Codex's envelope (a chunk id and
//	                      a wall time that differ per run), then N bytes of TAG
//	edit PATH             an agent step editing PATH (edit_file), result "ok"
//	reduced               the last decision's tokens removed per step and
//	                      where it changed the forwarded prefix
//	user TEXT             a user message
//	reply TEXT            an assistant message without calls
//	plan [recover [measured=N]|background]  decide for the conversation as it is now
//	answer ok [N]|empty|fail|canceled  the summarizer's answer (N bytes) to the
//	                      last plan's need
//	view                  the last decision's forwarded view, one message a line
//	clock +DURATION       move the clock
//	save NAME / load NAME keep the conversation's messages / go back to them
//	                      (another history of the same conversation)
//	state                 the selected lineage's stored state
func TestScripts(t *testing.T) {
	files, err := filepath.Glob("testdata/*.txt")
	if err != nil || len(files) == 0 {
		t.Fatalf("no scripts: %v", err)
	}
	for _, f := range files {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".txt"), func(t *testing.T) {
			runScript(t, f)
		})
	}
}

// scriptSession is one script's conversation, state and clock.
type scriptSession struct {
	t        *testing.T
	p        *Planner
	window   int
	system   string
	msgs     []msg
	calls    int
	lineages []Lineage
	now      time.Time
	saved    map[string][]msg
	// last is the last plan's input and output (answer uses them).
	lastIn  Input
	lastOut Output
	lastLi  int
}

func runScript(t *testing.T, file string) {
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	s := &scriptSession{t: t}
	s.configure(nil)
	blocks := strings.Split(string(data), "\n\n")
	for _, b := range blocks {
		b = strings.Trim(b, "\n")
		if b == "" {
			continue
		}
		cmd, want, _ := strings.Cut(b, "\n----\n")
		cmd = strings.TrimSuffix(cmd, "\n----")
		var comments, lines []string
		for _, l := range strings.Split(cmd, "\n") {
			if strings.HasPrefix(l, "#") {
				comments = append(comments, l)
			} else if l != "" {
				lines = append(lines, l)
			}
		}
		got := ""
		for _, l := range lines {
			got += s.run(l)
		}
		for _, c := range comments {
			out.WriteString(c + "\n")
		}
		out.WriteString(strings.Join(lines, "\n"))
		if len(lines) > 0 {
			out.WriteString("\n----\n" + got)
		}
		out.WriteString("\n")
		if len(lines) > 0 && !*update && strings.TrimRight(got, "\n") != strings.TrimRight(want, "\n") {
			t.Errorf("%s: %s\ngot:\n%s\nwant:\n%s", file, strings.Join(lines, "; "), got, want)
		}
	}
	if *update {
		if err := os.WriteFile(file, []byte(strings.TrimRight(out.String(), "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func (s *scriptSession) configure(args []string) {
	cfg := Config{
		KeepTail: 3, LatchGrowth: 20, MinInterval: time.Minute, SummarizerEnabled: true,
		SummaryTokens: 1024, SummaryMinTokens: 256, TailRatio: 0.3,
	}
	s.window = 8000
	corrupt := false
	for _, a := range args {
		k, v, _ := strings.Cut(a, "=")
		n, _ := strconv.Atoi(v)
		f, _ := strconv.ParseFloat(v, 64)
		switch k {
		case "window":
			s.window = n
		case "keep_tail":
			cfg.KeepTail = n
		case "latch_growth":
			cfg.LatchGrowth = n
		case "min_interval":
			d, err := time.ParseDuration(v)
			if err != nil {
				s.t.Fatalf("min_interval %q: %v", v, err)
			}
			cfg.MinInterval = d
		case "summary_tokens":
			cfg.SummaryTokens = n
		case "summary_min_tokens":
			cfg.SummaryMinTokens = n
		case "tail_ratio":
			cfg.TailRatio = f
		case "trigger":
			cfg.TriggerRatio = f
		case "target":
			cfg.TargetRatio = f
		case "reserve":
			cfg.ReserveTokens = n
		case "trim_tokens":
			cfg.TrimToolResultTokens = n
		case "summarizer":
			cfg.SummarizerEnabled = v != "off"
		case "shadow":
			cfg.Shadow = v == "on"
		case "dedupe":
			cfg.Dedupe = v == "on"
		case "mask":
			cfg.Mask = v == "on"
		case "corrupt":
			corrupt = v == "orphan"
		default:
			s.t.Fatalf("config: unknown key %q", k)
		}
	}
	s.p = NewPlanner(cfg)
	if corrupt {
		s.p.corrupt = dropFirstCall
	}
	s.system, s.msgs, s.calls, s.lineages = "You are a coding agent.", nil, 0, nil
	s.now = time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
}

// view is the conversation as the client sends it now.
func (s *scriptSession) view() []chat.Message {
	all := append([]msg{sysMsg(s.system)}, s.msgs...)
	return parse(s.t, all)
}

func (s *scriptSession) run(line string) string {
	f := strings.Fields(line)
	rest := strings.TrimSpace(strings.TrimPrefix(line, f[0]))
	switch f[0] {
	case "config":
		s.configure(f[1:])
		return "ok\n"
	case "system":
		s.system = sizedText(f[0], rest)
		return "ok\n"
	case "task", "user":
		s.msgs = append(s.msgs, userMsg(sizedText(f[0], rest)))
		return fmt.Sprintf("%d messages\n", len(s.msgs)+1)
	case "reply":
		s.msgs = append(s.msgs, asstMsg(rest))
		return fmt.Sprintf("%d messages\n", len(s.msgs)+1)
	case "step":
		var calls []string
		var results []msg
		for _, a := range f[1:] {
			n, _ := strconv.Atoi(a)
			id := fmt.Sprintf("call_%d", s.calls)
			calls = append(calls, fmt.Sprintf(`%s:read:{"path":"f%d.go"}`, id, s.calls))
			results = append(results, toolMsg(id, blob(fmt.Sprintf("f%d", s.calls), n)))
			s.calls++
		}
		s.msgs = append(append(s.msgs, callMsg("", calls...)), results...)
		return fmt.Sprintf("%d messages\n", len(s.msgs)+1)
	case "read", "exec", "edit":
		id := fmt.Sprintf("call_%d", s.calls)
		s.calls++
		var c, result string
		switch f[0] {
		case "read":
			n, _ := strconv.Atoi(f[2])
			tag := f[1]
			if len(f) > 3 {
				tag = f[3]
			}
			c, result = fmt.Sprintf(`%s:read_file:{"path":%q}`, id, f[1]), blob(tag, n)
		case "exec":
			n, _ := strconv.Atoi(f[2])
			tag := f[1]
			if len(f) > 3 {
				tag = f[3]
			}
			c = fmt.Sprintf(`%s:exec_command:{"cmd":%q}`, id, f[1])
			result = fmt.Sprintf("Chunk ID: %06x\nWall time: 0.%04d seconds\nProcess exited with code 0\nOutput:\n%s", s.calls*7919, s.calls*37, blob(tag, n))
		case "edit":
			c, result = fmt.Sprintf(`%s:edit_file:{"path":%q,"old_string":"a","new_string":"b"}`, id, f[1]), "ok"
		}
		s.msgs = append(s.msgs, callMsg("", c), toolMsg(id, result))
		return fmt.Sprintf("%d messages\n", len(s.msgs)+1)
	case "reduced":
		r := s.lastOut.Reduced
		return fmt.Sprintf("dedupe=%d mask=%d trim=%d summarize=%d drop=%d reset_at=%d cache_reset=%v reset_tokens=%d\n",
			r.Dedupe, r.Mask, r.Trim, r.Summarize, r.Drop, s.lastOut.ResetAt, s.lastOut.CacheReset, s.lastOut.ResetTokens)
	case "steps":
		k, _ := strconv.Atoi(f[1])
		for range k {
			s.run("step " + f[2])
		}
		return fmt.Sprintf("%d messages\n", len(s.msgs)+1)
	case "view":
		return showView(s.lastOut.Messages)
	case "save":
		if s.saved == nil {
			s.saved = map[string][]msg{}
		}
		s.saved[f[1]] = append([]msg(nil), s.msgs...)
		return "ok\n"
	case "load":
		s.msgs = append([]msg(nil), s.saved[f[1]]...)
		return fmt.Sprintf("%d messages\n", len(s.msgs)+1)
	case "clock":
		d, err := time.ParseDuration(strings.TrimPrefix(f[1], "+"))
		if err != nil {
			s.t.Fatalf("clock %q: %v", f[1], err)
		}
		s.now = s.now.Add(d)
		return "ok\n"
	case "plan":
		pass, measured := PassForward, 0
		if len(f) > 1 {
			pass = map[string]Pass{"recover": PassRecover, "background": PassBackground}[f[1]]
		}
		if len(f) > 2 {
			measured, _ = strconv.Atoi(strings.TrimPrefix(f[2], "measured="))
		}
		return s.plan(pass, measured)
	case "answer":
		return s.answer(f[1:])
	case "state":
		return s.state()
	}
	s.t.Fatalf("unknown command %q", f[0])
	return ""
}

func (s *scriptSession) plan(pass Pass, measured int) string {
	view := s.view()
	chain := RecordChain(testSeed, digestsOf(s.t, view), LeadingSystem(view))
	li := SelectLineage(s.lineages, chain)
	var st State
	if li >= 0 {
		st = s.lineages[li].State
	}
	in := Input{Messages: view, Chain: chain, State: st, Window: s.window, Estimate: fakeEstimate, Now: s.now, Pass: pass, Measured: measured}
	out := s.p.Plan(in)
	s.lastIn, s.lastOut, s.lastLi = in, out, li
	if out.Need == nil {
		s.save(li, chain, out)
	} else if n := out.Need; measured == 0 && (len(n.Head) > len(n.Prefix) ||
		n.HeadTokens != fakeEstimate(n.Prefix).Tokens-fakeEstimate(n.Prefix[:len(n.Prefix)-len(n.Head)]).Tokens) {
		// The head's cost is what it adds to the prefix it ends (scaled
		// by a measurement when there is one).
		s.t.Errorf("need: head of %d messages counted %d in a %d-message prefix of %d", len(n.Head), n.HeadTokens, len(n.Prefix), n.PrefixTokens)
	}
	return describe(out, li)
}

func (s *scriptSession) answer(args []string) string {
	need := s.lastOut.Need
	if need == nil {
		return "error: the last plan asked for no summary\n"
	}
	var res *SummaryResult
	switch args[0] {
	case "ok":
		n := 200
		if len(args) > 1 {
			n, _ = strconv.Atoi(args[1])
		}
		res = ResultFor(need, blob("summary", n), 0, nil, false)
	case "empty":
		res = ResultFor(need, "  ", 0, nil, false)
	case "fail":
		res = ResultFor(need, "", 0, errRejected, false)
	case "canceled":
		res = ResultFor(need, "", 0, errRejected, true)
	default:
		s.t.Fatalf("answer %q", args[0])
	}
	in := s.lastIn
	in.Summary = res
	out := s.p.Plan(in)
	s.lastOut = out
	s.save(s.lastLi, in.Chain, out)
	return describe(out, s.lastLi)
}

func (s *scriptSession) save(li int, chain []anchor.Digest, out Output) {
	if !out.StateChanged {
		return
	}
	n := len(chain) - 1
	l := Lineage{ID: LineageID(chain), TipLen: n, Tip: chain[n], Used: s.now.Unix(), State: out.State}
	var base uint32
	if li >= 0 {
		l.ID, base = s.lineages[li].ID, s.lineages[li].Gen
	}
	s.lineages, _ = SaveLineage(s.lineages, l, base, true)
}

func (s *scriptSession) state() string {
	view := s.view()
	chain := RecordChain(testSeed, digestsOf(s.t, view), LeadingSystem(view))
	li := SelectLineage(s.lineages, chain)
	if li < 0 {
		return fmt.Sprintf("lineages=%d selected=none\n", len(s.lineages))
	}
	st := s.lineages[li].State
	var b strings.Builder
	fmt.Fprintf(&b, "lineages=%d selected=%d", len(s.lineages), li)
	if st.Summary != nil {
		fmt.Fprintf(&b, " summary=cut:%d", st.Summary.Cut)
	}
	if st.Pending != nil {
		fmt.Fprintf(&b, " pending=cut:%d", st.Pending.Cut)
	}
	var trims, masks, pointers int
	for _, t := range st.Trims {
		switch {
		case t.Keep > 0:
			trims++
		case t.Keep == keepMask:
			masks++
		default:
			pointers++
		}
	}
	if trims > 0 {
		fmt.Fprintf(&b, " trims=%d", trims)
	}
	if masks > 0 {
		fmt.Fprintf(&b, " masks=%d", masks)
	}
	if pointers > 0 {
		fmt.Fprintf(&b, " pointers=%d", pointers)
	}
	if len(st.Drops) > 0 {
		fmt.Fprintf(&b, " drops=%d", len(st.Drops))
	}
	if st.Latched {
		fmt.Fprintf(&b, " latched_at=%d", st.LatchCount)
	}
	if !st.LastAttempt.IsZero() {
		fmt.Fprintf(&b, " last_attempt=%s@%d", st.LastAttempt.Format("15:04:05"), st.LastAttemptCount)
	}
	return b.String() + "\n"
}

// describe prints a decision on one line.
func describe(out Output, li int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "action=%s context=%d forwarded=%d budget=%d trigger=%d target=%d", out.Action,
		out.Context.Tokens, out.Forwarded, out.Budget, out.Trigger, out.Target)
	if n := out.Need; n != nil {
		fmt.Fprintf(&b, " need=cut:%d,max:%d,head:%d", n.Cut, n.MaxTokens, len(n.Head))
		if len(n.Kept) > 0 {
			fmt.Fprintf(&b, ",kept:%d", len(n.Kept))
		}
	}
	ev := out.Events
	if ev.SummarizeCalled {
		fmt.Fprintf(&b, " summarized=%v", ev.SummarizeOK)
	}
	if ev.Suppressed != "" {
		fmt.Fprintf(&b, " suppressed=%s", ev.Suppressed)
	}
	switch err := ev.SummaryError; {
	case err == nil:
	case errors.Is(err, ErrEmptySummary):
		b.WriteString(" error=empty")
	case errors.Is(err, ErrSummaryNotSmaller):
		b.WriteString(" error=not_smaller")
	default:
		b.WriteString(" error=summarizer")
	}
	if ev.LatchEngaged {
		b.WriteString(" latch=engaged")
	}
	if len(ev.NewActions) > 0 {
		acts := make([]string, len(ev.NewActions))
		for i, a := range ev.NewActions {
			acts[i] = string(a)
		}
		fmt.Fprintf(&b, " new=%s", strings.Join(acts, ","))
	}
	if ev.InvariantFailure {
		b.WriteString(" invariant=failed")
	}
	if ev.Impossible {
		b.WriteString(" impossible")
	}
	if li < 0 {
		b.WriteString(" lineage=new")
	}
	return b.String() + "\n"
}

// sizedText is text, or a blob of that many bytes when text is a number.
func sizedText(tag, text string) string {
	if n, err := strconv.Atoi(text); err == nil {
		return blob(tag, n)
	}
	return text
}

// showView prints a forwarded view, one message a line: its position, role
// and what it holds (a text's first words or its size, the calls it makes,
// an excerpt's size, the summary block's parts).
func showView(view []chat.Message) string {
	var b strings.Builder
	for i := range view {
		m := &view[i]
		text := chat.Text(*m)
		fmt.Fprintf(&b, "%2d %-9s ", i, m.Role)
		switch {
		case strings.HasPrefix(text, summaryLabel):
			fmt.Fprintf(&b, "[summary, %d bytes]", len(text)-len(summaryLabel))
		case len(m.ToolCalls) > 0:
			ids := make([]string, len(m.ToolCalls))
			for k, c := range m.ToolCalls {
				ids[k] = c.ID
			}
			fmt.Fprintf(&b, "calls %s", strings.Join(ids, ","))
		case m.Role == "tool" && strings.HasPrefix(text, "[compactproxy: "):
			fmt.Fprintf(&b, "%s: %s", m.ToolCallID, text)
		case m.Role == "tool" && strings.Contains(text, " characters elided by compactproxy ...]"):
			fmt.Fprintf(&b, "%s: excerpt, %d bytes", m.ToolCallID, len(text))
		case m.Role == "tool":
			fmt.Fprintf(&b, "%s: %d bytes", m.ToolCallID, len(text))
		case len(text) > 48:
			fmt.Fprintf(&b, "%d bytes", len(text))
		default:
			b.WriteString(text)
		}
		b.WriteString("\n")
	}
	return b.String()
}

// dropFirstCall removes the view's first assistant message with calls,
// leaving its results unanswered (corrupt=orphan).
func dropFirstCall(view []chat.Message) []chat.Message {
	for i := range view {
		if len(view[i].ToolCalls) > 0 {
			return append(view[:i:i], view[i+1:]...)
		}
	}
	return view
}

func digestsOf(tb testing.TB, msgs []chat.Message) []anchor.Digest {
	tb.Helper()
	ds := make([]anchor.Digest, len(msgs))
	for i := range msgs {
		d, err := anchor.MessageHash(msgs[i].Raw)
		if err != nil {
			tb.Fatal(err)
		}
		ds[i] = d
	}
	return ds
}
