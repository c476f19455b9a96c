package compaction

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"strings"

	"github.com/compactproxy/compactproxy/internal/chat"
)

// Step 0 of the ladder, the reductions that need no model call (DESIGN
// § Compaction, "Steps over the trigger"): dedupe, a tool result that a
// later one repeats becomes a pointer to it; mask, an old tool result
// becomes a placeholder naming its call. Both keep the message's shape
// and its tool_call_id, and are stored as Trim records (Keep ≤ 0) so they
// are re-applied byte-for-byte.

// Keep values of the Trim records that are not excerpts.
const (
	// keepMask: the result is a placeholder naming its call.
	keepMask = 0
	// Keep < 0: a pointer to the later result at Index − Keep (dedupe).
)

// maxArgsShown bounds the call's arguments quoted in a placeholder (a
// write tool's arguments hold a whole file).
const maxArgsShown = 160

// call is what a tool result answers: the tool's name and its arguments as
// the assistant sent them (the JSON text of function.arguments; the
// Responses and Messages APIs' calls reach the planner in this chat shape
// too), with the file path they name, if any.
type call struct {
	known bool
	name  string
	args  string
	path  string
	edit  bool // the tool writes the path (edit, write, patch...)
}

// pathKeys are the argument keys agents' file tools name a path with.
var pathKeys = []string{"path", "file_path", "filePath", "absolute_path", "filename"}

// calls returns, per client position, the call a tool message answers
// (zero for other messages), decoded once per run from the assistant
// messages' tool_calls.
func (r *run) calls() []call {
	if r.callOf != nil {
		return r.callOf
	}
	r.callOf = make([]call, r.n)
	for i := range r.msgs {
		if len(r.msgs[i].ToolCalls) > 0 {
			r.answers(i, func(j int, c call) { r.callOf[j] = c })
		}
	}
	return r.callOf
}

// callAt is the call the tool message at i answers: from calls() when
// computed, else from its own assistant message alone (re-applying a
// record decodes only the turns it names).
func (r *run) callAt(i int) call {
	if r.callOf != nil || i < 0 || i >= r.n {
		if i < 0 || i >= r.n {
			return call{}
		}
		return r.calls()[i]
	}
	if c, ok := r.callCache[i]; ok {
		return c
	}
	a := i
	for a > 0 && isToolRole(r.msgs[a].Role) {
		a--
	}
	if r.callCache == nil {
		r.callCache = map[int]call{}
	}
	for j := a + 1; j < r.n && isToolRole(r.msgs[j].Role); j++ {
		r.callCache[j] = call{}
	}
	r.callCache[i] = call{}
	r.answers(a, func(j int, c call) { r.callCache[j] = c })
	return r.callCache[i]
}

// answers decodes the calls of the assistant message at a and hands each
// to set with the position of the tool message that answers it.
func (r *run) answers(a int, set func(int, call)) {
	m := &r.msgs[a]
	if len(m.ToolCalls) == 0 {
		return
	}
	var raw struct {
		ToolCalls []struct {
			ID       string `json:"id"`
			Function struct {
				Name      string          `json:"name"`
				Arguments json.RawMessage `json:"arguments"`
			} `json:"function"`
		} `json:"tool_calls"`
	}
	if json.Unmarshal(m.Raw, &raw) != nil {
		return
	}
	byID := make(map[string]call, len(raw.ToolCalls))
	for _, c := range raw.ToolCalls {
		byID[c.ID] = newCall(c.Function.Name, c.Function.Arguments)
	}
	for j := a + 1; j < r.n && isToolRole(r.msgs[j].Role); j++ {
		if t := &r.msgs[j]; t.HasToolCallID {
			if c, ok := byID[t.ToolCallID]; ok {
				set(j, c)
			}
		}
	}
}

// newCall decodes a call's arguments: a JSON string holding JSON (chat),
// or an object.
func newCall(name string, rawArgs json.RawMessage) call {
	c := call{known: true, name: name}
	rawArgs = bytes.TrimSpace(rawArgs)
	if len(rawArgs) > 0 && rawArgs[0] == '"' {
		_ = json.Unmarshal(rawArgs, &c.args)
	} else {
		c.args = string(rawArgs)
	}
	var obj map[string]json.RawMessage
	if json.Unmarshal([]byte(c.args), &obj) == nil {
		for _, k := range pathKeys {
			if v, ok := obj[k]; ok && len(v) > 0 && v[0] == '"' {
				_ = json.Unmarshal(v, &c.path)
				break
			}
		}
		// A tool that both views and edits (command: view | str_replace
		// | create ...) reads only when it says view.
		var cmd string
		if v, ok := obj["command"]; ok {
			_ = json.Unmarshal(v, &cmd)
		}
		c.edit = isEditTool(name) && cmd != "view"
	} else {
		c.edit = isEditTool(name)
	}
	return c
}

// isEditTool tells by its name whether a tool writes the path it names.
func isEditTool(name string) bool {
	n := strings.ToLower(name)
	for _, w := range []string{"edit", "write", "patch", "replace", "create", "apply", "insert"} {
		if strings.Contains(n, w) {
			return true
		}
	}
	return false
}

// shown is the call as a placeholder names it: the tool and its
// arguments, shortened.
func (c call) shown() string {
	args := strings.Join(strings.Fields(c.args), " ")
	if len(args) > maxArgsShown {
		cut := maxArgsShown
		for cut > 0 && (args[cut]&0xC0) == 0x80 {
			cut--
		}
		args = args[:cut] + "…"
	}
	if args == "" {
		return c.name
	}
	return c.name + " " + args
}

// envelopePrefixes open the lines a tool adds around its output that
// differ between two identical runs (Codex's exec output: its chunk id
// and wall time).
var envelopePrefixes = []string{"Chunk ID:", "Wall time:"}

// bodyDigest is the digest of a tool result's text without its leading
// envelope lines: two results with the same digest say the same thing.
func bodyDigest(m *chat.Message) [32]byte {
	text := chat.Text(*m)
	for {
		line, rest, ok := strings.Cut(text, "\n")
		if !ok || !hasEnvelopePrefix(line) {
			if !ok && hasEnvelopePrefix(line) {
				text = ""
			}
			break
		}
		text = rest
	}
	return sha256.Sum256([]byte(text))
}

func hasEnvelopePrefix(line string) bool {
	for _, p := range envelopePrefixes {
		if strings.HasPrefix(line, p) {
			return true
		}
	}
	return false
}

// reductions is what step 0 knows of a view: for each tool result, the
// later one that repeats it (dedupe's pointer) and whether it belongs to
// the working set.
type reductions struct {
	// later[i] is the position of the latest later tool result that
	// repeats the one at i (same text without the envelope, or a later read
	// of the same file by the same tool), −1 when none.
	later []int
	// working marks the latest read of a file the agent re-read or
	// edited, the latest output of a command it re-ran, and the latest of
	// identical results: never masked, trimmed or deduped.
	working []bool
}

// group counts the results of one kind (the same text, file or command)
// and where the latest is.
type group struct{ last, count int }

// reductions computes (once per run) the duplicates and the working set.
// Linear in the view (one digest per tool result, maps by key).
func (r *run) reductions() *reductions {
	if r.red != nil {
		return r.red
	}
	t := r.tallied()
	red := &reductions{later: make([]int, r.n), working: make([]bool, r.n)}
	for i := range red.later {
		red.later[i] = -1
	}
	// First the pointers (the latest repeat wins), then the working set:
	// the latest of what was repeated, when nothing later supersedes it.
	for i := r.lead; i < r.n; i++ {
		m := &r.msgs[i]
		if m.Role != "tool" {
			continue
		}
		if g := t.byBody[t.bodies[i]]; trimmable(m) && g.count > 1 && g.last != i {
			red.later[i] = g.last
		}
		if c := t.calls[i]; c.known && !c.edit && c.path != "" {
			if g := t.byRead[[2]string{c.name, c.path}]; g.last != i {
				red.later[i] = max(red.later[i], g.last)
			}
		}
	}
	for i := r.lead; i < r.n; i++ {
		m := &r.msgs[i]
		if m.Role != "tool" || red.later[i] >= 0 {
			continue
		}
		c := t.calls[i]
		switch g := t.byBody[t.bodies[i]]; {
		case trimmable(m) && g.count > 1:
			red.working[i] = true
		case !c.known || c.edit:
		case c.path != "":
			g := t.byRead[[2]string{c.name, c.path}]
			red.working[i] = g.count > 1 || t.edited[c.path]
		default:
			g := t.byCmd[[2]string{c.name, c.args}]
			red.working[i] = g.count > 1 && g.last == i
		}
	}
	r.red = red
	return red
}

// tally is the view's tool results grouped: by text (without the
// envelope), by file read (tool, path), by command (tool, arguments); and
// the files an edit named.
type tally struct {
	calls         []call
	bodies        [][32]byte
	byBody        map[[32]byte]*group
	byRead, byCmd map[[2]string]*group
	edited        map[string]bool
}

// tallied groups the view's tool results (one digest per text result).
func (r *run) tallied() *tally {
	t := &tally{calls: r.calls(), bodies: make([][32]byte, r.n), byBody: map[[32]byte]*group{},
		byRead: map[[2]string]*group{}, byCmd: map[[2]string]*group{}, edited: map[string]bool{}}
	bump := func(g *group, i int) *group {
		if g == nil {
			return &group{last: i, count: 1}
		}
		g.last, g.count = i, g.count+1
		return g
	}
	for i := r.lead; i < r.n; i++ {
		m := &r.msgs[i]
		if m.Role != "tool" {
			continue
		}
		if trimmable(m) {
			t.bodies[i] = bodyDigest(m)
			t.byBody[t.bodies[i]] = bump(t.byBody[t.bodies[i]], i)
		}
		switch c := t.calls[i]; {
		case !c.known:
		case c.edit && c.path != "":
			t.edited[c.path] = true
		case c.path != "":
			k := [2]string{c.name, c.path}
			t.byRead[k] = bump(t.byRead[k], i)
		default:
			k := [2]string{c.name, c.args}
			t.byCmd[k] = bump(t.byCmd[k], i)
		}
	}
	return t
}

// reduced returns message i as a reduction record of keep (≤ 0) renders
// it: a placeholder naming its call (keepMask) or a pointer to the later
// result at i − keep. ok is false when the record does not apply (no known
// call, not a text result, or not shorter).
func (r *run) reduced(i, keep int) (chat.Message, bool) {
	m := r.msgs[i]
	if !trimmable(&m) {
		return m, false
	}
	var text string
	switch {
	case keep == keepMask:
		c := r.callAt(i)
		if !c.known {
			return m, false
		}
		text = "[compactproxy: the result of " + c.shown() + " was elided (" +
			groupThousands(max(m.TextBytes, 0)) + " characters); call it again if it is needed]"
	default:
		j := i - keep
		c := r.callAt(j)
		if j <= i || j >= r.n || !c.known {
			return m, false
		}
		if bodyDigest(&m) != bodyDigest(&r.msgs[j]) {
			text = "[compactproxy: an older read; the later result of " + c.shown() + " is current]"
		} else {
			text = "[compactproxy: identical to the later result of " + c.shown() + "]"
		}
	}
	if len(text) >= m.TextBytes {
		return m, false
	}
	if m.ContentIsString {
		return chat.WithContentText(m, text), true
	}
	return chat.WithContentTextPart(m, text), true // the array keeps its shape
}

// reducible tells whether step 0 may replace message i under p: a tool
// result after the head's start and before the tail, not the final
// message, not dropped, not yet reduced (an excerpt may be).
func (r *run) reducible(p plan, i, from, to int) bool {
	if i < max(from, r.lead) || i >= to || i >= r.n-1 || r.msgs[i].Role != "tool" {
		return false
	}
	if k, ok := p.trims[i]; ok && k <= keepMask {
		return false
	}
	return !p.dropped(i) && !(p.sum != nil && i < p.sum.Cut)
}

// dedupe turns every tool result in [from, to) that a later one repeats
// into a pointer to it (lossless: the later result is forwarded). It
// returns the new estimate.
func (r *run) dedupe(p *plan, from, to, cur int) int {
	red := r.reductions()
	var idx []int
	keeps := map[int]int{}
	for i := from; i < to; i++ {
		j := red.later[i]
		if j < 0 || red.working[i] || !r.reducible(*p, i, from, to) {
			continue
		}
		if _, ok := r.reduced(i, i-j); ok {
			idx = append(idx, i)
			keeps[i] = i - j
		}
	}
	if len(idx) == 0 {
		return cur
	}
	q := p.withTrims(nil, 0)
	for _, i := range idx {
		q.trims[i] = keeps[i]
	}
	*p = q
	return r.est(r.view(*p))
}

// mask replaces the oldest tool results in [from, to) outside the working
// set by placeholders naming their calls, as few as bring the view below
// target; a batch that ends before an earlier cut (the end of the records
// re-applied now) runs on to it, so the next batch starts after the part
// of the prefix this one changes. It returns the new estimate and whether
// the target was reached.
func (r *run) mask(p *plan, from, to, cur, target int) (int, bool) {
	red := r.reductions()
	var cands []int
	for i := from; i < to; i++ {
		if red.working[i] || !r.reducible(*p, i, from, to) {
			continue
		}
		if _, ok := r.reduced(i, keepMask); ok {
			cands = append(cands, i)
		}
	}
	if len(cands) == 0 {
		return cur, false
	}
	hi, hiEst, ok := r.fewestBelow(*p, cands, keepMask, target)
	if !ok {
		*p = p.withTrims(cands, keepMask)
		return hiEst, false
	}
	// Align the batch's end with the earlier cut.
	if c := r.earlierCut(); c > cands[hi-1] {
		for hi < len(cands) && cands[hi] < c {
			hi++
		}
		hiEst = r.est(r.view(p.withTrims(cands[:hi], keepMask)))
	}
	*p = p.withTrims(cands[:hi], keepMask)
	return hiEst, true
}

// earlierCut is where the compaction records re-applied now end: the
// position after the last of them (a trim, mask or pointer, a drop, the
// summary's cut), 0 when none.
func (r *run) earlierCut() int {
	c := 0
	for i := range r.reapplied {
		c = max(c, i+1)
	}
	if s := r.base.sum; s != nil {
		c = max(c, s.Cut)
	}
	for _, d := range r.base.drops {
		c = max(c, d.To)
	}
	return c
}
