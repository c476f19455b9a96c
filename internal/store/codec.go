package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
)

// The bolt and redis backends store anchors and lineages in a compact
// binary form of their own (varints, raw 32-byte digests): gob would add
// its type descriptors to every value and JSON would double the digests,
// and DESIGN bounds a conversation to 2 KiB without summary text and trim
// records. Each value starts with a format version; a value of another
// version, or one that does not decode to its end, reads as absent, whole
// (a cache: it is rebuilt by later requests).

const (
	// v2: anchors carry their view's local estimate; a lineage has a list
	// of drops. v3: anchors carry the conversation's running totals
	// (SumInput, SumLocal); v2 anchors still read, with none.
	anchorsV2  = 2
	anchorsV3  = 3
	lineagesV1 = 2
)

const (
	flagSummary = 1 << iota
	flagDrop
	flagLatched
	flagAck
	flagAskInline
	flagAttempt
	flagPending
	// flagTokens: the summary (in the lineage flags) or the pending summary
	// (in its own flags) is followed by its Tokens bound. A later bit, so
	// values written before it still read.
	flagTokens
)

// errCodec reports a value this version cannot read.
var errCodec = errors.New("store: unreadable value")

func encodeAnchors(as []anchor.Anchor) []byte {
	b := make([]byte, 0, 2+len(as)*56)
	b = append(b, anchorsV3)
	b = binary.AppendUvarint(b, uint64(len(as)))
	for _, a := range as {
		b = binary.AppendUvarint(b, uint64(a.PrefixLen))
		b = append(b, a.Prefix[:]...)
		b = binary.AppendUvarint(b, uint64(a.Input))
		b = binary.AppendUvarint(b, uint64(a.Output))
		b = binary.AppendVarint(b, a.At)
		b = binary.AppendUvarint(b, uint64(max(a.Local, 0)))
		b = binary.AppendUvarint(b, uint64(max(a.SumInput, 0)))
		b = binary.AppendUvarint(b, uint64(max(a.SumLocal, 0)))
	}
	return b
}

func decodeAnchors(b []byte) ([]anchor.Anchor, error) {
	if len(b) == 0 {
		return nil, nil
	}
	r := reader{b: b}
	v := r.byte()
	if v != anchorsV3 && v != anchorsV2 {
		return nil, errCodec
	}
	n := r.count(40)
	as := make([]anchor.Anchor, 0, n)
	for range n {
		var a anchor.Anchor
		a.PrefixLen = int(r.uvarint())
		r.digest(&a.Prefix)
		a.Input = int(r.uvarint())
		a.Output = int(r.uvarint())
		a.At = r.varint()
		a.Local = int(r.uvarint())
		if v == anchorsV3 {
			a.SumInput = int(r.uvarint())
			a.SumLocal = int(r.uvarint())
		}
		as = append(as, a)
	}
	if r.err != nil {
		return nil, r.err // never a partial list (see decodeLineages)
	}
	return as, nil
}

func encodeLineages(ls []compaction.Lineage) []byte {
	b := make([]byte, 0, 2+len(ls)*200)
	b = append(b, lineagesV1)
	b = binary.AppendUvarint(b, uint64(len(ls)))
	for _, l := range ls {
		b = binary.BigEndian.AppendUint64(b, l.ID)
		b = binary.AppendUvarint(b, uint64(l.TipLen))
		b = append(b, l.Tip[:]...)
		b = binary.AppendUvarint(b, uint64(l.Gen))
		b = binary.AppendVarint(b, l.Used)
		st := &l.State
		var f byte
		if st.Summary != nil {
			f |= flagSummary
			if st.Summary.Ack {
				f |= flagAck
			}
			if st.Summary.AskInline {
				f |= flagAskInline
			}
			if st.Summary.Tokens > 0 {
				f |= flagTokens
			}
		}
		if len(st.Drops) > 0 {
			f |= flagDrop
		}
		if st.Latched {
			f |= flagLatched
		}
		if !st.LastAttempt.IsZero() {
			f |= flagAttempt
		}
		if st.Pending != nil {
			f |= flagPending
		}
		b = append(b, f)
		b = binary.AppendUvarint(b, uint64(st.LatchCount))
		if f&flagAttempt != 0 {
			b = binary.AppendVarint(b, st.LastAttempt.UnixNano())
		}
		b = binary.AppendUvarint(b, uint64(st.LastAttemptCount))
		if s := st.Summary; s != nil {
			b = binary.AppendUvarint(b, uint64(s.Cut))
			b = append(b, s.Head[:]...)
			b = binary.AppendUvarint(b, uint64(s.Lead))
			b = binary.AppendVarint(b, int64(s.Ask))
			b = binary.AppendUvarint(b, uint64(len(s.Text)))
			b = append(b, s.Text...)
			if s.Tokens > 0 {
				b = binary.AppendUvarint(b, uint64(s.Tokens))
			}
		}
		if ps := st.Pending; ps != nil {
			var pf byte
			if ps.Ack {
				pf |= flagAck
			}
			if ps.AskInline {
				pf |= flagAskInline
			}
			if ps.Tokens > 0 {
				pf |= flagTokens
			}
			b = append(b, pf)
			b = binary.AppendUvarint(b, uint64(ps.Cut))
			b = append(b, ps.Head[:]...)
			b = binary.AppendUvarint(b, uint64(ps.Lead))
			b = binary.AppendVarint(b, int64(ps.Ask))
			b = binary.AppendUvarint(b, uint64(len(ps.Text)))
			b = append(b, ps.Text...)
			if ps.Tokens > 0 {
				b = binary.AppendUvarint(b, uint64(ps.Tokens))
			}
		}
		if len(st.Drops) > 0 {
			b = binary.AppendUvarint(b, uint64(len(st.Drops)))
			for _, d := range st.Drops {
				b = binary.AppendUvarint(b, uint64(d.From))
				b = binary.AppendUvarint(b, uint64(d.To))
				b = append(b, d.Prefix[:]...)
			}
		}
		b = binary.AppendUvarint(b, uint64(len(st.Trims)))
		for _, t := range st.Trims {
			b = binary.AppendUvarint(b, uint64(t.Index))
			b = append(b, t.Prefix[:]...)
			b = binary.AppendUvarint(b, uint64(t.Keep))
		}
	}
	return b
}

func decodeLineages(b []byte) ([]compaction.Lineage, error) {
	if len(b) == 0 {
		return nil, nil
	}
	r := reader{b: b}
	if r.byte() != lineagesV1 {
		return nil, errCodec
	}
	n := r.count(compaction.MaxLineages * 4)
	ls := make([]compaction.Lineage, 0, n)
	for range n {
		var l compaction.Lineage
		l.ID = r.uint64()
		l.TipLen = int(r.uvarint())
		r.digest(&l.Tip)
		l.Gen = uint32(r.uvarint())
		l.Used = r.varint()
		st := &l.State
		f := r.byte()
		st.Latched = f&flagLatched != 0
		st.LatchCount = int(r.uvarint())
		if f&flagAttempt != 0 {
			st.LastAttempt = time.Unix(0, r.varint())
		}
		st.LastAttemptCount = int(r.uvarint())
		if f&flagSummary != 0 {
			s := &compaction.Summary{Ack: f&flagAck != 0, AskInline: f&flagAskInline != 0}
			s.Cut = int(r.uvarint())
			r.digest(&s.Head)
			s.Lead = int(r.uvarint())
			s.Ask = int(r.varint())
			s.Text = string(r.bytes(int(r.uvarint())))
			if f&flagTokens != 0 {
				s.Tokens = int(r.uvarint())
			}
			st.Summary = s
		}
		if f&flagPending != 0 {
			pf := r.byte()
			ps := &compaction.Summary{Ack: pf&flagAck != 0, AskInline: pf&flagAskInline != 0}
			ps.Cut = int(r.uvarint())
			r.digest(&ps.Head)
			ps.Lead = int(r.uvarint())
			ps.Ask = int(r.varint())
			ps.Text = string(r.bytes(int(r.uvarint())))
			if pf&flagTokens != 0 {
				ps.Tokens = int(r.uvarint())
			}
			st.Pending = ps
		}
		if f&flagDrop != 0 {
			nd := r.count(1 << 10)
			st.Drops = make([]compaction.Drop, 0, nd)
			for range nd {
				var d compaction.Drop
				d.From = int(r.uvarint())
				d.To = int(r.uvarint())
				r.digest(&d.Prefix)
				st.Drops = append(st.Drops, d)
			}
		}
		if nt := r.count(1 << 16); nt > 0 {
			st.Trims = make([]compaction.Trim, 0, nt)
			for range nt {
				var t compaction.Trim
				t.Index = int(r.uvarint())
				r.digest(&t.Prefix)
				t.Keep = int(r.uvarint())
				st.Trims = append(st.Trims, t)
			}
		}
		ls = append(ls, l)
		if r.err != nil {
			break
		}
	}
	if r.err != nil {
		// Never a partial list: the lineage where reading failed is half
		// read and the ones after it would be zero values; a caller that
		// kept them would store them back over the value. An unreadable
		// value reads as absent, like one of another version.
		return nil, r.err
	}
	return ls, nil
}

// reader decodes with a sticky error: after the first short or bad read
// every read returns zero and err says why.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail() {
	if r.err == nil {
		r.err = fmt.Errorf("%w: truncated", errCodec)
	}
	r.b = nil
}

func (r *reader) byte() byte {
	if len(r.b) < 1 {
		r.fail()
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *reader) uint64() uint64 {
	if len(r.b) < 8 {
		r.fail()
		return 0
	}
	v := binary.BigEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

func (r *reader) uvarint() uint64 {
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail()
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) varint() int64 {
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.fail()
		return 0
	}
	r.b = r.b[n:]
	return v
}

// count reads a length and bounds it (a corrupt value never allocates much).
func (r *reader) count(limit int) int {
	n := r.uvarint()
	if n > uint64(limit) {
		r.fail()
		return 0
	}
	return int(n)
}

func (r *reader) digest(d *anchor.Digest) {
	copy(d[:], r.bytes(len(d)))
}

func (r *reader) bytes(n int) []byte {
	if n < 0 || len(r.b) < n {
		r.fail()
		return nil
	}
	v := r.b[:n:n]
	r.b = r.b[n:]
	return v
}
