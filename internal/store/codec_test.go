package store

import (
	"encoding/binary"
	"reflect"
	"testing"
	"time"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/compaction"
)

// Every field of a lineage and of an anchor survives the binary encoding.
func TestCodecRoundTrip(t *testing.T) {
	var d1, d2, d3 anchor.Digest
	d1[0], d2[5], d3[31] = 1, 2, 3
	ls := []compaction.Lineage{{
		ID: 42, TipLen: 90, Tip: d1, Gen: 7, Used: 1700000000,
		State: compaction.State{
			Summary:    &compaction.Summary{Cut: 30, Head: d2, Lead: 1, Text: "summary é", Ack: true, Ask: 12, Tokens: 64},
			Pending:    &compaction.Summary{Cut: 60, Head: d3, Lead: 1, Text: "pending", AskInline: true, Ask: 41, Tokens: 300},
			Trims:      []compaction.Trim{{Index: 33, Prefix: d1, Keep: 2048}},
			Drops:      []compaction.Drop{{From: 31, To: 35, Prefix: d2}, {From: 36, To: 50, Prefix: d3}},
			Latched:    true,
			LatchCount: 64, LastAttempt: time.Unix(0, 1700000000123456789), LastAttemptCount: 64,
		},
	}}
	got, err := decodeLineages(encodeLineages(ls))
	if err != nil || !reflect.DeepEqual(got, ls) {
		t.Fatalf("lineages round trip: %v\n got %+v\nwant %+v", err, got, ls)
	}
	// Without a Tokens bound (values written before it had none): the
	// same bytes as then, and the same lineage back.
	ls[0].State.Summary.Tokens, ls[0].State.Pending.Tokens = 0, 0
	got, err = decodeLineages(encodeLineages(ls))
	if err != nil || !reflect.DeepEqual(got, ls) {
		t.Fatalf("lineages without Tokens round trip: %v\n got %+v\nwant %+v", err, got, ls)
	}
	as := []anchor.Anchor{{PrefixLen: 90, Prefix: d1, Input: 5000, Output: 30, At: 1700000000, Local: 3100, SumInput: 4100, SumLocal: 2700}}
	if got, err := decodeAnchors(encodeAnchors(as)); err != nil || !reflect.DeepEqual(got, as) {
		t.Fatalf("anchors round trip: %v %+v", err, got)
	}
	// Anchors written before the running totals (v2) still read, with
	// none.
	v2 := []byte{anchorsV2, 1, 90}
	v2 = append(v2, d1[:]...)
	v2 = binary.AppendUvarint(binary.AppendUvarint(v2, 5000), 30)
	v2 = binary.AppendUvarint(binary.AppendVarint(v2, 1700000000), 3100)
	as[0].SumInput, as[0].SumLocal = 0, 0
	if got, err := decodeAnchors(v2); err != nil || !reflect.DeepEqual(got, as) {
		t.Fatalf("v2 anchors: %v %+v", err, got)
	}
}
