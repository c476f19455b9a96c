package proxy

import (
	"fmt"
	"net/http"

	"github.com/compactproxy/compactproxy/internal/chat"
	"github.com/compactproxy/compactproxy/internal/compaction"
	"github.com/compactproxy/compactproxy/internal/pairing"
	"go.uber.org/zap"
)

// pair is the pair stage: pairing.mode applied to the client's view,
// which it returns checked. In strict mode a violation is the client's
// error (400 invalid_tool_pairing, the first violation in message order);
// in repair mode the view is repaired.
//
// A body whose messages are all, and only, those of the parse cache entry
// it was parsed after has that entry's verdict (identity.Parse.PairingClean).
func (s *Server) pair(r *http.Request, ar *apiRequest) (checked, error) {
	ci := ar.info
	msgs := ar.req.Messages
	view := checked{msgs: msgs, unchanged: ar.req.Unchanged(msgs)}
	if ar.opaque {
		return view, nil // the turn's calls are in the upstream's stored response
	}
	if ar.parse.PairingClean(ar.req, msgs) {
		view.clean = true
		return view, nil
	}
	pv := compaction.PairingView(msgs)
	vs := pairing.Check(pv)
	if len(vs) == 0 {
		view.clean = true
		return view, nil
	}
	kinds := make([]string, 0, len(vs))
	for _, v := range vs {
		s.metrics.PairingViolations.WithLabelValues(string(v.Kind)).Inc()
		kinds = append(kinds, string(v.Kind))
	}
	ri := infoFrom(r.Context())
	switch s.cfg.Pairing.Mode {
	case "off":
		return view, nil
	case "repair":
		_, removed := pairing.Repair(pv)
		view = checked{msgs: applyRemovals(msgs, removed)}
		ar.respHeaders.Set("X-Compactproxy-Pairing", "repaired")
		ci.pairing = "repaired"
		s.log.Info("pairing repaired", zap.String("request_id", ri.id), zap.Strings("kinds", kinds), zap.Int("removed", len(removed)))
		return view, nil
	}
	v := vs[0]
	idx := v.Index
	param := fmt.Sprintf("messages[%d]", idx)
	if idx >= 0 && idx < len(msgs) {
		idx = msgs[idx].Index
		param = ar.api.PairingParam(ar.req, idx) // the client's item, not the chat message
	}
	ci.pairing = "rejected"
	s.log.Info("pairing violation", zap.String("request_id", ri.id), zap.Strings("kinds", kinds))
	return checked{}, &clientError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "invalid_tool_pairing",
		param: param, detail: ar.api.DescribePairing(v, param, idx)}
}

// applyRemovals applies pairing.Repair's removals to the chat messages:
// whole messages are dropped, single tool_calls entries cut out of the raw
// JSON (other bytes kept).
func applyRemovals(msgs []chat.Message, removed []pairing.Removal) []chat.Message {
	whole := map[int]bool{}
	calls := map[int][]int{}
	for _, r := range removed {
		if r.Call < 0 {
			whole[r.Index] = true
		} else {
			calls[r.Index] = append(calls[r.Index], r.Call)
		}
	}
	out := make([]chat.Message, 0, len(msgs))
	for i, m := range msgs {
		if whole[i] {
			continue
		}
		if c, ok := calls[i]; ok {
			m = chat.DropToolCalls(m, c)
		}
		out = append(out, m)
	}
	return out
}
